"""The driver's dry run: forward and loss on a few training rows before launching, so that a wrong signature,
shape, output type, loss or class count fails in a second with a clear message instead of on every rank (or,
worse, trains on numbers that broadcast). Returns the per-row shape of each output (the TorchModel's output
schema comes from it).
"""
from __future__ import annotations

import copy
import warnings
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import torch

from estimator.core import lightning_module
from estimator.train import lightning

from estimator.core.spec import DataSpec, UserObjects
from estimator.core.outputs import forward as call_forward, outputs_of
from estimator.data.arrays import Arrays, prepare_arrays, to_tensors
from estimator.data.frames import transform_batch
from estimator.data.lm import batch_tokenizer
from estimator.data.parquet import column_range, read_head
from estimator.train import steps
from estimator.train.losses import loss_kind, loss_name, negative_class, negative_weight
from estimator.train.objectives.classic import Objective

HEAD_ROWS = 16  # read from the first row group; the checks use at least 3 of them


def dry_run(objs: UserObjects, data: DataSpec, head: Optional[Arrays] = None) -> List[tuple]:
    """`head`: the first rows when the data is not in the store (the direct mode); else read from it. With a
    train_step or a train_fn, the forward pass only (what transform needs); a step is checked by `dry_step`."""
    arrays = head_arrays(objs, data, head)
    rows = len(next(iter(arrays.values())))
    model = copy.deepcopy(objs.model).eval()
    own = objs.objective.dry_run(model, data, arrays, rows) if objs.objective is not None else None
    if own is not None:  # the objective's own check (a causal LM's: its loss, or its tokens counted)
        return own
    if objs.lightning:
        try:
            model = lightning_module.for_inference(model)
        except ValueError:
            return []  # it trains; transform says what it needs
    outputs = forward(model, data, arrays, rows)
    if objs.train_step is not None or objs.train_fn is not None or objs.lightning:  # they compute their own loss
        return [tuple(o.shape[1:]) for o in outputs]
    checked = rows_unlike(outputs, rows)  # a row count no output dimension equals: shape mistakes cannot broadcast
    if checked != rows:
        arrays = {k: v[:checked] for k, v in arrays.items()}
        outputs = forward(model, data, arrays, checked)
    losses = copy.deepcopy(objs.build_losses())
    check_classes(losses, outputs, data)
    objective = Objective(losses, objs.loss_weights, objs.metrics, data.label_cols,
                          weighted=data.sample_weight_col is not None, weight_col=data.sample_weight_col)
    tensors = to_tensors(arrays, data)
    labels = tensors[1]
    check_binary_labels(losses, labels, data)
    check_weight_range(data)
    check = objective.host_check()  # what the ranks check of each batch, on the first rows
    if check is not None:
        check(tensors)
    try:
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            objective.on_batch(model, tensors)  # the step's forward again, with the labels for the model's own loss
        broadcast = [w for w in caught if "target size" in str(w.message)]
        if broadcast:  # MSELoss and friends warn, then broadcast (batch,) against (batch, n) into nonsense
            raise BroadcastWarning(str(broadcast[0].message))
    except Exception as exc:  # noqa: BLE001
        got = ", ".join(str(tuple(o.shape)) for o in outputs)
        want = ", ".join(f"{c}: {tuple(t.shape)} {t.dtype}" for c, t in zip(data.label_cols, labels))
        hint = ""
        if objective.own and labels[0].is_floating_point() and outputs[0].dim() == 2 and outputs[0].shape[1] > 1:
            hint = (f" The model computes its own loss from the labels, and a Hugging Face classifier reads float "
                    f"labels as several targets per row (multi-label): give the class index as an integer, "
                    f"F.col({data.label_cols[0]!r}).cast('int') (StringIndexer's index is a double).")
        raise ValueError(f"The loss or metrics failed on the model's outputs ({got}) and the labels ({want}): "
                         f"{exc if isinstance(exc, BroadcastWarning) else f'{type(exc).__name__}: {exc}'}. Check loss, "
                         "label_cols, label_shapes and the model's output shape." + hint) from None
    return [tuple(o.shape[1:]) for o in outputs]


