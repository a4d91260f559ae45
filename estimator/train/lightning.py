"""A LightningModule trained by the estimator's own loop: `model=` a `lightning.LightningModule` (Lightning 2.x),
with no optimizer and no loss.

Its hooks run in the built-in loop, not in a Lightning Trainer: `configure_optimizers` on every rank (after the
module is on its device), `training_step(batch, batch_idx)` through DistributedDataParallel (so gradients are
averaged over the ranks), `validation_step` on the plain module, and `forward` in transform. Why not a Trainer:
the Trainer brings its own loop, checkpoints, logging and precision, and resumes at epoch boundaries; here one
loop gives every level (loss, train_step, train_fn, LightningModule) the same mid-epoch resume, exact metrics over
rows, retries, early stopping, best checkpoints, TensorBoard and MLflow.

What the module sees: `batch` is the tuple of the rank's tensors in the order feature_cols, label_cols (then the
sample_weight_col), on the device, so `x, y = batch` works (one column alone, with no label_cols, is that tensor); `self.log(name, value)` and `self.log_dict` record a
batch's number, and each becomes a history key: its mean over the rows of the batches that logged it, over all
ranks (reduce_fx 'mean'; on_step, on_epoch, prog_bar, sync_dist and batch_size are not needed for that and are
ignored). `self.trainer` is a stand-in with the epoch, step and rank attributes (StandInTrainer); other
Trainer-only features (manual optimization, several optimizers, per-step schedulers, callbacks, other hooks) are
refused or named in a warning. torch only: Lightning itself is not imported here."""
from __future__ import annotations

import contextlib
import numbers
from types import SimpleNamespace
from typing import Any, Iterator, List, Optional, Tuple

import torch
from torch import nn

from estimator.core.lightning_module import call_hook, lightning_base, overrides
from estimator.data.arrays import Tensors
from estimator.train.steps import StepContext

RESERVED = ("epoch", "data_wait")  # history keys the estimator writes itself
CALLED = ("configure_optimizers", "training_step", "validation_step", "forward")
OTHER_HOOKS = ("setup", "teardown", "configure_model", "configure_callbacks", "configure_gradient_clipping",
               "optimizer_step", "optimizer_zero_grad", "backward", "lr_scheduler_step", "test_step", "predict_step",
               "train_dataloader", "val_dataloader", "prepare_data", "transfer_batch_to_device")


def hooks_not_called(model: Any) -> List[str]:
    """The hooks `model` overrides that this loop does not call (a warning names them on the driver)."""
    base = lightning_base(model)
    names = [n for n in dir(base) if n.startswith("on_") or n in OTHER_HOOKS]
    used = {"predict_step"} if not overrides(model, "forward") else set()  # transform's, without forward()
    return sorted(n for n in names if callable(getattr(base, n, None)) and getattr(type(model), n) is not getattr(base, n)
                  and n not in used)


