"""The per-rank training loop: `train_worker(spec, ctx)`. torch only, no pyspark.

It runs the same inside a Spark barrier task and in a local process (tests, LocalLauncher). Batches come
ready from the data side (`estimator.data`: shards, feed); this module only trains on them.
"""
from __future__ import annotations

import contextlib
import json
import logging
import posixpath
import time
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import cloudpickle
import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from estimator.checkpoint import Position, load_checkpoint, position_of, save_checkpoint
from estimator.data.arrays import Tensors, tensors_to
from estimator.data.feed import Decoders, Feed, feed_workers
from estimator.data.plan import epoch_seed
from estimator.data.shards import EarlyRead, Shard, open_shards
from estimator.distributed import RankContext
from estimator.faults import Fault, inject
from estimator.finite import FiniteCheck
from estimator.host_allreduce import HostAllreduce
from estimator.losses import Objective
from estimator.pickling import rebuild_optimizer
from estimator.spec import TrainSpec, UserObjects, WorkerResult
from estimator.tracking import TensorBoardLog

log = logging.getLogger("estimator")
SCALED_DEVICES = ("cuda",)  # where precision='16-mixed' runs (tests add "cpu": torch has a CPU GradScaler)


def train_worker(spec: TrainSpec, ctx: RankContext, faults: Tuple[Fault, ...] = (), attempt: int = 0,
                 early: Optional[EarlyRead] = None) -> WorkerResult:
    """Train this rank; `early` holds its shards when the launcher started opening them already."""
    started = time.perf_counter()
    objs: UserObjects = cloudpickle.loads(spec.payload)
    device = torch.device(ctx.device)
    model = objs.model.to(device)
    optimizer = build_optimizer(objs, model)
    scheduler = objs.lr_scheduler_fn(optimizer) if objs.lr_scheduler_fn is not None else None
    state = load_checkpoint(spec.data.store, spec.resume_from, device) if spec.resume_from else None
    if state is not None:  # a retry or a refit of this run_id: continue where the checkpoint stands
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])  # after the scheduler's constructor reset the lr
        if scheduler is not None and state.get("lr_scheduler") is not None:
            scheduler.load_state_dict(state["lr_scheduler"])
    history = [dict(row) for row in state["history"]] if state is not None else []
    ddp = DistributedDataParallel(compiled(model, spec.compile), device_ids=[device.index] if device.type == "cuda"
                                  else None)
    comm = None
    if spec.compression == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif spec.shared_memory_allreduce and device.type == "cpu" and ctx.world_size > 1:
        comm = HostAllreduce.connect(ctx.rank, ctx.world_size, gradient_bytes(model), spec.collective_timeout)
        if comm is not None:
            ddp.register_comm_hook(None, comm.hook)
    try:
        allreduce = "shared memory" if comm is not None else (
            f"{ctx.backend} fp16" if spec.compression == "fp16" else ctx.backend)
        run = Run(spec, ctx, objs, model, ddp, optimizer, scheduler, history, faults, attempt)
        if state is not None and state.get("grad_scaler") and run.loop.scaler is not None:
            run.loop.scaler.load_state_dict(state["grad_scaler"])
        return run.train(position_of(state), started, allreduce, early)
    except BaseException:
        if comm is not None:
            comm.abort()  # the peers stop waiting for this rank in the next allreduce
        raise
    finally:
        if comm is not None:
            comm.close()


def compiled(model: nn.Module, setting: Any) -> nn.Module:
    """The module DDP wraps: `model` itself, or with compile=True/kwargs `torch.compile(model)`, which shares
    its parameters (the checkpoints save `model`, so they hold the plain module's keys). Compiling the inner
    module, not the DDP wrapper, keeps DDP's gradient hooks (and the shared-memory averaging) outside the
    compiled graph."""
    if setting is False:
        return model
    return torch.compile(model, **(setting if isinstance(setting, dict) else {}))


def gradient_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