def dry_step(objs: UserObjects, data: DataSpec, head: Optional[Arrays] = None) -> Tuple[str, ...]:
    """The train_step on a few training rows, in training and in validation: the names of the numbers it returns
    besides the loss (estimator.train.steps)."""
    return steps.dry_step(objs.train_step, objs.model, data, head_arrays(objs, data, head))


def dry_lightning(objs: UserObjects, data: DataSpec, head: Optional[Arrays], has_validation: bool,
                  epochs: int, stepping: Optional[int], built_in_schedule: bool = False
                  ) -> Tuple[Tuple[str, ...], Tuple[str, ...], Optional[str]]:
    """A LightningModule's configure_optimizers, training_step (and validation_step when there is validation
    data) on a few training rows: the keys training_step and validation_step log, and the scheduler's monitor."""
    arrays = head_arrays(objs, data, head)
    rows = len(next(iter(arrays.values())))
    module = copy.deepcopy(objs.model)
    trainer = lightning.attach(module, lightning.StandInTrainer(0, 1, 0, epochs, stepping))
    try:
        _, scheduler, monitor, _ = lightning.optimizers_of(module)
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's hook
        raise ValueError(f"{type(module).__name__}.configure_optimizers() failed on the driver: "
                         f"{type(exc).__name__}: {exc}") from None
    if scheduler is not None and (objs.lr_scheduler_fn is not None or built_in_schedule):
        other = "lr_scheduler_fn" if objs.lr_scheduler_fn is not None else "lr_schedule (or a warmup)"
        raise ValueError(f"{type(module).__name__}.configure_optimizers() returns a scheduler and {other} is "
                         "set too: keep one of them.")
    batch = lightning.lightning_batch(to_tensors(arrays, data))
    keys: List[Tuple[str, ...]] = []
    for training, hook in ((True, "training_step"), (False, "validation_step")):
        if not training and not (has_validation and lightning_module.overrides(module, hook)):
            keys.append(())
            continue
        module.train(training)
        trainer.update(steps.StepContext(0, 1, torch.device("cpu"), 1, training))
        try:
            with torch.set_grad_enabled(training), lightning.logging_into(module, hook) as logged:
                result = lightning_module.call_hook(module, hook, batch, 0)
            if training:
                lightning.step_loss(result)
        except Exception as exc:  # noqa: BLE001 - the user's hook, or what it returned or logged
            raise ValueError(f"{hook} of {type(module).__name__} failed on the driver's dry run ({rows} training "
                             f"rows, batch = the tensors of {list(data.columns)}): {type(exc).__name__}: {exc}") from None
        keys.append(tuple(k for k in logged.values if not (training and k == "loss")))
    train_keys, val_keys = keys
    skipped = lightning.hooks_not_called(module)
    if skipped:
        warnings.warn(f"TorchEstimator runs {type(module).__name__}'s configure_optimizers, training_step, "
                      f"validation_step and forward (in transform), not these hooks it overrides: {', '.join(skipped)}"
                      " (docs/training.md 'Train a LightningModule').", UserWarning, stacklevel=5)
    if has_validation and not lightning_module.overrides(module, "validation_step"):
        warnings.warn(f"{type(module).__name__} has no validation_step: the validation rows are held out but give "
                      "no val_ keys. Define validation_step (self.log('val_loss', ...)), or set validation=None.",
                      UserWarning, stacklevel=5)
    clash = sorted(set(train_keys) & set(val_keys)) + [k for k in val_keys if k == "loss"]
    reserved = [k for k in train_keys + val_keys if k in lightning.RESERVED]
    if clash or reserved:
        raise ValueError(f"{type(module).__name__} logs {clash or reserved}: the history's keys are training_step's "
                         "returned 'loss', what training_step logs and what validation_step logs, each once, besides "
                         f"{list(lightning.RESERVED)}. Name validation's keys apart, e.g. 'val_loss', 'val_acc'.")
    return train_keys, val_keys, monitor