class StandInTrainer:
    """`self.trainer` for a module trained here: the epoch (0-based, as Lightning counts), the optimizer steps so
    far, the ranks and the run's epochs. Anything else a Trainer has is refused by name."""

    def __init__(self, rank: int, world_size: int, local_rank: int, max_epochs: int,
                 estimated_stepping_batches: Optional[int] = None):
        self.global_rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.is_global_zero, self.max_epochs = rank == 0, max_epochs
        self.current_epoch = self.global_step = 0
        self.training, self.validating, self.sanity_checking = True, False, False
        self.testing = self.predicting = False
        self.logger, self.loggers, self.progress_bar_callback = None, [], None
        if estimated_stepping_batches is not None:  # the run's optimizer steps (OneCycleLR's total_steps)
            self.estimated_stepping_batches = estimated_stepping_batches
        # what self.optimizers() and self.lr_schedulers() read, once configure_optimizers() has run (`optimized`)
        self.optimizers: List[torch.optim.Optimizer] = []
        self.strategy = SimpleNamespace(_lightning_optimizers=self.optimizers)
        self.lr_scheduler_configs: List[Any] = []

    def optimized(self, optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
        self.optimizers[:] = [optimizer]
        self.lr_scheduler_configs[:] = [SimpleNamespace(scheduler=scheduler)] if scheduler is not None else []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "estimated_stepping_batches":
            raise AttributeError("self.trainer.estimated_stepping_batches is not known on the driver with "
                                 "data_mode='direct' (the ranks count their rows): use data_mode='materialize', or "
                                 "set train_steps_per_epoch.")
        raise AttributeError(f"self.trainer.{name}: a LightningModule trained by TorchEstimator runs in the "
                             "estimator's loop, not in a Lightning Trainer; self.trainer has "
                             f"{', '.join(sorted(vars(self)))}. Use a train_fn for a loop of your own.")

    def update(self, ctx: StepContext) -> None:
        self.current_epoch, self.global_step = ctx.epoch - 1, ctx.global_step
        self.training, self.validating = ctx.training, not ctx.training


def attach(module: nn.Module, trainer: StandInTrainer) -> StandInTrainer:
    """The stand-in becomes `module.trainer` (and its Lightning children's); pickling a LightningModule drops it."""
    module.trainer = trainer
    return trainer


class Logged:
    """What `self.log`/`self.log_dict` recorded during one hook call: name -> a batch's number (a tensor)."""

    def __init__(self, hook: str):
        self.hook, self.values = hook, {}  # type: Dict[str, torch.Tensor]

    def log(self, name: str, value: Any, *args: Any, reduce_fx: Any = "mean", **kwargs: Any) -> None:
        if reduce_fx not in ("mean", "avg", torch.mean):
            raise ValueError(f"self.log({name!r}, ..., reduce_fx={reduce_fx!r}) in {self.hook}: TorchEstimator "
                             "averages every logged number over the epoch's rows on all ranks (reduce_fx='mean'). "
                             "Log a per-batch mean, or use a train_fn and report what you need.")
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            self.values[name] = value.detach().reshape(())
        elif isinstance(value, numbers.Number) and not isinstance(value, bool):
            self.values[name] = torch.tensor(float(value), dtype=torch.float64)
        else:
            kind = type(value).__name__ + (f" of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else "")
            raise ValueError(f"self.log({name!r}, <{kind}>) in {self.hook}: log a number or a one-element tensor, "
                             "this batch's value (a torchmetrics Metric: log metric(preds, target), the batch's "
                             "value, not the Metric object).")


@contextlib.contextmanager
def logging_into(module: nn.Module, hook: str) -> Iterator[Logged]:
    """`module.log` records into a Logged for the duration (LightningModule.log_dict calls self.log per entry)."""
    logged = Logged(hook)
    module.log = logged.log
    try:
        yield logged
    finally:
        del module.log


class LightningSteps(nn.Module):
    """What DistributedDataParallel wraps: its forward is the module's training_step, so the step's forward
    passes run inside DDP's (which prepares the gradient averaging). Its parameters are the module's."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, batch: Tuple[torch.Tensor, ...], batch_idx: int) -> Any:
        return call_hook(self.module, "training_step", batch, batch_idx)


def lightning_batch(tensors: Tensors) -> Any:
    """The tuple of the batch's tensors; one column alone (one feature, no labels) is that tensor, as a
    DataLoader over a dataset of tensors gives it (BoringModel's `self(batch)`)."""
    features, labels, weights = tensors
    batch = tuple(features) + tuple(labels) + ((weights,) if weights is not None else ())
    return batch[0] if len(batch) == 1 else batch


def step_loss(result: Any) -> torch.Tensor:
    """training_step's loss: a scalar tensor, or a dict's 'loss' (Lightning's two forms)."""
    loss = result.get("loss") if isinstance(result, dict) else result
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss.reshape(())
    if result is None:
        raise ValueError("training_step returned None: Lightning then skips the batch; TorchEstimator trains on "
                         "every batch (every rank takes the same steps). Return the loss.")
    got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
    raise ValueError(f"training_step must return the loss as a scalar tensor, or a dict with 'loss'; it returned "
                     f"{got}{' under loss' if isinstance(result, dict) else ''}.")


def optimizers_of(module: nn.Module) -> Tuple[torch.optim.Optimizer, Any, Optional[str], str]:
    """configure_optimizers' optimizer, its scheduler (or None), the scheduler's monitor (or None) and interval
    ('epoch' or 'step'), from the forms Lightning accepts with one optimizer; the rest refused by name."""
    if not getattr(module, "automatic_optimization", True):
        raise ValueError(f"{type(module).__name__} sets automatic_optimization = False (manual optimization): "
                         "TorchEstimator runs backward and the optimizer step itself. Write the loop as a train_fn "
                         "(docs/training.md 'Your own training loop'), which takes several optimizers.")
    got = module.configure_optimizers()
    optimizers, schedulers = _forms(got)
    if len(optimizers) != 1 or not isinstance(optimizers[0], torch.optim.Optimizer):
        raise ValueError(f"{type(module).__name__}.configure_optimizers() returned {_shown(got)}: TorchEstimator "
                         "trains a LightningModule with exactly one torch.optim.Optimizer (optionally with one "
                         "scheduler). For several optimizers, write the loop as a train_fn.")
    if len(schedulers) > 1:
        raise ValueError(f"{type(module).__name__}.configure_optimizers() returned {len(schedulers)} schedulers: "
                         "one is supported.")
    scheduler, monitor, interval = scheduler_config(schedulers[0], f"{type(module).__name__}.configure_optimizers()"
                                                    ) if schedulers else (None, None, "epoch")
    trainer = getattr(module, "_trainer", None)
    if isinstance(trainer, StandInTrainer):
        trainer.optimized(optimizers[0], scheduler)
    return optimizers[0], scheduler, monitor, interval


def scheduler_config(config: Any, where: str) -> Tuple[Any, Optional[str], str]:
    """(scheduler, monitor, interval) from a scheduler or Lightning's dict form ({'scheduler': ...,
    'interval': 'epoch' or 'step', 'monitor': ...}); `where` names what returned it in the errors."""
    config = config if isinstance(config, dict) else {"scheduler": config}
    interval, frequency = config.get("interval", "epoch"), config.get("frequency", 1)
    if interval not in ("epoch", "step") or frequency != 1:
        raise ValueError(f"{where}: the scheduler's interval={interval!r}, frequency={frequency!r}; TorchEstimator "
                         "steps a scheduler once per epoch (interval='epoch') or after every optimizer step "
                         "(interval='step'), frequency=1. Step it in a train_fn for other schedules.")
    scheduler, monitor = config.get("scheduler"), config.get("monitor")
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau) and (not monitor or interval == "step"):
        raise ValueError(f"{where} returned ReduceLROnPlateau without 'monitor' or with interval='step': return "
                         "{'scheduler': ..., 'monitor': 'val_loss'} naming a history key, stepped per epoch, as "
                         "Lightning requires.")
    return scheduler, monitor, interval


def optimizer_for(module: nn.Module, max_epochs: int, stepping: int) -> torch.optim.Optimizer:
    """configure_optimizers()' optimizer for a module off the ranks (the driver's TorchModel), with a stand-in
    trainer for the call only (configure_optimizers may read self.trainer.max_epochs or
    estimated_stepping_batches: `stepping`)."""
    attach(module, StandInTrainer(0, 1, 0, max_epochs, estimated_stepping_batches=stepping))
    try:
        return optimizers_of(module)[0]
    finally:
        module.trainer = None


def _forms(got: Any) -> Tuple[List[Any], List[Any]]:
    if isinstance(got, torch.optim.Optimizer):
        return [got], []
    if isinstance(got, dict):
        return [got.get("optimizer")], [got["lr_scheduler"]] if got.get("lr_scheduler") is not None else []
    if isinstance(got, (list, tuple)):
        if len(got) == 2 and all(isinstance(part, (list, tuple)) for part in got):
            return list(got[0]), list(got[1])
        if got and all(isinstance(part, dict) for part in got):
            optimizers, schedulers = [], []
            for part in got:
                one, sched = _forms(part)
                optimizers += one
                schedulers += sched
            return optimizers, schedulers
        return list(got), []
    return [got], []


def _shown(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)} ({', '.join(type(v).__name__ for v in value)})"
    return "None" if value is None else type(value).__name__