class Run:
    """One rank's epochs: training, validation, the reduced history row, checkpoints."""

    def __init__(self, spec: TrainSpec, ctx: RankContext, objs: UserObjects, model: nn.Module, ddp: nn.Module,
                 optimizer: torch.optim.Optimizer, scheduler: Any, history: List[Dict[str, float]],
                 faults: Tuple[Fault, ...], attempt: int):
        self.spec, self.ctx, self.objs, self.model, self.ddp = spec, ctx, objs, model, ddp
        self.optimizer, self.scheduler, self.history = optimizer, scheduler, history
        self.device = torch.device(ctx.device)
        self.objective = Objective(objs.build_losses(), objs.loss_weights, objs.metrics, spec.data.label_cols,
                                   weighted=spec.data.sample_weight_col is not None)
        self.loop = TrainLoop(spec, ctx, ddp, optimizer, self.objective, faults, attempt, self.checkpoint_inside)
        self.faults, self.attempt = faults, attempt
        self.waited = self.looped = 0.0
        self.tensorboard: Optional[TensorBoardLog] = None

    def train(self, position: Position, started: float, allreduce: str, early: Optional[EarlyRead]) -> WorkerResult:
        spec, ctx = self.spec, self.ctx
        opening = time.perf_counter()
        train, val = (early.result(ctx.rank, ctx.world_size) if early is not None
                      else open_shards(spec, ctx.rank, ctx.world_size))
        read_wait = time.perf_counter() - opening
        self.loop.global_step = position.global_step
        if position.step and position.layout != self.layout():
            log.warning("rank %d: the checkpoint stands at batch %d of epoch %d with batch_size, ranks = %s; this run "
                        "has %s, so the epoch starts over from its first batch", ctx.rank, position.step,
                        position.epochs + 1, position.layout, self.layout())
            position = Position(position.epochs, global_step=position.global_step)
        callbacks = self.objs.callbacks if ctx.rank == 0 else []
        self.tensorboard = (TensorBoardLog.open(spec.data.store, spec.run.logs, spec.log_every_n_steps, spec.launch_id)
                            if spec.tensorboard and ctx.rank == 0 else None)
        if self.tensorboard is not None:
            self.loop.on_step = self.tensorboard.step
        _call(callbacks, "on_train_begin", {})
        self.decoders = {training: self.open_decoders(training) for training in (True, False)}
        try:
            for epoch in range(len(self.history), spec.epochs):
                stop = spec.monitor.stop_reason(self.history)  # the same on every rank: the rows are reduced
                if stop is not None:
                    if ctx.rank == 0:
                        log.info("stopping early after epoch %d: %s", epoch, stop)
                    break
                inside = position if epoch == position.epochs and position.step else Position(epoch)
                inject(self.faults, "epoch", ctx.rank, self.attempt, epoch + 1)
                self.epoch(epoch, train, val, inside)
                _call(callbacks, "on_epoch_end", epoch, dict(self.history[-1]))
        finally:
            for closing in (train, val, *self.decoders.values(), self.tensorboard):
                if closing is not None:
                    closing.close()
        _call(callbacks, "on_train_end", {"history": self.history})
        del self.ddp, self.loop  # the caller's teardown needs DDP gone before destroy_process_group
        reader = train.describe() + (f"; val {val.describe()}" if val is not None else "")
        return WorkerResult(ctx.rank, tuple(self.history), str(self.device), train.rows,
                            time.perf_counter() - started, reader=reader,
                            optimizer_steps=optimizer_steps(self.optimizer), assigned_gpu=ctx.assigned_gpu,
                            allreduce=allreduce, read_seconds=early.seconds if early is not None else read_wait,
                            read_wait_seconds=read_wait, data_wait_seconds=self.waited,
                            train_loop_seconds=self.looped)

    def epoch(self, epoch: int, train: Shard, val: Optional[Shard], inside: Position) -> None:
        spec, ctx = self.spec, self.ctx
        began = time.perf_counter()
        if self.loop.steps_report is not None:
            self.loop.steps_report.begin(train.plan().steps, float(sum(inside.sums[2:3])) if inside.sums else 0.0)
        feed = self.feed(train.epoch(epoch, inside.step), True)
        try:
            sums = self.loop.train_epoch(epoch, iter(feed), inside)
        finally:
            feed.close()
        seconds = time.perf_counter() - began
        timing = torch.tensor([feed.waited, seconds], dtype=torch.float64, device=self.device)
        self.waited, self.looped = self.waited + feed.waited, self.looped + seconds
        if val is not None:
            val_feed = self.feed(val.epoch(epoch), False)
            try:
                sums = torch.cat([sums, self.loop.evaluate(self.model, iter(val_feed))])
            finally:
                val_feed.close()
        reduced = reduce_sums(torch.cat([sums, timing]))
        row = {"epoch": float(epoch + 1),
               **self.objective.summarize(reduced[:-2], with_val=val is not None),
               "data_wait": reduced[-2] / max(reduced[-1], 1e-9)}  # of the ranks' training time, all ranks
        self.history.append(row)
        self.loop.finite.check_epoch(self.model, row, epoch)  # before these weights are checkpointed
        if self.tensorboard is not None:  # rows/s: every rank's rows over the ranks' mean epoch time
            self.tensorboard.epoch(epoch + 1, row, float(self.optimizer.param_groups[0]["lr"]),
                                   float(reduced[2]) / max(float(reduced[-1]) / ctx.world_size, 1e-9))
        if self.scheduler is not None:
            step_scheduler(self.scheduler, row)
        if ctx.rank == 0:
            self.save(Position(epoch + 1, global_step=self.loop.global_step), best=True)
            spec.data.store.write_bytes_atomic(spec.run.progress, json.dumps(self.history).encode())
            if spec.verbose:
                log.info("epoch %d/%d %s", epoch + 1, spec.epochs, format_metrics(row))

    def open_decoders(self, training: bool) -> Decoders:
        reader, fn = self.spec.reader, self.objs.transformation_fn
        workers = feed_workers(reader.train_workers if training else reader.val_workers, fn is not None)
        pool = reader.pool_type if reader.kind == "arrow" else "thread"  # petastorm's pool type is its readers'
        return Decoders(fn, workers, pool, reader.mp_start_method, name=f"decode-rank-{self.ctx.rank}")

    def feed(self, batches: Iterator[Any], training: bool) -> Feed:
        return Feed(batches, self.spec.data, self.decoders[training], pin=self.device.type == "cuda",
                    name=f"feed-rank-{self.ctx.rank}")

    def checkpoint_inside(self, epoch: int, step: int, sums: torch.Tensor) -> None:
        """Every rank calls this at the same optimizer step: the sums so far are reduced (a collective), and
        rank 0 writes them with the position, so a resumed epoch reports what an uninterrupted one would."""
        reduced = reduce_sums(sums.clone())
        self.loop.finite.check_weights(self.model, epoch, step)
        if self.ctx.rank == 0:
            self.save(Position(epoch, step, reduced, self.loop.global_step, self.layout()))

    def layout(self) -> List[int]:
        return [self.spec.batch_size, self.ctx.world_size]

    def save(self, position: Position, best: bool = False) -> None:
        """The run's checkpoint; at an epoch's end (`best`), also this epoch's own copy when it is among the
        save_top_k best by the monitor, and the copies of epochs that left the top k are removed."""
        spec, store = self.spec, self.spec.data.store
        top = spec.monitor.top_k(self.history, spec.save_top_k) if best else []
        epoch = len(self.history)
        save_checkpoint(store, spec.run.checkpoint, self.model, self.optimizer, self.history, position,
                        self.scheduler, copies=[spec.run.best(epoch)] if epoch in top else [], scaler=self.loop.scaler)
        if best:
            keep = {posixpath.basename(spec.run.best(e)) for e in top}
            for path in store.ls(spec.run.best_dir) if store.exists(spec.run.best_dir) else []:
                if posixpath.basename(path) not in keep:
                    store.rm(path)