def head_arrays(objs: UserObjects, data: DataSpec, head: Optional[Arrays] = None) -> Arrays:
    """The first training rows as the ranks' batches hold them (transformation_fn applied)."""
    head = read_head(data.source, data.train, HEAD_ROWS, data.columns) if head is None else head
    arrays = prepare_arrays(data, head)
    if objs.transformation_fn is not None:
        try:
            arrays = transform_batch(objs.transformation_fn, arrays)
        except Exception as exc:  # noqa: BLE001 - the user's function
            raise ValueError(f"transformation_fn failed on {len(head[data.columns[0]])} training rows (a pandas "
                             f"DataFrame with columns {list(arrays)}): {type(exc).__name__}: {exc}") from None
    tokenize = batch_tokenizer(objs.tokenizer, data)
    if tokenize is not None:
        try:
            arrays = tokenize(arrays)
        except Exception as exc:  # noqa: BLE001 - the user's tokenizer
            raise ValueError(f"The tokenizer failed on {len(head[data.columns[0]])} training texts of "
                             f"{list(data.text_cols) or [data.lm.column]}: {type(exc).__name__}: {exc}") from None
    return arrays


def feature_sizes(objs: UserObjects, data: DataSpec, head: Optional[Arrays] = None) -> Optional[List[int]]:
    """Values per row of each feature column as stored (what transform will be given); None with a
    transformation_fn (the model sees its output, which transform does not run)."""
    if objs.transformation_fn is not None:
        return None
    head = read_head(data.source, data.train, HEAD_ROWS, data.columns) if head is None else head
    return [int(np.prod(head[c].shape[1:])) if head[c].ndim > 1 else 1 for c in data.feature_cols]


class BroadcastWarning(ValueError):
    """A loss warned that it broadcasts the output against the label (torch trains on, with wrong numbers)."""

    def __str__(self) -> str:
        return f"UserWarning: {self.args[0]}"


def forward(model: torch.nn.Module, data: DataSpec, arrays: Any, rows: int) -> Tuple[torch.Tensor, ...]:
    features, _, _ = to_tensors(arrays, data)
    shown = ", ".join(f"{c}: {shape_of(t)}" for c, t in zip(data.feature_cols, features))
    try:
        with torch.no_grad():
            raw = call_forward(model, features)
    except Exception as exc:  # noqa: BLE001 - any failure here is the user's forward
        raise ValueError(f"The model's forward() failed on {rows} training rows, called with the feature_cols "
                         f"in order ({shown}): {type(exc).__name__}: {exc}. Check feature_cols, input_shapes and "
                         "forward()'s arguments.") from None
    return check_outputs(raw, data.label_cols)


def shape_of(feature: Any) -> str:
    if isinstance(feature, dict):  # a tokenized text column
        return "{" + ", ".join(f"{k}: {tuple(v.shape)}" for k, v in feature.items()) + "}"
    return str(tuple(feature.shape))


def check_outputs(raw: Any, label_cols: Sequence[str]) -> Tuple[torch.Tensor, ...]:
    """One tensor, or a tuple/list of tensors in label_cols order, or what has `logits` (a Hugging Face
    ModelOutput, a dict, a dataclass); anything else is refused by name."""
    outputs = outputs_of(raw)
    if len(outputs) == 1 and isinstance(outputs[0], dict):
        raise ValueError(f"The model's forward() returned a dict (keys {list(raw)}) without 'logits'; outputs must "
                         "be a tensor, a tuple of tensors in the order of label_cols "
                         f"{list(label_cols)}, or a dict or ModelOutput with 'logits': return "
                         f"({', '.join(f'out[{k!r}]' for k in raw)}) instead.")
    for i, out in enumerate(outputs):
        if not isinstance(out, torch.Tensor):
            raise ValueError(f"The model's forward() returned a {type(out).__name__} as output {i}; outputs must be "
                             f"tensors (one per label column of {list(label_cols)}).")
    if label_cols and len(outputs) != len(label_cols):  # without labels: the outputs are transform's columns
        raise ValueError(f"The model returned {len(outputs)} outputs but there are {len(label_cols)} label "
                         f"columns {list(label_cols)}; return one output per label column (a tuple for several).")
    return outputs


