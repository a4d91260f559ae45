"""The objective of a causal language model's fine-tuning: next-token cross entropy over the labelled tokens
(estimator.data.lm: the response's, or the assistant turns'), weighted by tokens, not rows.

Its sums are the loss summed over the labelled tokens, its weight (those tokens) and the rows: the epoch's loss is
the first over the second, exact over all ranks, and the perplexity is exp of it. The loss it returns for backward
is the batch's *sum* (`weighting = PerWeight`): the gradients are divided by the labelled tokens of the whole
accumulation window over all ranks (estimator.train.weighting), which is what one process would compute over the
same rows at batch k*b (a mean of the ranks' means would weight a rank's short responses as much as another's
long ones). The loss is computed chunk by chunk from the last hidden states where that is the model's own loss
(estimator.lm.chunked_loss: never the vocabulary's logits in float32 at once), else from the
forward's logits. torch only, no pyspark."""
from __future__ import annotations

import logging
import math
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
import torch.nn.functional as F

from estimator.core.adapters import can_generate
from estimator.core.handle import on_meta
from estimator.core.outputs import forward, logits_of
from estimator.data.arrays import to_tensors
from estimator.data.lm import IGNORE, packed_rows
from estimator.failures import FailureKind, failure_kind
from estimator.train.objectives.base import BuiltIn, built_in_loop, summarize_means
from estimator.lm.chunked_loss import chunked_token_loss, hidden_states, output_head
from estimator.train.sums import WEIGHT, Sums
from estimator.train.weighting import PerWeight

log = logging.getLogger("estimator")



