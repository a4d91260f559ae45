"""The objective of a causal language model's fine-tuning: next-token cross entropy over the labelled tokens
(estimator.data.lm: the response's, or the assistant turns'), weighted by tokens, not rows.

Its sums are (loss summed over labelled tokens, labelled tokens, rows): the epoch's loss is the first over the
second, exact over all ranks, and the perplexity is exp of it. The loss it returns for backward is the batch's
*sum*; the loop divides the gradients by the labelled tokens of the whole accumulation window over all ranks
before the optimizer step (`TrainLoop.normalize`), which is what one process would compute over the same rows at
batch k*b (a mean of the ranks' means would weight a rank's short responses as much as another's long ones).
torch only, no pyspark."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Tuple

import torch
import torch.nn.functional as F

from estimator.core.outputs import forward, logits_of
from estimator.data.lm import IGNORE
from estimator.train.losses import summarize_sums


class TokenObjective:
    """The built-in step of a causal LM: forward on the tokens, cross entropy of each position's logits against
    the next token's label."""

    token_weighted = True  # the loop divides the gradients by the window's labelled tokens over all ranks
    width = 3

    def on_batch(self, model: Any, tensors: Any, ctx: Any = None) -> Tuple[torch.Tensor, torch.Tensor]:
        features, labels, _ = tensors
        raw = forward(model, features)
        logits = logits_of(raw) if not isinstance(raw, torch.Tensor) else raw
        if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
            raise ValueError(f"Fine-tuning a causal LM reads the logits of its forward (batch, tokens, vocabulary); "
                             f"it returned {type(raw).__name__}"
                             + (f" with logits of shape {tuple(logits.shape)}" if isinstance(logits, torch.Tensor)
                                else " without logits") + ". Use a model such as AutoModelForCausalLM.")
        loss, tokens = token_loss(logits, labels[0])
        sums = torch.zeros(self.width, dtype=torch.float64, device=logits.device)
        sums[0], sums[1], sums[2] = loss.detach(), tokens, labels[0].shape[0]
        return loss, sums

    def tokens(self, tensors: Any) -> torch.Tensor:
        """The labelled tokens of a batch (what its loss is summed over), known before its forward."""
        return (tensors[1][0][:, 1:] != IGNORE).sum()

    def summarize(self, sums: List[float], with_val: bool) -> Dict[str, float]:
        row = summarize_sums(sums, self.width, [], with_val)
        for prefix in ("", "val_") if with_val else ("",):
            loss = row[prefix + "loss"]
            row[prefix + "perplexity"] = math.exp(loss) if loss == loss and loss < 700 else float("inf")
        return row


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(the cross entropy summed over the labelled tokens, their count): position t's logits predict the label at
    t + 1, as the model's own loss computes it (in float32)."""
    target = labels[:, 1:]
    vocabulary = logits.shape[-1]
    loss = F.cross_entropy(logits[:, :-1, :].reshape(-1, vocabulary).float(), target.reshape(-1),
                           ignore_index=IGNORE, reduction="sum")
    return loss, (target != IGNORE).sum()
