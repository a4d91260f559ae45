"""The objective of a classic fit: the `loss` param's losses (one per label column, weighted by loss_weights) and
its metrics, or the model's own loss (a forward that takes `labels=`), with exact row-weighted sums
(estimator.train.losses: what a loss says about its outputs and labels, accuracy, per-row losses). The registry's
last: it applies to every fit the others do not take. torch only, no pyspark."""
from __future__ import annotations

import functools
import operator
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from estimator.core.outputs import forward, outputs_of
from estimator.train.losses import (Accuracy, ModelsOwnLoss, accuracy_applies, adapt_target, check_class_indices,
                                    check_metrics, check_sample_weights, loss_kind, metric_name, own_loss_of,
                                    per_row_loss)
from estimator.train.objectives.base import BuiltIn
from estimator.train.sums import Sums, metric_slot
from estimator.train.weighting import PerWeight


class Objective(BuiltIn):
    """The training loss and the per-batch sums for one set of losses and metrics (the sums' layout: `layout`)."""

    @classmethod
    def applies(cls, p: Mapping[str, Any]) -> bool:
        return True  # the registry's last: a loss, or the model's own (estimator.train.objectives)

    @classmethod
    def for_rank(cls, spec: Any, objs: Any, model: Any, trainer: Any) -> "Objective":
        return cls(objs.build_losses(), objs.loss_weights, objs.metrics, spec.data.label_cols,
                   weighted=spec.data.sample_weight_col is not None, weight_col=spec.data.sample_weight_col)

    def __init__(self, losses: Sequence[Any], loss_weights: Sequence[float], metrics: Sequence[Any],
                 label_cols: Sequence[str], weighted: bool, weight_col: Optional[str] = None):
        self.losses = list(losses)
        self.weight_col = weight_col if weighted else None  # its batches' weights are checked (host_check)
        self.loss_weights = list(loss_weights)
        self.label_cols = tuple(label_cols)
        self.weighted = weighted
        if weighted:  # per-row losses, weighted by the sample weight column
            # the loss a sum over the batch's weight, divided by the weight of the window's batches on all ranks:
            # one process's weighted mean over them (a mean of the ranks' weighted means weighs a light batch as
            # much as a heavy one)
            self.weighting = PerWeight
            for fn in self.losses:
                if isinstance(fn, nn.Module) and hasattr(fn, "reduction"):
                    fn.reduction = "none"
        check_metrics(metrics, self.losses, label_cols)
        self.metrics: List[Tuple[str, int, Callable]] = []
        for m in metrics:
            for i, label in enumerate(label_cols):
                if m == "accuracy" and not accuracy_applies(self.losses[i]):
                    continue  # a regression label of a multi-output model
                name = metric_name(m) if len(label_cols) == 1 else f"{label}_{metric_name(m)}"
                self.metrics.append((name, i, Accuracy(self.losses[i]) if m == "accuracy" else m))
        self.layout = Sums.of_loss([name for name, _, _ in self.metrics])
        self.metric_slots = [self.layout.index(metric_slot(name)) for name, _, _ in self.metrics]
        self.own = any(isinstance(fn, ModelsOwnLoss) for fn in self.losses)
        self._counts: Dict[int, torch.Tensor] = {}  # batch_sums' (rows, rows, 0...) by batch size

    def host_check(self) -> Optional[Callable[[Any], None]]:
        """Class labels (a class-index loss's) that are whole numbers, and sample weights of 0 or more, in every
        batch as read."""
        classes = any(loss_kind(fn) == "class_index" for fn in self.losses)
        if not classes and self.weight_col is None:
            return None

        def check(batch: Any) -> None:
            for fn, label, column in zip(self.losses, batch.labels, self.label_cols):
                check_class_indices(fn, label, column)
            if self.weight_col is not None and batch.weights is not None:
                check_sample_weights(batch.weights, self.weight_col)

        return check

    def __call__(self, outputs: Sequence[torch.Tensor], labels: Sequence[torch.Tensor],
                 weights: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        if len(outputs) != len(labels):
            raise ValueError(f"The model returned {len(outputs)} outputs but there are {len(labels)} label "
                             "columns; return one output per label column (a tuple for several).")
        rows = labels[0].shape[0]
        targets = [adapt_target(fn, out, lab) for fn, out, lab in zip(self.losses, outputs, labels)]
        loss_of = per_row_loss if self.weighted else (lambda fn, out, tgt: fn(out, tgt))
        # a weight of 1 multiplies nothing, and one loss is not added to 0: each op is a kernel launch per step
        parts = [loss_of(fn, out, tgt) if isinstance(w, (int, float)) and w == 1 else w * loss_of(fn, out, tgt)
                 for fn, w, out, tgt in zip(self.losses, self.loss_weights, outputs, targets)]
        if self.weighted:
            per_row = functools.reduce(operator.add, (p.reshape(rows, -1).mean(dim=1) for p in parts))
            weighted_sum = (per_row * weights).sum()
            denominator = weights.sum()
            loss = weighted_sum  # over the window's weight on all ranks (PerWeight, from weight_of)
            sums = self.layout.zeros(labels[0].device)
            sums[0], sums[1], sums[2] = weighted_sum.detach(), denominator.detach(), rows
        else:
            loss = functools.reduce(operator.add, parts)
            sums = self.batch_sums(loss, rows)
        return loss, self.metric_sums(sums, outputs, targets)

    def weight_of(self, tensors: Any) -> torch.Tensor:
        """A weighted fit's batch weight (PerWeight): its sample weights summed."""
        return tensors[2].sum()

    def batch_sums(self, loss: torch.Tensor, rows: int) -> torch.Tensor:
        """(loss x rows, rows, rows, a 0 for each metric) in float64 on the loss's device: the loss's product and
        one concatenation per step, the counts kept per batch size (a vector filled element by element cost
        six kernel launches a step, a host's time a small model's GPU step waits on)."""
        counts = self._counts.get(rows)
        if counts is None or counts.device != loss.device:
            if len(self._counts) > 8:  # batch sizes vary (a last partial batch): keep a few
                self._counts.clear()
            counts = torch.zeros(self.layout.width - 1, dtype=torch.float64, device=loss.device)
            counts[:2] = rows
            self._counts[rows] = counts
        return torch.cat([(loss.detach() * rows).double().reshape(1), counts])

    def metric_sums(self, sums: torch.Tensor, outputs: Sequence[torch.Tensor],
                    targets: Sequence[torch.Tensor]) -> torch.Tensor:
        rows = targets[0].shape[0]
        with torch.no_grad():
            for slot, (_, i, fn) in zip(self.metric_slots, self.metrics):
                sums[slot] = torch.as_tensor(fn(outputs[i], targets[i])).double() * rows
        return sums

    def on_batch(self, model: Any, tensors: Any, ctx: Any = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """The built-in step: forward on the features, then the losses and metrics (`ctx` is the user step's);
        with the model's own loss, forward also gets the labels and returns the loss."""
        features, labels, weights = tensors
        if not self.own:
            return self(outputs_of(forward(model, features)), labels, weights)
        raw = forward(model, features, labels=labels[0])
        loss, outputs, rows = own_loss_of(raw), outputs_of(raw), labels[0].shape[0]
        return loss, self.metric_sums(self.batch_sums(loss, rows), outputs, labels)
