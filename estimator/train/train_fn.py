"""Your own training loop: `train_fn=fn`, run on every rank as `fn(ctx)`, over the estimator's machinery.

`ctx` gives the rank (`rank`, `world_size`, `device`), the model (`model`: DistributedDataParallel-wrapped, on the
device, or for one rank a stand-in with the same calls: call it, `.module`, `no_sync()`; `module`: the plain one,
for validation), the estimator's `optimizer` (restored on a resume), `epochs` and `start_epoch` (a retried or
refitted run starts at its checkpoint's epoch, model and optimizer restored), `epochs_to_run()` (the epochs left,
ending early when early stopping says so), the rank's batches of an epoch (`train_batches()`, `val_batches()`:
estimator.train.steps.Batch objects on the device, from the same readers as the built-in loop, shuffled per epoch
alike), `report(metrics)` once per epoch, `should_stop`, `autocast()` and `keep(name, obj)` for more stateful
objects (a second optimizer...), checkpointed with the model and restored on a resume.

`report` makes the epoch's history row on every rank: each number is taken as this rank's mean over the rows it
trained on this epoch (or over `rows=`), and averaged over all ranks weighted by rows, as the built-in loop's
metrics are. The row drives early stopping (`monitor` must be one of its keys), TensorBoard, MLflow, the
learning-rate schedule and rank 0's checkpoint of the epoch. Resuming inside an epoch (checkpoint_steps) is the
built-in loop's: a train_fn resumes at its last reported epoch. torch only, no pyspark."""
from __future__ import annotations

import numbers
import time
from typing import Any, Callable, Dict, Iterator, Optional

import torch
import torch.distributed as dist

from estimator.core.faults import inject
from estimator.data.shards import Shard
from estimator.failures import FailureKind
from estimator.train.loop import reduce_sums
from estimator.train.steps import Batch, Named, as_batch
from estimator.train.sums import ROWS, Mean, Sums, metric_slot, weight_slot

SECONDS = "seconds"  # a report's slot: the rank's seconds in the epoch (the rows per second over the ranks' mean)


class TrainFnMisuse(RuntimeError):
    """A train_fn that breaks its contract with the estimator (an epoch without a report, no epoch reported at all,
    a process group of its own). Another launch would meet it again: not retried."""

    failure_kind = FailureKind.USAGE


def number(value: Any) -> float:
    """A reported number as float64: a Python or numpy number as it is (torch.as_tensor(0.005) is float32's
    0.004999999888), a tensor's value."""
    if isinstance(value, numbers.Real):
        return float(value)
    return float(torch.as_tensor(value).detach().double().cpu())


