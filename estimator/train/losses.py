"""Losses, loss weights and metrics for one or more outputs, with exact row-weighted sums: the built-in loop's
objective when a `loss` is given (or the model computes its own from `labels=`).

Each batch contributes its sums (estimator.train.sums: the loss times its weight, the weight, the rows, each
metric times the rows) to a float64 vector; ranks sum these vectors once per epoch, so reported numbers are exact
means over rows (or over sample weights), not means of batch means.
"""
from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from estimator.data.row_checks import BadRows


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
    """Fit the label tensor to what the loss expects, as plain PyTorch would be given it. Class labels stored as
    doubles (StringIndexer's) become class indices (whole numbers: `check_class_indices`, on the host)."""
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


def negative_class(loss_fn: Any, column: str, value: float) -> str:
    """The refusal of a negative class index (the loss's ignore_index, CrossEntropyLoss's -100, is not one)."""
    ignored = getattr(loss_fn, "ignore_index", None)
    return (f"Label column {column or '(the label)'!r} holds {value:g}, which is not a class index: {loss_name(loss_fn)} "
            "reads each label as the index of a class, from 0" + (f" (only its ignore_index, {ignored}, marks a "
            "row to leave out)" if ignored is not None else "") + ". Re-index the labels from 0 (StringIndexer), "
            "or drop the rows without a class.")


def negative_weight(column: str, value: float, where: str = "") -> str:
    """The refusal of a negative sample weight."""
    return (f"Column {column!r} (sample_weight_col) holds the weight {value:g}{where}: a weight scales its row's "
            "loss, and a negative one would make training raise that row's loss instead of lowering it. Give "
            "weights of 0 or more (0 leaves a row out of training).")


def check_sample_weights(weights: torch.Tensor, column: str) -> None:
    """A batch's sample weights (a host tensor's), as the driver checks the whole data's: none negative."""
    negative = weights < 0
    if bool(negative.any()):
        raise BadRows(negative_weight(column, float(weights[negative].reshape(-1)[0]),
                                      f" ({int(negative.sum())} of this batch's {weights.shape[0]} rows are negative)"))


def check_class_indices(loss_fn: Any, target: torch.Tensor, column: str) -> None:
    """Labels of a class-index loss (one a row) are class indices: whole numbers (.long() would make 0.5 class 0
    and 2.7 class 2, and train on, silently; plain PyTorch refuses float targets of one dimension), from 0 (a -1
    failed on the rank as an IndexError of the loss, after the fit's data job), the loss's ignore_index aside.
    A host tensor's."""
    if loss_kind(loss_fn) != "class_index" or target.is_complex() or target.dim() == 0 or target[0].numel() != 1:
        return
    ignored = getattr(loss_fn, "ignore_index", None)
    negative = (target < 0) & (target != ignored) if ignored is not None else target < 0
    if bool(negative.any()):
        raise BadRows(negative_class(loss_fn, column, float(target[negative].reshape(-1)[0])))
    if not target.is_floating_point():
        return  # integer classes (class probabilities, 2-D floats, returned above: CrossEntropyLoss takes them)
    target = target.reshape(-1)
    fractional = target != target.trunc()
    if bool(fractional.any()):
        value = float(target[fractional][0])
        raise BadRows(f"Label column {column or '(the label)'!r} holds {value:g}, which is not a class index: "
                      f"{loss_name(loss_fn)} reads each label as the index of a class (0, 1, 2, ...), and "
                      f"{int(fractional.sum())} of this batch's {target.shape[0]} labels are not whole numbers. "
                      "For a regression target use MSELoss (or L1Loss) with one output; for classes, index them "
                      "first (StringIndexer, or a cast to int of labels that are whole numbers).")


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