class TrainLoop:
    """One epoch of training or validation over ready batches, with accumulation and NaN checks."""

    def __init__(self, spec: TrainSpec, ctx: RankContext, ddp: nn.Module, optimizer: torch.optim.Optimizer,
                 objective: Objective, faults: Tuple[Fault, ...] = (), attempt: int = 0, checkpoint: Any = None):
        self.spec, self.ctx, self.ddp, self.optimizer = spec, ctx, ddp, optimizer
        self.objective, self.faults, self.attempt, self.checkpoint = objective, faults, attempt, checkpoint
        self.device = torch.device(ctx.device)
        if spec.precision == "16-mixed" and self.device.type not in SCALED_DEVICES:
            raise ValueError(f"precision='16-mixed' needs CUDA (float16 autocast with a GradScaler) but rank "
                             f"{ctx.rank} trains on {ctx.device}. Use precision='bf16-mixed' on CPUs, or GPUs.")
        self.autocast_dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(spec.precision)
        self.scaler = torch.amp.GradScaler(self.device.type) if spec.precision == "16-mixed" else None
        self.global_step = 0  # optimizer steps over the whole run (carried over a resume)
        self.on_step: Optional[Callable[[int, torch.Tensor], None]] = None  # rank 0's TensorBoard step loss
        self.steps_report = StepReport(spec, ctx) if spec.verbose >= 2 and ctx.rank == 0 else None
        self.finite = FiniteCheck(spec.terminate_on_nan, ctx.rank, self.device)

    def train_epoch(self, epoch: int, batches: Iterable[Tensors], inside: Optional[Position] = None) -> torch.Tensor:
        """`inside`: where a resumed epoch starts (its batch index, and rank 0's sums of the batches before)."""
        self.ddp.train()
        every, start = self.spec.backward_passes_per_step, inside.step if inside else 0
        sums = torch.zeros(self.objective.width, dtype=torch.float64, device=self.device)
        if inside is not None and inside.sums and self.ctx.rank == 0:
            sums += torch.tensor(inside.sums[:self.objective.width], dtype=torch.float64, device=self.device)
        self.optimizer.zero_grad(set_to_none=True)
        # Each batch's randomness (dropout) depends only on (seed, epoch, rank, step): a resumed run draws
        # what an uninterrupted one did, wherever it resumed.
        base = int(epoch_seed(self.spec.seed, epoch, self.ctx.rank).generate_state(1, np.uint64)[0]) >> 2
        for step, (batch, last) in enumerate(with_last(self.on_device(batches)), start=start):
            inject(self.faults, "step", self.ctx.rank, self.attempt, epoch + 1, self.global_step + 1)
            self.seed(base + step)
            features, labels, weights = batch
            stepping = (step + 1) % every == 0 or last  # a partial accumulation still steps at epoch end
            with contextlib.nullcontext() if stepping else self.ddp.no_sync():  # no allreduce while accumulating
                with self.autocast():
                    loss, batch_sums = self.objective(as_tuple(self.ddp(*features)), labels, weights)
                self.finite.loss(loss, epoch, step)
                scaled = loss / every if every > 1 else loss
                (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
            sums += batch_sums
            if self.steps_report is not None:
                self.steps_report.batch(epoch, step + 1, sums)
            if stepping:
                self.step()
                self.global_step += 1
                self.optimizer.zero_grad(set_to_none=True)
                if self.on_step is not None:
                    self.on_step(self.global_step, loss.detach())
                steps = self.spec.checkpoint_steps
                if steps and self.global_step % steps == 0 and not last and self.checkpoint is not None:
                    self.checkpoint(epoch, step + 1, sums)
        self.finite.flush(epoch)
        return sums

    def autocast(self) -> Any:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def step(self) -> None:
        """One optimizer step: gradients unscaled (16-mixed), the global norm clipped (gradient_clip_val; every
        rank holds the same averaged gradients, so every rank clips alike), then the step."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if self.spec.gradient_clip_val is not None:
            torch.nn.utils.clip_grad_norm_(self.ddp.parameters(), self.spec.gradient_clip_val)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()

    def seed(self, value: int) -> None:
        """This device's generator only: torch.manual_seed seeds every backend and took 200 us a step here."""
        if self.device.type == "cuda":
            torch.cuda.default_generators[self.device.index].manual_seed(value)
        torch.default_generator.manual_seed(value)

    def evaluate(self, model: nn.Module, batches: Iterable[Tensors]) -> torch.Tensor:
        """Exact validation over this rank's batches. Runs the plain module, not DDP: ranks may have
        different numbers of validation batches, and no collective may run per batch."""
        model.eval()
        sums = torch.zeros(self.objective.width, dtype=torch.float64, device=self.device)
        with torch.no_grad(), self.autocast():
            for features, labels, weights in self.on_device(batches):
                sums += self.objective(as_tuple(model(*features)), labels, weights)[1]
        return sums

    def on_device(self, batches: Iterable[Tensors]) -> Iterator[Tensors]:
        """Copies start when a batch is taken; with `with_last` looking one ahead, the next batch's copy to the
        GPU (from pinned memory, non_blocking) overlaps the current batch's computation."""
        return (tensors_to(batch, self.device) for batch in batches)



class StepReport:
    """verbose=2: rank 0 leaves where the epoch stands in the store about once a second (batch, of how many, rows/s,
    the running loss of its own batches), for the driver's progress bar."""

    INTERVAL = 1.0

    def __init__(self, spec: TrainSpec, ctx: RankContext):
        self.spec, self.world = spec, ctx.world_size
        self.steps = 0  # batches in this epoch, set by the Run before each epoch
        self.started, self.last, self.rows_at_start = time.perf_counter(), 0.0, 0.0

    def begin(self, steps: int, epoch_rows_so_far: float) -> None:
        self.steps, self.started, self.last, self.rows_at_start = steps, time.perf_counter(), 0.0, epoch_rows_so_far

    def batch(self, epoch: int, done: int, sums: torch.Tensor) -> None:
        now = time.perf_counter()
        if now - self.last < self.INTERVAL and done < self.steps:
            return
        self.last = now
        loss_sum, weight, rows = (float(v) for v in sums[:3])
        state = {"epoch": epoch + 1, "step": done, "steps": self.steps, "loss": loss_sum / weight if weight else None,
                 "rows_per_second": (rows - self.rows_at_start) * self.world / max(now - self.started, 1e-9)}
        try:
            self.spec.data.store.write_bytes_atomic(self.spec.run.steps, json.dumps(state).encode())
        except Exception:  # noqa: BLE001 - progress only
            log.debug("could not write the step progress", exc_info=True)


def build_optimizer(objs: UserObjects, model: nn.Module) -> torch.optim.Optimizer:
    """The user's optimizer rebuilt over this rank's model: same class, groups, hyperparams, state."""
    return rebuild_optimizer(objs.optimizer_cls, objs.optimizer_groups, objs.optimizer_defaults,
                             objs.optimizer_state, model)


def optimizer_steps(optimizer: torch.optim.Optimizer) -> int:
    """Steps taken, where the optimizer counts them (Adam, AdamW, ...); 0 otherwise."""
    steps = [s.get("step") for s in optimizer.state.values() if "step" in s]
    return int(max(float(s) for s in steps)) if steps else 0


def with_last(items: Iterable[Any]) -> Iterator[Tuple[Any, bool]]:
    """(item, is_last) pairs, looking one item ahead."""
    iterator = iter(items)
    try:
        current = next(iterator)
    except StopIteration:
        return
    for following in iterator:
        yield current, False
        current = following
    yield current, True


def reduce_sums(sums: torch.Tensor) -> List[float]:
    """One all_reduce: every rank's (loss * rows, rows, metric * rows, ...) summed."""
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    return sums.cpu().tolist()


def as_tuple(outputs: Any) -> Tuple[torch.Tensor, ...]:
    return tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)


def step_scheduler(scheduler: Any, row: Dict[str, float]) -> None:
    """Once per epoch, on every rank alike (the row's metrics are already reduced over all ranks)."""
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        scheduler.step(row.get("val_loss", row["loss"]))
    else:
        scheduler.step()


def format_metrics(row: Dict[str, float]) -> str:
    return " ".join(f"{k}={v:.4f}" for k, v in row.items() if k != "epoch")


def _call(callbacks: Sequence[Any], method: str, *args: Any) -> None:
    for callback in callbacks:
        hook = getattr(callback, method, None)
        if hook is not None:
            hook(*args)
