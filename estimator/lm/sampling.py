"""Sampling in which each row draws from a random stream of its own: GRPO's completions (issue 66), drawn in
generate() calls of many prompts at once, where each completion is still what its seed alone gives.

generate()'s own sampling draws every row's next token from one generator (torch.multinomial over the batch), so
a row's draws depend on which rows share its call, and k ranks would sample other completions than one process of
their rows. Here generate() runs greedy, and its last logits processor (`RowDraws`) draws each row's token itself
by the Gumbel-max rule: the warped scores (temperature, top-k, top-p, as transformers' own warpers compute them)
plus noise -log(-log u), the argmax is a draw from softmax(scores). Each u is a hash of (the row's seed, the new
token's index, the vocabulary's token): no generator state, the same on any device and in any batch. The
processor returns the drawn token alone, which greedy picks. torch and transformers only."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch

# splitmix64's constants (Steele, Lea and Flood 2014), as int64: the golden ratio's increment and the finalizer's
# two multipliers
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)

# generation_config's warpers, by the name of the value that turns each on (None or its default: off), as
# transformers applies them after temperature, top-k and top-p
_OTHER_WARPERS = {"min_p": None, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0}

# elements of noise made at once (rows x vocabulary, one row at least), by device type: on a GPU 128 MB an int64
# temporary (125 rows at Llama 3's 128,256 tokens); on a CPU what stays in its caches: 64 rows x 128,256 took 125
# ms a token in rows of 2**16 elements against 197 ms at 2**22 and 750 ms at once (each large temporary's pages
# faulted in anew), where softmax and torch.multinomial took 174-228 ms (2 cores)
NOISE_ELEMENTS = {"cuda": 2 ** 24, "cpu": 2 ** 16}

# generate() keywords that `warpers` reads (and generate() is then not given: it runs greedy)
WARPER_KEYWORDS = frozenset({"temperature", "top_k", "top_p", *_OTHER_WARPERS})


def _shifted(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x >> bits as unsigned 64-bit integers (int64's >> keeps the sign)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mixed(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's output function of int64 `x` (wrapping multiplication): a 64-bit hash, elementwise."""
    x = x + _GOLDEN
    x = (x ^ _shifted(x, 30)) * _MIX1
    x = (x ^ _shifted(x, 27)) * _MIX2
    return x ^ _shifted(x, 31)


def uniforms(seeds: torch.Tensor, index: int, vocabulary: int) -> torch.Tensor:
    """rows x vocabulary uniforms in (0, 1), float64 with 53 random bits: row r's are a function of seeds[r] and
    `index` (the new token's position in the completion) only."""
    return _uniforms(seeds, _index_key(index), _token_keys(vocabulary, seeds.device))


def _index_key(index: int) -> int:
    return int(mixed(torch.tensor(index, dtype=torch.int64)))  # on the host: no copy to the device


def _token_keys(vocabulary: int, device: Any) -> torch.Tensor:
    return torch.arange(vocabulary, dtype=torch.int64, device=device) * _GOLDEN


def _uniforms(seeds: torch.Tensor, index_key: int, token_keys: torch.Tensor) -> torch.Tensor:
    key = mixed(mixed(seeds.to(torch.int64) ^ index_key))
    bits = _shifted(mixed(key[:, None] ^ token_keys[None, :]), 11)
    return (bits.to(torch.float64) + 0.5) / float(1 << 53)


def row_seeds(seeds: Sequence[int], group: int) -> List[int]:
    """Completion j of prompt i's seed, from the prompt's: a hash of both (prompt-major, as sampled_groups)."""
    keys = torch.tensor([int(s) & ((1 << 62) - 1) for s in seeds for _ in range(group)], dtype=torch.int64)
    draws = torch.arange(group, dtype=torch.int64).repeat(len(seeds))
    return mixed(keys ^ mixed(draws)).tolist()


def warpers(model: Any, kwargs: Dict[str, Any]) -> List[Any]:
    """transformers' sampling warpers for generate() keywords `kwargs` over the model's generation_config, in its
    order: what do_sample=True would apply to the scores before drawing."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
    from transformers.generation import logits_process as lp

    config = getattr(model, "generation_config", None)

    def value(name: str, default: Any) -> Any:
        found = kwargs.get(name, getattr(config, name, default))
        return default if found is None else found

    out: List[Any] = []
    temperature, top_k, top_p = value("temperature", 1.0), value("top_k", 0), value("top_p", 1.0)
    if temperature != 1.0:
        out.append(TemperatureLogitsWarper(temperature))
    if top_k:
        out.append(TopKLogitsWarper(top_k=top_k))
    if top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=top_p))
    classes = {"min_p": lp.MinPLogitsWarper, "typical_p": lp.TypicalLogitsWarper,
               "epsilon_cutoff": lp.EpsilonLogitsWarper, "eta_cutoff": lp.EtaLogitsWarper}
    for name, off in _OTHER_WARPERS.items():
        found = value(name, off)
        if found != off:
            out.append(classes[name](found))
    return out


class RowDraws:
    """generate()'s last logits processor: each row's next token drawn from softmax of the warped scores under
    the row's own stream (its seed, the token's index), returned as the only finite score (greedy picks it).

    Attributes:
        seeds: One int64 seed per row of the call.
        width: The call's prompt width (input_ids' length before the first new token).
        warpers: transformers' warpers to apply first (`warpers`).
    """

    def __init__(self, seeds: Sequence[int], width: int, warpers: Sequence[Any], device: Any):
        self.seeds = torch.tensor(list(seeds), dtype=torch.int64, device=device)
        self.width = width
        self.warpers = list(warpers)
        self._tokens: Optional[torch.Tensor] = None  # each token's hash key, made at the first token

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for warp in self.warpers:
            scores = warp(input_ids, scores)
        index, vocabulary = _index_key(input_ids.shape[1] - self.width), scores.shape[-1]
        if self._tokens is None or self._tokens.shape[0] != vocabulary:  # the same at every token of the call
            self._tokens = _token_keys(vocabulary, self.seeds.device)
        rows = max(1, NOISE_ELEMENTS.get(scores.device.type, NOISE_ELEMENTS["cuda"]) // vocabulary)
        drawn = torch.cat([
            (scores[start:start + rows].to(torch.float64)  # -inf (warped out) stays -inf
             - torch.log(-torch.log(_uniforms(self.seeds[start:start + rows], index, self._tokens)))).argmax(-1)
            for start in range(0, scores.shape[0], rows)])
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(-1, drawn[:, None], 0.0)