def rows_unlike(outputs: Sequence[torch.Tensor], rows: int) -> int:
    """The largest row count <= rows (at least 3 when there are 3) that equals no per-row output dimension."""
    dims = {d for o in outputs for d in o.shape[1:]}
    for n in range(rows, 2, -1):
        if n not in dims:
            return n
    return rows


def check_binary_labels(losses: Sequence[Any], head: Sequence[torch.Tensor], data: DataSpec) -> None:
    """BCEWithLogitsLoss and BCELoss read a label as the probability of class 1: -1/+1 labels train without an error
    to a meaningless model (loss below 0). The range of the whole data from the Parquet footers (no pass over the
    rows); in the direct mode, of the first rows (`head`)."""
    for fn, label, column in zip(losses, head, data.label_cols):
        if loss_kind(fn) not in ("logits", "probabilities"):
            continue
        found = [column_range(data.source, pieces, column) for pieces in (data.train, data.val) if pieces]
        ranges = [r for r in found if r is not None] or [(float(label.min()), float(label.max()))]
        low, high = min(r[0] for r in ranges), max(r[1] for r in ranges)
        if low < 0 or high > 1:
            raise ValueError(f"Label column {column!r} holds {low if low < 0 else high:g} (values from {low:g} to "
                             f"{high:g}), but {loss_name(fn)} needs labels in [0, 1]: 0 or 1 for two classes, or a "
                             "probability. Map them first (for -1/+1 labels: (label + 1) / 2), or use a loss of your "
                             "own.")


def check_weight_range(data: DataSpec) -> None:
    """Sample weights scale their rows' losses: a negative one makes training raise its row's loss, and weights
    all 0 train nothing (the loss of every step is 0 over 0). From the Parquet footers of the whole data (no
    pass over the rows); the first rows, and each batch a rank reads, are checked for negative weights by
    Objective.host_check (the direct mode has no footers)."""
    column = data.sample_weight_col
    if column is None:
        return
    found = [column_range(data.source, pieces, column) for pieces in (data.train, data.val) if pieces]
    ranges = [r for r in found if r is not None]
    if not ranges:
        return
    low, high = min(r[0] for r in ranges), max(r[1] for r in ranges)
    if low < 0:
        raise ValueError(negative_weight(column, low, f" (weights from {low:g} to {high:g})"))
    train = found[0] if data.train else None  # the whole training data's
    if train is not None and train[1] == 0:
        raise ValueError(f"Column {column!r} (sample_weight_col) holds only 0: every row's loss is weighted 0, so "
                         "nothing would train (each step's loss is 0 over a weight of 0). Give the rows to train "
                         "on weights above 0.")


def check_classes(losses: Sequence[Any], outputs: Sequence[torch.Tensor], data: DataSpec) -> None:
    """A class-index loss needs an output per class: at least one more than the largest label (from the
    Parquet footers' statistics of the whole training and validation data, no pass over the rows)."""
    for fn, out, label in zip(losses, outputs, data.label_cols):
        if loss_kind(fn) != "class_index":
            continue
        classes = out.shape[1] if out.dim() > 1 else 1
        if classes < 2:
            raise ValueError(f"{loss_name(fn)} needs one output per class, but the model's output for label "
                             f"{label!r} has {classes} unit (shape {tuple(out.shape)}); plain PyTorch would refuse "
                             "it too. Return (batch, classes) scores, or use BCEWithLogitsLoss with one output for "
                             "two classes.")
        ranges = [column_range(data.source, pieces, label) for pieces in (data.train, data.val) if pieces]
        ranges = [r for r in ranges if r is not None]
        if not ranges:
            continue
        low, high = min(r[0] for r in ranges), max(r[1] for r in ranges)
        if high >= classes:
            raise ValueError(f"Label column {label!r} holds class {high:g}, but the model's output has "
                             f"{classes} classes (0-{classes - 1}) for {loss_name(fn)}: give the last layer at "
                             f"least {int(high) + 1} outputs, or re-index the labels (StringIndexer).")
        if low < 0 and low != getattr(fn, "ignore_index", None):
            raise ValueError(negative_class(fn, label, low))
