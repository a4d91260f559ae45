"""Losses, loss weights and metrics for one or more outputs, with exact row-weighted sums: the built-in loop's
objective when a `loss` is given (or the model computes its own from `labels=`).

Each batch contributes its sums (estimator.train.sums: the loss times its weight, the weight, the rows, each
metric times the rows) to a float64 vector; ranks sum these vectors once per epoch, so reported numbers are exact
means over rows (or over sample weights), not means of batch means.
"""
from __future__ import annotations

import functools
import inspect
import operator
from collections.abc import Mapping
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from estimator.core.outputs import forward, outputs_of
from estimator.train.objectives.base import BuiltIn
from estimator.train.sums import Sums, metric_slot

# What a loss says about its outputs and labels. Class-index losses take (batch, classes) scores and integer
# targets of shape (batch,); a float label column (e.g. StringIndexer output) is cast.
CLASS_INDEX = (nn.CrossEntropyLoss, nn.NLLLoss, nn.MultiMarginLoss, F.cross_entropy, F.nll_loss, F.multi_margin_loss)
LOGITS = (nn.BCEWithLogitsLoss, F.binary_cross_entropy_with_logits)
PROBABILITIES = (nn.BCELoss, F.binary_cross_entropy)
REGRESSION = (nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss, nn.HuberLoss, nn.PoissonNLLLoss, nn.GaussianNLLLoss,
              nn.KLDivLoss, F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss)


class ModelsOwnLoss:
    """loss=None with a model whose forward takes `labels` (Hugging Face's convention): the built-in loop calls
    forward(*features, labels=<the label column>) and trains on the output's `loss`; the metrics and transform
    read its logits as a loss of the user's own (class scores by argmax)."""

    __name__ = "the model's own loss"

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("The model's own loss comes from its forward(..., labels=...), not from outputs.")


def takes_labels(model: Any) -> bool:
    """Whether the model's forward names a `labels` parameter (Hugging Face models that compute their loss)."""
    try:
        return "labels" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError, AttributeError):
        return False


def own_loss_of(raw: Any) -> torch.Tensor:
    """The loss a model returned with its outputs (a ModelOutput, a dict or a dataclass with `loss`)."""
    loss = raw.get("loss") if isinstance(raw, Mapping) else getattr(raw, "loss", None)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(f"loss=None trains on the loss the model computes when forward() is given labels=; its "
                         f"forward returned {type(raw).__name__} with loss {type(loss).__name__}, not a scalar "
                         "tensor. Pass loss=... (e.g. nn.CrossEntropyLoss()), or return the loss as .loss.")
    return loss.reshape(())


def loss_kind(loss_fn: Any) -> str:
    """'class_index', 'logits', 'probabilities', 'regression' or 'unknown' (a user function)."""
    for kind, known in (("class_index", CLASS_INDEX), ("logits", LOGITS), ("probabilities", PROBABILITIES),
                        ("regression", REGRESSION)):
        if any(loss_fn is k or (isinstance(k, type) and isinstance(loss_fn, k)) for k in known):
            return kind
    return "unknown"


def loss_name(loss_fn: Any) -> str:
    return getattr(loss_fn, "__name__", None) or type(loss_fn).__name__


class Accuracy:
    """The share of rows predicted right, read the way the label's loss reads the output: class scores
    (CrossEntropyLoss, NLLLoss) by argmax, logits (BCEWithLogitsLoss) by >= 0, probabilities (BCELoss) by >= 0.5
    (every element for several binary labels per row). With a loss of the user's own, one score per class
    (an output wider than the label) is read by argmax; a single column is refused (logit or probability?)."""

    __name__ = "accuracy"

    def __init__(self, loss_fn: Any):
        self.kind, self.loss = loss_kind(loss_fn), loss_name(loss_fn)

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        rows = output.shape[0]
        if self.kind in ("logits", "probabilities"):
            predicted = output >= (0.0 if self.kind == "logits" else 0.5)
            return (predicted.reshape(rows, -1) == target.reshape(rows, -1).bool()).double().mean()
        one_column = output.dim() < 2 or output.shape[-1] < 2
        if self.kind == "unknown" and (one_column or target.reshape(rows, -1).shape[1] > 1):
            raise ValueError(f"metrics=['accuracy'] cannot tell how to read the output of the loss {self.loss} "
                             f"(output {tuple(output.shape)}, label {tuple(target.shape)}): use a torch loss that says "
                             "it (CrossEntropyLoss / NLLLoss: class scores; BCEWithLogitsLoss: logits; BCELoss: "
                             "probabilities), or pass your own metric function instead of 'accuracy'.")
        return (output.argmax(dim=-1).reshape(-1) == target.reshape(-1).long()).double().mean()  # exact counts


