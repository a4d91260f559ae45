"""Losses, loss weights and metrics for one or more outputs, with exact row-weighted sums.

Each batch contributes (loss * weight, weight, rows, metric * rows, ...) to a float64 vector; ranks
sum these vectors once per epoch, so reported numbers are exact means over rows (or over sample
weights), not means of batch means.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

# Losses whose target is a class index: a float label column (e.g. StringIndexer output) is cast.
CLASS_INDEX_LOSSES = (nn.CrossEntropyLoss, nn.NLLLoss, nn.MultiMarginLoss)


def accuracy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Share of rows whose argmax (or, for one column, output >= 0.5) equals the label."""
    if output.dim() > 1 and output.shape[-1] > 1:
        predicted = output.argmax(dim=-1)
    else:
        predicted = (output.reshape(-1) >= 0.5).long()
    return (predicted.reshape(-1) == target.reshape(-1).long()).double().mean()  # exact counts


BUILTIN_METRICS: Dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {"accuracy": accuracy}


def metric_name(metric: Any) -> str:
    if isinstance(metric, str):
        return metric
    return getattr(metric, "__name__", None) or type(metric).__name__


def adapt_target(loss_fn: Any, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Fit the label tensor to what the loss expects, for the two mismatches users hit most."""
    if isinstance(loss_fn, CLASS_INDEX_LOSSES) and target.is_floating_point() and target.dim() == 1:
        return target.long()
    if target.dim() == 1 and output.dim() == 2 and output.shape[1] == 1:
        return target.reshape(-1, 1).to(output.dtype)  # (B, 1) outputs against (B,) labels
    if target.is_floating_point() and output.is_floating_point() and target.dtype != output.dtype:
        return target.to(output.dtype)
    return target


class Objective:
    """The training loss and the per-batch sums for one set of losses and metrics."""

    def __init__(self, losses: Sequence[Any], loss_weights: Sequence[float], metrics: Sequence[Any],
                 label_cols: Sequence[str], weighted: bool):
        self.losses = list(losses)
        self.loss_weights = list(loss_weights)
        self.weighted = weighted
        if weighted:  # per-row losses, weighted by the sample weight column
            for fn in self.losses:
                fn.reduction = "none"
        self.metrics: List[Tuple[str, int, Callable]] = []
        for m in metrics:
            fn = BUILTIN_METRICS[m] if isinstance(m, str) else m
            for i, label in enumerate(label_cols):
                name = metric_name(m) if len(label_cols) == 1 else f"{label}_{metric_name(m)}"
                self.metrics.append((name, i, fn))
        self.width = 3 + len(self.metrics)

    def __call__(self, outputs: Sequence[torch.Tensor], labels: Sequence[torch.Tensor],
                 weights: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        if len(outputs) != len(labels):
            raise ValueError(f"The model returned {len(outputs)} outputs but there are {len(labels)} label "
                             "columns; return one output per label column (a tuple for several).")
        rows = labels[0].shape[0]
        targets = [adapt_target(fn, out, lab) for fn, out, lab in zip(self.losses, outputs, labels)]
        parts = [w * fn(out, tgt) for fn, w, out, tgt in zip(self.losses, self.loss_weights, outputs, targets)]
        sums = torch.zeros(self.width, dtype=torch.float64, device=labels[0].device)
        if self.weighted:
            per_row = sum(p.reshape(rows, -1).mean(dim=1) for p in parts)
            weighted_sum = (per_row * weights).sum()
            denominator = weights.sum()
            loss = weighted_sum / denominator.clamp_min(1e-12)
            sums[0], sums[1] = weighted_sum.detach(), denominator.detach()
        else:
            loss = sum(parts)
            sums[0], sums[1] = loss.detach() * rows, rows
        sums[2] = rows
        with torch.no_grad():
            for j, (_, i, fn) in enumerate(self.metrics):
                sums[3 + j] = torch.as_tensor(fn(outputs[i], targets[i])).double() * rows
        return loss, sums

    def summarize(self, sums: List[float], with_val: bool) -> Dict[str, float]:
        """Per-epoch numbers from the reduced sums: loss, metrics, and the val_ ones."""
        row = self._one(sums[: self.width], "")
        if with_val:
            row.update(self._one(sums[self.width:], "val_"))
        return row

    def _one(self, sums: List[float], prefix: str) -> Dict[str, float]:
        rows = sums[2]
        out = {prefix + "loss": sums[0] / sums[1] if sums[1] else float("nan")}
        for j, (name, _, _) in enumerate(self.metrics):
            out[prefix + name] = sums[3 + j] / rows if rows else float("nan")
        return out