class TokenObjective(BuiltIn):
    """The built-in step of a causal LM: forward on the tokens, cross entropy of each position's logits against
    the next token's label."""

    weighting = PerWeight
    layout = Sums.of_loss()
    transform_output = "generate"  # a fitted causal LM's transform writes text (estimator.predict)
    rows = "sft"  # prompts and responses, chats or texts, tokenized with their labels (estimator.data.rows)
    gradient_clip_val = 1.0  # 'auto' clips as TRL's SFTTrainer does (max_grad_norm=1.0)
    driver_forward = False  # the driver counts the labelled tokens; the ranks' first batch checks the forward

    @classmethod
    def applies(cls, p: Mapping[str, Any]) -> bool:
        """The built-in loop (no loss, train_step, train_fn) with a tokenizer, over a model that generates (a
        transformers causal LM, or peft's model around one)."""
        return (built_in_loop(p) and p.get("tokenizer") is not None
                and can_generate(p.get("model")))

    @classmethod
    def history_keys(cls, p: Mapping[str, Any]) -> List[str]:
        return [*super().history_keys(p), "perplexity"]

    @classmethod
    def for_rank(cls, spec: Any, objs: Any, model: Any, trainer: Any) -> "TokenObjective":
        return cls()

    @classmethod
    def dry_run(cls, model: Any, data: Any, arrays: Any, rows: int) -> List[tuple]:
        return dry_tokens(model, data, arrays, rows)

    def __init__(self) -> None:
        self._rows: Dict[Tuple[int, Any], torch.Tensor] = {}  # the rows slot's value, by batch size and device
        self._plain: set = set()  # the heads whose model's forward was found not to return their output as logits
        self._checked = False  # the first batch is the forward's check, which the driver left to the ranks

    def on_batch(self, model: Any, tensors: Any, ctx: Any = None) -> Tuple[torch.Tensor, torch.Tensor]:
        if self._checked:
            return self.batch_loss(model, tensors)
        try:
            check_packed(model, tensors[0][0])
            done = self.batch_loss(model, tensors)
        except Exception as exc:  # noqa: BLE001 - the user's model: typed, never retried
            if failure_kind(exc) is not FailureKind.USER:  # a peer gone, a module missing: theirs to say
                raise
            features, labels, _ = tensors
            raise ModelFailed(f"The causal LM failed on its first batch of {labels[0].shape[0]} rows (tokens "
                              f"{tuple(features[0].shape)}): {type(exc).__name__}: {exc}") from exc
        self._checked = True
        return done

    def batch_loss(self, model: Any, tensors: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        features, labels, _ = tensors
        rows = packed_rows(features[0])  # packing=True: the rows its sequences hold (estimator.data.lm.packed)
        if rows is None:
            rows = labels[0].shape[0]
        else:  # no KV cache: transformers confines attention to each packed row only without one
            features = [dict(features[0], use_cache=False), *features[1:]]
        head, _ = output_head(model)
        if head is not None and id(head) not in self._plain:
            hidden = hidden_states(model, features, head, tuple(labels[0].shape))
            if hidden is not None:
                loss, tokens = chunked_token_loss(hidden, head, labels[0])
                return loss, self.batch_sums(loss, tokens, rows)
            self._plain.add(id(head))  # this batch and the next ones: the plain path (the forward runs again)
            log.warning("The causal LM's forward does not return its output head's result as its logits: its loss "
                        "is computed from the full logits in float32 (more memory).")
        raw = forward(model, features)
        logits = logits_of(raw) if not isinstance(raw, torch.Tensor) else raw
        if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
            raise ValueError(f"Fine-tuning a causal LM reads the logits of its forward (batch, tokens, vocabulary); "
                             f"it returned {type(raw).__name__}"
                             + (f" with logits of shape {tuple(logits.shape)}" if isinstance(logits, torch.Tensor)
                                else " without logits") + ". Use a model such as AutoModelForCausalLM.")
        loss, tokens = token_loss(logits, labels[0])
        return loss, self.batch_sums(loss, tokens, rows)

    def batch_sums(self, loss: torch.Tensor, tokens: torch.Tensor, rows: Any) -> torch.Tensor:
        """(loss, tokens, rows) in float64 by one concatenation: no vector filled element by element (each element
        a kernel launch). `rows`: a count, or a packed batch's as a tensor on the device."""
        if isinstance(rows, torch.Tensor):
            return torch.cat([loss.detach().double().reshape(1), tokens.double().reshape(1),
                              rows.double().reshape(1)])
        key = (rows, loss.device)
        if key not in self._rows:
            if len(self._rows) > 8:  # batch sizes vary (a last partial batch): keep a few
                self._rows.clear()
            self._rows[key] = torch.full((1,), float(rows), dtype=torch.float64, device=loss.device)
        return torch.cat([loss.detach().double().reshape(1), tokens.double().reshape(1), self._rows[key]])

    def weight_of(self, tensors: Any) -> torch.Tensor:
        """The labelled tokens of a batch (what its loss is summed over), known before its forward."""
        return (tensors[1][0][:, 1:] != IGNORE).sum()

    def summarize(self, train: Mapping[str, float], val: Optional[Mapping[str, float]]) -> Dict[str, float]:
        row = summarize_means(self.layout, train, val)
        for prefix in ("", "val_") if val is not None else ("",):
            loss = row[prefix + "loss"]
            row[prefix + "perplexity"] = math.exp(loss) if loss == loss and loss < 700 else float("inf")
        return row


def check_packed(model: Any, features: Any) -> None:
    """packing=True, on a rank's first batch: a row packed after another gets the logits it gets alone (its
    attention kept to itself), else ModelFailed names packing. The driver's check of the model's class
    (estimator.fit.language.packing) cannot see every way a model builds its attention and positions (ALiBi, an
    attention module of its own, positions from the attention mask): this forward does, once."""
    if packed_rows(features) is None:
        return
    positions, ids, cu = features["position_ids"], features["input_ids"], features["cu_seq_lens_q"]
    bounds = cu.tolist()  # one read, on the first batch only
    if len(bounds) < 3:  # one row: nothing packed to compare
        return
    a, b = bounds[1], bounds[2]
    with torch.no_grad():
        together = logits_of(forward(model, [{"input_ids": ids[:1, :b], "position_ids": positions[:1, :b],
                                               "cu_seq_lens_q": cu[:3], "use_cache": False}]))[0, a:b].float()
        alone = logits_of(forward(model, [{"input_ids": ids[:1, a:b], "position_ids": positions[:1, a:b],
                                           "cu_seq_lens_q": torch.tensor([0, b - a], dtype=cu.dtype, device=cu.device),
                                           "use_cache": False}]))[0].float()
    scale = float(alone.abs().max()) or 1.0
    if float((together - alone).abs().max()) > 2e-2 * scale:
        raise ModelFailed("packing=True: a row packed after another got other logits than alone (its attention "
                          f"or its positions reach the row before it in {type(model).__name__}): packing would "
                          "train on rows that see each other. Leave packing=False for this model.")


def dry_tokens(model: Any, data: Any, arrays: Any, rows: int) -> List[tuple]:
    """A causal LM's dry run (SFT's, DPO's: transform generates text, so no output shape): its loss on a few rows;
    a model on the meta device (a LoRA fit's driver holds no weights of the base: estimator.core.handle) only has
    its rows' labelled tokens counted, and the ranks' first batch checks its forward (TokenObjective.on_batch)."""
    tensors = to_tensors(arrays, data)
    objective = TokenObjective()
    if on_meta(model):
        sums = {WEIGHT: int(objective.weight_of(tensors))}
    else:
        try:
            with torch.no_grad():
                sums = objective.layout.named(objective.on_batch(model, tensors)[1].tolist())
        except Exception as exc:  # noqa: BLE001 - the user's model
            shape = ", ".join(f"{k}: {tuple(v.shape)}" for k, v in tensors[0][0].items())
            raise ValueError(f"The causal LM failed on {rows} training rows of {data.lm.column!r} (tokens "
                             f"{{{shape}}}): {type(exc).__name__}: {exc}") from None
    if not sums[WEIGHT]:
        raise ValueError(f"The first {rows} training rows have no response token left after max_length="
                         f"{data.max_length}: the prompts fill it. Raise max_length or shorten the prompts.")
    return []


class ModelFailed(ValueError):
    """The model's forward failed on the first batch, where the driver (which holds no weights of a LoRA fit's
    base) left its dry run: another launch would meet it again."""

    failure_kind = FailureKind.MODEL


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(the cross entropy summed over the labelled tokens, their count): position t's logits predict the label at
    t + 1, as the model's own loss computes it (in float32)."""
    target = labels[:, 1:]
    vocabulary = logits.shape[-1]
    loss = F.cross_entropy(logits[:, :-1, :].reshape(-1, vocabulary).float(), target.reshape(-1),
                           ignore_index=IGNORE, reduction="sum")
    return loss, (target != IGNORE).sum()