def accuracy_applies(loss_fn: Any) -> bool:
    """Accuracy means nothing for a regression loss's label."""
    return loss_kind(loss_fn) != "regression"


def check_metrics(metrics: Sequence[Any], losses: Sequence[Any], label_cols: Sequence[str]) -> None:
    """'accuracy' must mean something for at least one label (it is reported for the classification ones)."""
    if "accuracy" in metrics and not any(accuracy_applies(fn) for fn in losses):
        raise ValueError(f"metrics=['accuracy'] means nothing for {', '.join(label_cols)} with the regression loss "
                         f"{', '.join(sorted({loss_name(fn) for fn in losses}))}: remove it, or pass a metric function "
                         "(output, label) -> number such as mean absolute error.")


def metric_name(metric: Any) -> str:
    if isinstance(metric, str):
        return metric
    return getattr(metric, "__name__", None) or type(metric).__name__


def adapt_target(loss_fn: Any, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Fit the label tensor to what the loss expects, as plain PyTorch would be given it."""
    if loss_kind(loss_fn) == "class_index":
        if output.dim() < 2 or output.shape[1] < 2:
            raise ValueError(f"{loss_name(loss_fn)} needs one output per class, but the model's output has shape "
                             f"{tuple(output.shape)}: return (batch, classes) scores, or use BCEWithLogitsLoss "
                             "with one output for two classes.")
        if target.dim() == 2 and target.shape[1] == 1:
            target = target.reshape(-1)  # (B, 1) class indices
        return target.long() if target.dim() == 1 else target
    if target.dim() == 1 and output.dim() == 2 and output.shape[1] == 1:
        return target.reshape(-1, 1).to(output.dtype)  # (B, 1) outputs against (B,) labels
    if target.is_floating_point() and output.is_floating_point() and target.dtype != output.dtype:
        return target.to(output.dtype)
    if not target.is_floating_point() and output.is_floating_point() and target.shape == output.shape:
        return target.to(output.dtype)  # 0/1 integer labels for BCE-style losses
    return target


def per_row_loss(loss_fn: Any, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The loss of each row (sample weights): torch loss modules with reduction='none', functions called
    with reduction='none' (as Horovod calls them)."""
    if isinstance(loss_fn, nn.Module) and hasattr(loss_fn, "reduction"):
        return loss_fn(output, target)  # its reduction was set to 'none'
    try:
        return loss_fn(output, target, reduction="none")
    except TypeError as exc:
        raise TypeError(f"sample_weight_col needs per-row losses: the loss {loss_name(loss_fn)} was called with "
                        f"reduction='none' and failed ({exc}); use a torch.nn loss or a function that accepts "
                        "reduction='none'.") from None


class Objective(BuiltIn):
    """The training loss and the per-batch sums for one set of losses and metrics (the sums' layout: `layout`)."""

    @classmethod
    def applies(cls, p: Mapping[str, Any]) -> bool:
        return True  # the registry's last: a loss, or the model's own (estimator.train.objectives)

    @classmethod
    def for_rank(cls, spec: Any, objs: Any, model: Any, trainer: Any) -> "Objective":
        return cls(objs.build_losses(), objs.loss_weights, objs.metrics, spec.data.label_cols,
                   weighted=spec.data.sample_weight_col is not None)

    def __init__(self, losses: Sequence[Any], loss_weights: Sequence[float], metrics: Sequence[Any],
                 label_cols: Sequence[str], weighted: bool):
        self.losses = list(losses)
        self.loss_weights = list(loss_weights)
        self.weighted = weighted
        if weighted:  # per-row losses, weighted by the sample weight column
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
            loss = weighted_sum / denominator.clamp_min(1e-12)
            sums = self.layout.zeros(labels[0].device)
            sums[0], sums[1], sums[2] = weighted_sum.detach(), denominator.detach(), rows
        else:
            loss = functools.reduce(operator.add, parts)
            sums = self.batch_sums(loss, rows)
        return loss, self.metric_sums(sums, outputs, targets)

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
