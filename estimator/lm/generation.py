"""The text a causal LM generates for transform's output_kind='generate', on the executors over one Arrow batch
at a time, with the model cached per worker (estimator.predict.inference).

Two ways, chosen by `batching_for` (the generation_batching param):
- 'continuous' (estimator.lm.continuous): the batch's prompts queued on transformers' continuous batching, rows
  leaving and joining the running batch at every step; 'auto' takes it on a GPU where the model and the
  generate_kwargs allow it;
- 'padded': the prompts (or chats rendered up to the assistant's turn, estimator.data.lm) sorted by length within
  the batch, so that each generate() call pads little; left-padded (a decoder continues from the last position);
  the model's own generate() with its KV cache ('auto' on a CPU, where continuous batching is slower, and for
  keywords only generate() has: num_beams, repetition_penalty, ...).
Either way greedy unless generate_kwargs asks for sampling (a 'seed' there seeds each call: the same prompts give
the same text); at most max_new_tokens, stopping at eos; the new tokens decoded without special tokens, back in the
rows' order. torch only, no pyspark."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

from estimator.core.adapters import base_config, model_positions
from estimator.data.lm import eos_id, pad_id, prompt_ids
from estimator.lm.continuous import continuous_ids, continuous_refusal, unsupported


# rows x (longest prompt + max_new_tokens) per generate() call, by default: on a GPU, and on a CPU, where smaller
# calls waste less on rows that have ended and on padding (128 prompts, 24/96 new tokens: 0.95/1.98 s at 16,384
# against 1.39/2.35 s at 65,536; benchmarks/RESULTS.md)
GENERATE_TOKENS = {"cuda": 65_536, "cpu": 16_384}


def batches(lengths: Sequence[int], order: Sequence[int], batch_size: Optional[int], max_new_tokens: int,
            device: str = "cpu") -> List[List[int]]:
    """The rows of each generate() call, in `order` (shortest prompt first): `batch_size` rows each, or None: as
    many as keep rows x (their longest prompt + max_new_tokens) within the device's GENERATE_TOKENS (one row at
    least), the size of the sequences, and so of the KV cache, a call holds."""
    if batch_size is not None:
        return [list(order[start:start + batch_size]) for start in range(0, len(order), batch_size)]
    budget = GENERATE_TOKENS["cuda" if device.startswith("cuda") else "cpu"]
    out: List[List[int]] = []
    for i in order:
        if out and (len(out[-1]) + 1) * (lengths[i] + max_new_tokens) <= budget:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def batching_for(choice: str, model: Any, device: str, generate_kwargs: Optional[Dict[str, Any]]) -> str:
    """'continuous' or 'padded' for generation_batching=`choice`: 'auto' is 'continuous' on a CUDA device when the
    model has continuous batching and generate_kwargs holds only what it honours, else 'padded'. ('continuous'
    where it cannot be is refused before any job: estimator.predict.language_checks.check_generation_batching.)"""
    if choice != "auto":
        return choice
    can = (device.startswith("cuda") and continuous_refusal(generate_kwargs) is None
           and unsupported(model) is None)
    return "continuous" if can else "padded"


def generate_texts(model: Any, tokenizer: Any, values: Sequence[Any], chat: bool, column: str,
                   batch_size: Optional[int], device: str, max_new_tokens: int,
                   generate_kwargs: Optional[Dict[str, Any]], tools: Optional[Sequence[Any]] = None,
                   batching: str = "auto") -> np.ndarray:
    """The text generated for each row of `values` (prompts, or chats: rendered with `tools`), as an object array
    of str."""
    prompts = prompt_ids(tokenizer, chat, values, column, tools)
    check_positions(model, prompts, values, column, max_new_tokens)
    kwargs = dict(generate_kwargs or {})
    kwargs.setdefault("do_sample", False)
    pad = pad_id(tokenizer)
    kwargs.setdefault("pad_token_id", pad)  # a user's own pad or eos (a chat's end-of-turn token) is kept
    kwargs.setdefault("eos_token_id", eos_id(tokenizer))
    if kwargs.get("stop_strings"):  # generate() matches them in the text: the model's tokenizer, not asked twice
        kwargs.setdefault("tokenizer", tokenizer)
    texts: List[str] = [""] * len(prompts)
    padded = list(range(len(prompts)))
    if batching_for(batching, model, device, generate_kwargs) == "continuous":
        queued = [i for i in padded if prompts[i]]
        padded = [i for i in padded if not prompts[i]]  # an empty prompt (no BOS either) is generate()'s
        found = continuous_ids(model, [prompts[i] for i in queued], max_new_tokens, kwargs, device) if queued else []
        for i, text in zip(queued, tokenizer.batch_decode(found, skip_special_tokens=True)):
            texts[i] = text
    if padded:
        padded_texts(model, tokenizer, prompts, padded, texts, batch_size, device, max_new_tokens, kwargs)
    result = np.empty(len(texts), dtype=object)
    result[:] = texts
    return result


def check_positions(model: Any, prompts: Sequence[Sequence[int]], values: Sequence[Any], column: str,
                    max_new_tokens: int) -> None:
    """Each prompt's tokens plus max_new_tokens within the model's positions: past them transformers only warns,
    then writes garbage (rotary positions) or fails deep in the position embedding (learned ones). Refused, naming
    the row, rather than a plausible wrong text."""
    positions = model_positions(model)
    if positions is None:
        return
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]), default=None)
    if longest is None or len(prompts[longest]) + max_new_tokens <= positions:
        return
    over, room = sum(len(p) + max_new_tokens > positions for p in prompts), positions - len(prompts[longest])
    shown = str(values[longest])
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    fix = f"shorten those prompts to at most {positions - max_new_tokens} tokens" + (
        f", or lower max_new_tokens to {room} or less" if room >= 1 else "")
    raise ValueError(f"{over} of the {len(prompts)} prompts of column {column!r} in this batch leave no room for "
                     f"max_new_tokens={max_new_tokens} in the model's {positions} positions "
                     f"({type(base_config(model)).__name__}.max_position_embeddings): the longest, {shown!r}, "
                     f"takes {len(prompts[longest])} tokens. Past the positions the text is garbage or the model "
                     f"fails: {fix}.")


def padded_texts(model: Any, tokenizer: Any, prompts: List[List[int]], rows: Sequence[int], texts: List[str],
                 batch_size: Optional[int], device: str, max_new_tokens: int, kwargs: Dict[str, Any]) -> None:
    """The texts of prompts[rows] by model.generate() over sorted, left-padded batches, into `texts`."""
    order = sorted(rows, key=lambda i: len(prompts[i]))
    kwargs = dict(kwargs)
    seed = kwargs.pop("seed", None)
    pad = kwargs["pad_token_id"]
    with torch.inference_mode():
        beams = int(kwargs.get("num_beams", 1))  # each row's sequences in the call
        for call in batches([len(p) * beams for p in prompts], order, batch_size, max_new_tokens * beams, device):
            ids, mask = left_padded([prompts[i] for i in call], pad)
            width = ids.shape[1]
            if seed is not None:
                torch.manual_seed(int(seed))
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                 max_new_tokens=max_new_tokens, **kwargs)
            for j, text in enumerate(tokenizer.batch_decode(out[:, width:].cpu(), skip_special_tokens=True)):
                texts[call[j]] = text


def left_padded(prompts: Sequence[Sequence[int]], pad: int) -> "tuple[torch.Tensor, torch.Tensor]":
    """(input_ids, attention_mask) of a generate() call: the prompts left-padded with `pad` to the longest, so that
    every prompt ends at the last position, where a decoder continues."""
    width = max((len(p) for p in prompts), default=0)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for j, prompt in enumerate(prompts):
        if len(prompt):
            ids[j, width - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
            mask[j, width - len(prompt):] = 1
    return ids, mask


def sampled_groups(model: Any, prompts: Sequence[Sequence[int]], group: int, seeds: Optional[Sequence[int]],
                   max_new_tokens: int, generate_kwargs: Dict[str, Any], device: str) -> List[List[int]]:
    """`group` completions of each prompt (token ids, ending with the stop token where one came), completion j of
    prompt i drawn from a random stream of its own, of seeds[i] and j (estimator.lm.sampling), so that it is the same
    whatever else is sampled in its call: k ranks sample what one process does, to the last bits of the logits
    (a batch's padding moves them; a draw changes only where two tokens' noisy scores tie within that). The
    prompts go through generate() in calls sorted by length, left-padded, as many as the device's GENERATE_TOKENS
    hold. seeds None: greedy. The torch random state is left as it was. Prompt-major: completion j of prompt i at
    i x group + j. generate_kwargs: generate()'s, with pad_token_id and eos_token_id (a list of stops, or one)
    and the sampling warpers' values (temperature, top_k, top_p, ...)."""
    from transformers import LogitsProcessorList

    from estimator.lm.sampling import WARPER_KEYWORDS, RowDraws, row_seeds, warpers

    stops = generate_kwargs["eos_token_id"]
    stops = set(stops if isinstance(stops, (list, tuple)) else [stops])
    kwargs = {k: v for k, v in generate_kwargs.items() if k not in WARPER_KEYWORDS}
    warp = warpers(model, generate_kwargs) if seeds is not None else []
    drawn = row_seeds(seeds, group) if seeds is not None else None
    pad = kwargs["pad_token_id"]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: List[List[int]] = [[] for _ in range(len(prompts) * group)]
    devices = [torch.device(device).index or 0] if device.startswith("cuda") else []
    with torch.inference_mode(), torch.random.fork_rng(devices=devices):
        for call in batches([len(p) * group for p in prompts], order, None, max_new_tokens * group, device):
            rows = [i * group + j for i in call for j in range(group)]
            ids, mask = left_padded([prompts[i] for i in call], pad)
            ids, mask = ids.to(device), mask.to(device)
            width = ids.shape[1]
            cached = prefilled(model, ids, mask, group)
            processors = LogitsProcessorList(
                [RowDraws([drawn[r] for r in rows], width, warp, device)] if drawn is not None else [])
            new = model.generate(input_ids=ids.repeat_interleave(group, 0),
                                 attention_mask=mask.repeat_interleave(group, 0), do_sample=False,
                                 logits_processor=processors, max_new_tokens=max_new_tokens,
                                 **cached, **kwargs)[:, width:].tolist()
            for row, tokens in zip(rows, new):
                out[row] = cut_at_stop(tokens, stops)
    return out


