"""Your own training step: `train_step=fn`, called as `fn(model, batch, ctx)` for every batch, returning the loss
(a scalar tensor) or a dict with "loss" and other numbers. Everything around it stays the estimator's: backward
(with gradient accumulation and the GradScaler), autocast, clipping, the optimizer step, NaN checks, exact
validation (the same function, under torch.no_grad with ctx.training False, on the plain module), checkpoints,
early stopping and the history. The dict's other numbers become history keys (and "val_" ones): each is a
batch's mean, averaged over rows exactly as the loss is, over all ranks.

`batch`: the rank's tensors on its device: `batch.features` and `batch.labels` in the order of feature_cols and
label_cols, `batch.weights` (sample_weight_col, or None), and `batch["column"]` by name. `ctx`: rank, world_size,
device, epoch (1-based, as in the history), training, batch_idx (in the epoch) and global_step (optimizer steps so
far). `model` is the DistributedDataParallel-wrapped module in training (one rank: a stand-in with nothing to
average; call it, do not reach into it), the
plain module in validation. torch only, no pyspark."""
from __future__ import annotations

import copy
import difflib
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from estimator.core.spec import DataSpec
from estimator.data.arrays import Arrays, Tensors, to_tensors


class Named:
    """A misspelt attribute is an AttributeError that lists the names there are (and the closest one)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        known = sorted(n for n in set(dir(type(self))) | set(getattr(self, "__dict__", {}))
                       | set(getattr(self, "__dataclass_fields__", {})) if not n.startswith("_"))
        close = difflib.get_close_matches(name, known, n=1)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}."
                             + (f" Did you mean {close[0]!r}?" if close else "") + f" It has: {', '.join(known)}.")


@dataclass(frozen=True)
class Batch(Named):
    """One batch of this rank's rows, on its device, as train_step and train_fn's loops receive it.
    `batch["column"]` gives any of its tensors by column name.

    Attributes:
        features: The tensors of `feature_cols`, in their order.
        labels: The tensors of `label_cols`, in their order (empty without `label_cols`).
        weights: The tensor of `sample_weight_col`, or None without it.
        columns: Every tensor of the batch by its column's name.
        rows: The batch's row count.
    """

    features: List[torch.Tensor]
    labels: List[torch.Tensor]
    weights: Optional[torch.Tensor]
    columns: Dict[str, torch.Tensor]

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.columns:
            raise KeyError(f"The batch has no column {name!r}; it has {', '.join(self.columns)}.")
        return self.columns[name]

    @property
    def rows(self) -> int:
        first = (self.labels or self.features)[0]
        return int((next(iter(first.values())) if isinstance(first, dict) else first).shape[0])


@dataclass(frozen=True)
class StepContext(Named):
    """What `train_step(model, batch, ctx)` is told about the step.

    Attributes:
        rank: This rank's number, 0 to world_size - 1.
        world_size: How many ranks train.
        device: This rank's device.
        epoch: The epoch, 1-based as the history's rows.
        training: False in validation.
        batch_idx: The batch's index in this epoch on this rank.
        global_step: Optimizer steps taken so far in the run.
    """

    rank: int
    world_size: int
    device: torch.device
    epoch: int  # 1-based, as the history's rows
    training: bool
    batch_idx: int = 0  # the batch's index in this epoch (of this rank)
    global_step: int = 0  # optimizer steps taken so far in the run


def as_batch(tensors: Tensors, data: DataSpec) -> Batch:
    features, labels, weights = tensors
    columns = dict(zip(data.feature_cols, features))
    for encoded in (f for f in features if isinstance(f, dict)):  # a text column's input_ids, attention_mask...
        columns.update(encoded)
    columns.update(zip(data.label_cols, labels))
    if data.sample_weight_col and weights is not None:
        columns[data.sample_weight_col] = weights
    return Batch(list(features), list(labels), weights, columns)


def step_result(result: Any) -> Tuple[torch.Tensor, Dict[str, Any]]:
    """(the loss, the other numbers) from what train_step returned; anything else is refused by name."""
    metrics: Dict[str, Any] = {}
    if isinstance(result, dict):
        if "loss" not in result:
            raise ValueError(f"train_step returned a dict without 'loss' (keys {list(result)}): put the loss to "
                             "minimize under 'loss'; the other entries are reported as metrics.")
        metrics = {k: v for k, v in result.items() if k != "loss"}
        result = result["loss"]
    if not isinstance(result, torch.Tensor) or result.numel() != 1:
        got = f"a tensor of shape {tuple(result.shape)}" if isinstance(result, torch.Tensor) else type(result).__name__
        raise ValueError(f"train_step must return the loss as a scalar tensor (or a dict with 'loss' and other "
                         f"numbers); it returned {got} as the loss. Reduce it, e.g. with .mean().")
    for key, value in metrics.items():
        if not isinstance(key, str) or key.startswith("val_") or key in ("epoch", "data_wait"):
            raise ValueError(f"train_step returned a metric named {key!r}: name metrics with strings other than "
                             "'epoch' and 'data_wait', without the 'val_' prefix (validation adds it).")
        if isinstance(value, torch.Tensor) and value.numel() != 1 or not isinstance(value, (torch.Tensor, int, float)):
            raise ValueError(f"train_step returned {key!r} as {type(value).__name__}"
                             + (f" of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else "")
                             + ": metrics must be numbers or one-element tensors (a batch's mean).")
    return result.reshape(()), metrics


def dry_step(fn: Callable[..., Any], model: torch.nn.Module, data: DataSpec, arrays: Arrays) -> Tuple[str, ...]:
    """The step on the driver, on a few training rows, in training and in validation: the names of the numbers it
    returns (the same both times), or a clear error before any job."""
    model = copy.deepcopy(model)
    keys = []
    for training in (True, False):
        model.train(training)
        ctx = StepContext(0, 1, torch.device("cpu"), 1, training)
        try:
            with torch.set_grad_enabled(training):
                _, metrics = step_result(fn(model, as_batch(to_tensors(arrays, data), data), ctx))
        except Exception as exc:  # noqa: BLE001 - the user's function, or what it returned
            raise ValueError(f"train_step failed on the driver's dry run ({len(next(iter(arrays.values())))} training "
                             f"rows, training={training}): {type(exc).__name__}: {exc}") from None
        keys.append(tuple(metrics))
    if keys[0] != keys[1]:
        raise ValueError(f"train_step returned {list(keys[0])} in training but {list(keys[1])} in validation "
                         "(ctx.training False): return the same numbers in both.")
    return keys[0]