class TrainContext(Named):
    """What `train_fn(ctx)` runs on, on every rank (docs/training.md 'Your own training loop'). Its methods
    (below): `epochs_to_run()`, `train_batches()` and `val_batches()` (Batch objects), `autocast()`,
    `keep(name, obj)` (checkpointed with the model) and `report(metrics, rows=None)` once per epoch; its
    properties `rows` and `should_stop`.

    Attributes:
        rank: This rank's number, 0 to world_size - 1.
        world_size: How many ranks train.
        device: This rank's device.
        model: The DistributedDataParallel-wrapped module (for one rank a stand-in): call it to train.
        module: The plain module, unwrapped.
        optimizer: The run's optimizer.
        epochs: The epochs the run trains in all.
        start_epoch: The first epoch (0-based) this launch trains; later than 0 in a resumed run.
        epoch: The current epoch, 0-based.
        history: The history's rows so far.
    """

    def __init__(self, run: Any, train: Shard, val: Optional[Shard], on_epoch_end: Callable[[int, dict], None]):
        """`run`: the rank's estimator.train.epochs.Run; `on_epoch_end(epoch, row)`: the callbacks' hook."""
        self._run, self._train, self._val, self._on_epoch_end = run, train, val, on_epoch_end
        self.rank, self.world_size = run.ctx.rank, run.ctx.world_size
        self.device = run.device
        self.model, self.module, self.optimizer = run.rank.trained, run.model, run.optimizer
        self.epochs, self.start_epoch = run.spec.epochs, len(run.history)
        self.epoch = self.start_epoch  # the epoch being trained (0-based), or the next one
        self._rows = 0  # training rows this rank took this epoch
        self._began = time.perf_counter()
        self._running: Optional[int] = None  # the epoch epochs_to_run() has given and not yet taken back

    @property
    def history(self) -> list:
        return [dict(row) for row in self._run.history]

    @property
    def rows(self) -> int:
        """The training rows this rank has taken from train_batches() in the current epoch."""
        return self._rows

    @property
    def should_stop(self) -> bool:
        """Early stopping says stop, or every epoch is done (the same on every rank)."""
        history = self._run.history
        return len(history) >= self.epochs or self._run.spec.monitor.stop_reason(history) is not None

    def epochs_to_run(self) -> Iterator[int]:
        """The epochs left (0-based), each to end with report(); ends early when early stopping says so."""
        while len(self._run.history) < self.epochs and self._run.stop_reason(len(self._run.history)) is None:
            epoch = len(self._run.history)
            self.epoch, self._rows, self._began = epoch, 0, time.perf_counter()
            inject(self._run.faults, "epoch", self.rank, self._run.attempt, epoch + 1)
            self._running = epoch
            try:
                yield epoch
            finally:
                self._running = None
            if len(self._run.history) == epoch:
                raise TrainFnMisuse(f"train_fn finished epoch {epoch + 1} without ctx.report(metrics): report "
                                    "once per epoch (the history, early stopping and the checkpoint come from it).")

    def train_batches(self) -> Iterator[Batch]:
        """This rank's training batches of the current epoch, on the device, shuffled as the built-in loop's."""
        run, loop = self._run, self._run.loop
        feed = run.feed(self._train.epoch(self.epoch, 0), True)
        began = time.perf_counter()
        try:
            for tensors, _ in loop.on_device(feed):
                inject(run.faults, "step", self.rank, run.attempt, self.epoch + 1, loop.global_step + 1)
                batch = as_batch(tensors, run.spec.data)
                self._rows += batch.rows
                loop.count_step()  # batches, as the faults and TensorBoard's steps count them here
                yield batch
        finally:
            feed.close()
            run.waited_for(feed.waited, time.perf_counter() - began)

    def val_batches(self) -> Iterator[Batch]:
        """This rank's validation batches (none without validation data)."""
        if self._val is None:
            return
        if self._run.strategy.lockstep:
            raise ValueError(f"ctx.val_batches() with strategy={self._run.strategy.name!r} on several ranks is not "
                             "served: a sharded forward is a collective, and ranks hold different numbers of "
                             "validation batches. Validate with the built-in loop or train_step, or without "
                             "validation in train_fn (docs/gpus.md 'Shard a large model').")
        feed = self._run.feed(self._val.epoch(self.epoch), False)
        try:
            for tensors, _ in self._run.loop.on_device(feed):
                yield as_batch(tensors, self._run.spec.data)
        finally:
            feed.close()

    def autocast(self) -> Any:
        """The `precision` param's autocast (a no-op for '32')."""
        return self._run.loop.autocast()

    def keep(self, name: str, obj: Any) -> Any:
        """Checkpoint `obj` (anything with state_dict/load_state_dict) with the model under `name`; on a resume
        its state is restored here. Returns `obj`."""
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise TypeError(f"ctx.keep({name!r}, ...) needs an object with state_dict() and load_state_dict(); got "
                            f"{type(obj).__name__}.")
        self._run.keep(name, obj)
        return obj

    def report(self, metrics: Dict[str, Any], rows: Optional[int] = None) -> Dict[str, float]:
        """The epoch's numbers from this rank, averaged over all ranks by rows (a collective: every rank calls
        it once per epoch with the same keys); returns the history row. A number is this rank's mean over the
        training rows it took this epoch (or over `rows`); a (mean, rows) pair is a mean over other rows (say,
        this rank's validation rows), weighted by those."""
        run = self._run
        if self._running is None or len(run.history) > self._running:
            raise TrainFnMisuse(
                "ctx.report was called " + ("outside `for epoch in ctx.epochs_to_run():`" if self._running is None
                                            else f"twice in epoch {self._running + 1}")
                + f": report once per epoch the loop gives. A loop of its own (range({self.epochs})) would report "
                "epochs the run does not train, and after a retry train more than `epochs` (the history, early "
                "stopping and the checkpoint come from the reports; docs/training.md 'Your own training loop').")
        keys = sorted(metrics)
        if any(k in ("epoch", "data_wait") for k in keys):
            raise ValueError("ctx.report: 'epoch' and 'data_wait' are the estimator's own history keys.")
        trained = float(self._rows if rows is None else rows)
        pairs = [metrics[k] if isinstance(metrics[k], tuple) else (metrics[k], trained) for k in keys]
        seconds = time.perf_counter() - self._began
        layout = Sums((*(metric_slot(k) for k in keys), *(weight_slot(k) for k in keys), ROWS, SECONDS),
                      tuple(Mean(k, metric_slot(k), weight_slot(k)) for k in keys))
        values = [(number(v), float(w)) for v, w in pairs]
        named = {**{metric_slot(k): v * w for k, (v, w) in zip(keys, values)},
                 **{weight_slot(k): w for k, (_, w) in zip(keys, values)}, ROWS: trained, SECONDS: seconds}
        reduced = layout.named(reduce_sums(layout.vector(named, self.device)))
        row = {"epoch": float(self.epoch + 1), **layout.means_of(reduced)}
        if run.spec.monitor.key not in row:
            raise ValueError(f"monitor={run.spec.monitor.key!r} is not among the numbers train_fn reports "
                             f"({keys}): report it, or set monitor to one of them.")
        run.record(self.epoch, row, reduced[ROWS] / max(reduced[SECONDS] / self.world_size, 1e-9), seconds)
        self._on_epoch_end(self.epoch, dict(row))
        return row

    def run(self, fn: Callable[["TrainContext"], Any]) -> None:
        """`fn(self)`, refused by name where it breaks the contract (a TorchDistributor script's habits: its own
        epoch loop, its own process group)."""
        grouped = dist.is_available() and dist.is_initialized()
        try:
            fn(self)
        except ValueError as exc:
            if "default process group twice" not in str(exc):
                raise
            raise TrainFnMisuse("train_fn called torch.distributed.init_process_group, but every rank's process "
                                "group is set up before train_fn runs (ctx.rank, ctx.world_size): remove the call, "
                                "and train ctx.model, which is already DistributedDataParallel.") from exc
        if grouped and not dist.is_initialized():
            raise TrainFnMisuse("train_fn called torch.distributed.destroy_process_group, but the estimator ends "
                                "every rank's process group itself after train_fn returns (it still needs it for the "
                                "checkpoint and the results): remove the call.")
        left = self.epochs - self.start_epoch
        if left > 0 and len(self._run.history) == self.start_epoch and self._run.stop_reason(self.start_epoch) is None:
            raise TrainFnMisuse(f"train_fn returned without reporting an epoch ({left} to train): loop over `for "
                                "epoch in ctx.epochs_to_run():` and end each epoch with ctx.report(metrics) "
                                "(docs/training.md 'Your own training loop'). The history, early stopping and the "
                                "checkpoint the fitted model comes from are made by the reports.")