def prefilled(model: Any, ids: torch.Tensor, mask: torch.Tensor, group: int) -> Dict[str, Any]:
    """generate()'s keyword holding the KV cache of the left-padded prompts `ids` but their last token, computed
    once a prompt and repeated `group` times (each prompt's rows next to each other): generate() then runs only
    the last token of each of the group's rows before its first draw, not the whole prompt `group` times. The
    positions are those generate() gives a left-padded row. {} where there is nothing to share (one row a
    prompt, one-token prompts) or the model's cache cannot be repeated (a legacy tuple): generate() then reads
    each row's prompt itself."""
    import inspect

    if group < 2 or ids.shape[1] < 2:
        return {}
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft's forward takes **kwargs
    takes = inspect.signature(inner.forward).parameters
    name = "cache" if "cache" in takes else "past_key_values"
    extra = {}
    if "position_ids" in takes:  # as generate() gives them (a model without them places tokens otherwise: ALiBi)
        extra["position_ids"] = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)[:, :-1]
    out = model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], use_cache=True, **extra)
    cache = getattr(out, "cache", None)
    cache = getattr(out, "past_key_values", None) if cache is None else cache
    if not hasattr(cache, "batch_repeat_interleave"):
        return {}
    cache.batch_repeat_interleave(group)
    return {name: cache}


def cut_at_stop(tokens: Sequence[int], stops: Any) -> List[int]:
    """The tokens up to and with the first of `stops` (all of them where none came): what a row generated."""
    return list(tokens[:next((n + 1 for n, t in enumerate(tokens) if t in stops), len(tokens))])
