"""One rank's epochs, over its objects built whole (estimator.train.rank): training and validation over its
shards, the history row reduced over all ranks, the learning-rate schedule, TensorBoard, the callbacks and the
checkpoints (the strategy's, kept by the retention's rule). The step-level loop is estimator.train.loop's. torch
only, no pyspark."""
from __future__ import annotations

import functools
import json
import logging
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from estimator.core.faults import Fault, inject
from estimator.core.spec import WorkerResult
from estimator.data.balance import WINDOW, balance
from estimator.data.cached import CachedShard
from estimator.data.feed import Decoders, Feed, decoding, rank_cores
from estimator.data.remainder import Remainder, known_order, remainder_for
from estimator.data.repeats import leaves_out
from estimator.data.shards import EarlyRead, Shard, open_shards
from estimator.data.lm import batch_tokenizer
from estimator.data.reference import stored_reference
from estimator.train.checkpoint import CheckpointWriter, Position, checkpoint_file, describe, write_checkpoint
from estimator.train.loop import TrainLoop, reduce_sums
from estimator.train.rank import Rank
from estimator.train.retention import Retention
from estimator.train.strategies.base import CheckpointAt, local_bytes
from estimator.train.sums import ROWS, split
from estimator.train.tensorboard import TensorBoardLog

log = logging.getLogger("estimator")
PROGRESS_SECONDS = "_epoch_seconds"  # a progress row's key for the epoch's seconds; not a history key


class Run:
    """One rank's epochs: training, validation, the reduced history row, checkpoints."""

    def __init__(self, rank: Rank, faults: Tuple[Fault, ...], attempt: int):
        spec, ctx, objs = rank.spec, rank.ctx, rank.objs
        self.rank, self.spec, self.ctx, self.objs = rank, spec, ctx, objs
        self.strategy, self.model, self.optimizer = rank.strategy, rank.model, rank.optimizer
        self.history: List[Dict[str, float]] = [dict(row) for row in rank.resumed.history]
        self.device = torch.device(ctx.device)
        self.faults, self.attempt = faults, attempt
        # the objective chosen on the driver (estimator.train.objectives); None for a train_fn, which computes its own
        if objs.objective is None and objs.train_fn is None:
            raise ValueError("The launch's user objects name no objective and no train_fn: build them with "
                             "user_objects(..., objective=...) (estimator.train.objectives.registry), as fit does.")
        self.objective = objs.objective.for_rank(spec, objs, rank.model, rank.trainer) if objs.objective else None
        scheduler = rank.schedule.scheduler
        self.loop = TrainLoop(spec, ctx, rank.strategy, rank.trained, rank.optimizer, self.objective, faults, attempt,
                              checkpoint=self.checkpoint_inside,
                              on_step=self.step_logged if spec.tensorboard and ctx.rank == 0 else None,
                              after_step=scheduler.step if scheduler is not None and rank.schedule.interval == "step"
                              else None, scaler_state=rank.resumed.grad_scaler,
                              global_step=rank.resumed.position.global_step)
        self.waited = self.looped = 0.0
        self.seconds: Dict[int, float] = {}  # rank 0's wall seconds of each epoch this launch ran (the epoch line's)
        self.tensorboard: Optional[TensorBoardLog] = None  # rank 0's, while training
        self.extra_state: Dict[str, Any] = {}  # train_fn's own stateful objects, checkpointed by name (ctx.keep)
        self.cached, self.in_remainder = False, False  # the training shard is in memory; training the rest of an epoch
        self.remainder: Optional[Remainder] = None  # the rest of the epoch the checkpoint stands in, other layout
        self.writer = CheckpointWriter(spec.checkpoint_async)  # rank 0's checkpoint writes (fsdp: every rank's)
        self.retention = Retention(spec.data.store, spec.run, spec.monitor, spec.save_top_k)

    def train(self, started: float, early: Optional[EarlyRead]) -> WorkerResult:
        spec, ctx = self.spec, self.ctx
        position = self.rank.resumed.position
        opening = time.perf_counter()
        train, val = (early.result(ctx.rank, ctx.world_size) if early is not None
                      else open_shards(spec, ctx.rank, ctx.world_size))
        read_wait = time.perf_counter() - opening
        self.cached = isinstance(train, CachedShard)
        if position.step and not same_layout(position.layout, self.layout()):
            self.remainder = remainder_for(spec, train, position.epochs, position.layout, ctx.rank, ctx.world_size,
                                           position.step)
            if self.remainder is None:
                log.warning("rank %d: the checkpoint stands at batch %d of epoch %d with layout %s (batch_size, ranks, "
                            "in memory, order known, train_steps_per_epoch, balanced window); this run has %s and the rows done "
                            "cannot be known, so the epoch starts over from its first batch", ctx.rank,
                            position.step, position.epochs + 1, position.layout, self.layout())
                position = Position(position.epochs, global_step=position.global_step)
        callbacks = self.objs.callbacks if ctx.rank == 0 else []
        self.tensorboard = (TensorBoardLog.open(spec.data.store, spec.run.logs, spec.log_every_n_steps, spec.launch_id)
                            if spec.tensorboard and ctx.rank == 0 else None)
        call_callbacks(callbacks, "on_train_begin", {})
        self.decoders = {training: self.open_decoders(training) for training in (True, False)}
        try:
            if self.objs.train_fn is not None:  # the user's own loop over the same batches, history and checkpoints
                from estimator.train.train_fn import TrainContext

                TrainContext(self, train, val, functools.partial(call_callbacks, callbacks, "on_epoch_end")).run(
                    self.objs.train_fn)
            else:
                self.epochs(train, val, position, callbacks)
            self.writer.wait()  # the last checkpoint is in the store before the driver reads it
        finally:
            self.writer.close()
            for closing in (train, val, *self.decoders.values(), self.tensorboard):
                if closing is not None:
                    closing.close()
        call_callbacks(callbacks, "on_train_end", {"history": self.history})
        reader = train.describe() + (f"; val {val.describe()}" if val is not None else "")
        return WorkerResult(ctx.rank, tuple(self.history), str(self.device), train.rows,
                            time.perf_counter() - started, reader=reader,
                            optimizer_steps=optimizer_steps(self.optimizer), assigned_gpu=ctx.assigned_gpu,
                            allreduce=self.strategy.describe(),
                            read_seconds=early.seconds if early is not None else read_wait,
                            read_wait_seconds=read_wait, data_wait_seconds=self.waited,
                            train_loop_seconds=self.looped, checkpoint_wait_seconds=self.writer.stalled,
                            state_bytes=local_bytes(self.model, self.optimizer))

    def step_logged(self, step: int, loss: torch.Tensor) -> None:
        """An optimizer step's loss, to rank 0's TensorBoard (the loop calls this only where there is one: no
        call and no op a step otherwise)."""
        if self.tensorboard is not None:  # None when the tensorboard package is missing
            self.tensorboard.step(step, loss)

    def waited_for(self, waited: float, looped: float) -> None:
        """A train_fn's epoch: its seconds waiting for batches, and in its loop."""
        self.waited, self.looped = self.waited + waited, self.looped + looped

    def keep(self, name: str, obj: Any) -> None:
        """train_fn's `ctx.keep`: `obj` checkpointed with the model under `name`, its state restored on a resume."""
        self.extra_state[name] = obj
        if name in self.rank.resumed.extra:
            obj.load_state_dict(self.rank.resumed.extra[name])

    def epochs(self, train: Shard, val: Optional[Shard], position: Position, callbacks: Sequence[Any]) -> None:
        """The built-in loop: the epochs left after `position`, each trained (estimator.train.loop) and validated."""
        for epoch in range(len(self.history), self.spec.epochs):
            if self.stop_reason(epoch) is not None:
                break
            inside = position if epoch == position.epochs and position.step else Position(epoch)
            inject(self.faults, "epoch", self.ctx.rank, self.attempt, epoch + 1)
            self.epoch(epoch, train, val, inside)
            call_callbacks(callbacks, "on_epoch_end", epoch, dict(self.history[-1]))

    def epoch(self, epoch: int, train: Shard, val: Optional[Shard], inside: Position) -> None:
        ctx = self.ctx
        began = time.perf_counter()
        remainder, self.remainder = self.remainder, None  # only the epoch the checkpoint stands in has one
        if remainder is not None:  # the rest of an epoch begun under another layout: its rows left, each once
            inside = Position(inside.epochs, 0, inside.sums, inside.global_step)
        if self.loop.steps_report is not None:
            layout = self.objective.layout
            self.loop.steps_report.begin(remainder.steps if remainder else train.plan().steps,
                                         layout.restore(inside.sums)[ROWS] if inside.sums else 0.0)
        feed = self.feed(self.training_batches(epoch, train, remainder, inside.step), True, drop_repeats=True)
        self.in_remainder = remainder is not None
        try:
            sums = self.loop.train_epoch(epoch, iter(feed), inside, uneven=self.uneven(train, remainder))
        finally:
            feed.close()
            self.in_remainder = False
        seconds = time.perf_counter() - began
        timing = torch.tensor([feed.waited, seconds], dtype=torch.float64, device=self.device)
        self.waited, self.looped = self.waited + feed.waited, self.looped + seconds
        if val is not None:
            val_feed = self.feed(val.epoch(epoch), False)
            try:
                sums = torch.cat([sums, self.loop.evaluate(self.model, iter(val_feed), epoch)])
            finally:
                val_feed.close()
        reduced = reduce_sums(torch.cat([sums, timing]))
        trained, validated = split(self.objective.layout, reduced[:-2], with_val=val is not None)
        waited, looped = reduced[-2:]
        row = {"epoch": float(epoch + 1), **self.objective.summarize(trained, validated),
               "data_wait": waited / max(looped, 1e-9)}  # of the ranks' training time, all ranks
        # rows/s: every rank's rows over the ranks' mean epoch time
        self.record(epoch, row, trained[ROWS] / max(looped / ctx.world_size, 1e-9), time.perf_counter() - began)

    @property
    def balanced(self) -> bool:
        lm = self.spec.data.lm
        return lm is not None and lm.packed and self.spec.shuffle

    def training_batches(self, epoch: int, train: Shard, remainder: Optional[Remainder], skip: int) -> Iterator[Any]:
        """The epoch's raw batches from batch `skip` on; packed and shuffled, in balanced windows
        (estimator.data.balance), a resumed one read from its window's first batch."""
        lm = self.spec.data.lm
        if not self.balanced:
            return remainder.batches(self.spec, train) if remainder else train.epoch(epoch, skip)
        if remainder:
            return balance(remainder.batches(self.spec, train), lm)
        start = skip - skip % WINDOW
        return balance(train.epoch(epoch, start), lm, drop=skip - start)

    def record(self, epoch: int, row: Dict[str, float], rows_per_second: float, seconds: float) -> None:
        """An epoch's history row (the same on every rank): NaN checks, TensorBoard, the learning-rate schedule,
        rank 0's checkpoint (and the best epochs') and the progress the driver shows. `seconds`: the epoch's
        training and validation on this rank, told in the driver's epoch line (not a history key)."""
        spec, schedule = self.spec, self.rank.schedule
        if schedule.reports_lr:  # the rate the next step takes (lr_schedule), the same on every rank
            row = {**row, "lr": float(self.optimizer.param_groups[0]["lr"])}
        self.history.append(row)
        self.seconds[epoch] = seconds
        self.loop.finite.check_epoch(self.model, row, epoch)  # before these weights are checkpointed
        if self.tensorboard is not None:
            self.tensorboard.epoch(epoch + 1, row, float(self.optimizer.param_groups[0]["lr"]), rows_per_second)
        if schedule.scheduler is not None and schedule.interval == "epoch":
            step_scheduler(schedule.scheduler, row, schedule.monitor)
        self.save(Position(epoch + 1, global_step=self.loop.global_step), at_epoch_end=True)
        if self.ctx.rank == 0:
            spec.data.store.write_bytes_atomic(spec.run.progress, json.dumps(progress_rows(self.history, self.seconds))
                                               .encode())
            if spec.verbose:
                log.info("epoch %d/%d %s", epoch + 1, spec.epochs, format_metrics(row))

    def stop_reason(self, epoch: int) -> Optional[str]:
        """Why no epoch follows `epoch` finished ones (early stopping), said once by rank 0; the same on every
        rank: the rows are reduced."""
        stop = self.spec.monitor.stop_reason(self.history)
        if stop is not None and self.ctx.rank == 0:
            log.info("stopping early after epoch %d: %s", epoch, stop)
        return stop

    def open_decoders(self, training: bool) -> Decoders:
        reader, fn, data = self.spec.reader, self.objs.transformation_fn, self.spec.data
        tokenize = batch_tokenizer(self.objs.tokenizer, data, stored_reference(data))
        gpu = self.device.type == "cuda"
        workers, pool = decoding(reader.train_workers if training else reader.val_workers,
                                 reader.pool_type if reader.kind == "arrow" else "thread",  # petastorm: its readers'
                                 fn is not None, tokenize is not None, gpu, rank_cores(gpu, torch.get_num_threads()))
        return Decoders(fn, workers, pool, reader.mp_start_method, name=f"decode-rank-{self.ctx.rank}",
                        tokenize=tokenize)

    def feed(self, batches: Iterator[Any], training: bool, drop_repeats: bool = False) -> Feed:
        check = self.objective.host_check() if self.objective is not None else None
        return Feed(batches, self.spec.data, self.decoders[training], pin=self.device.type == "cuda",
                    name=f"feed-rank-{self.ctx.rank}", check=check, drop_repeats=drop_repeats)

    def uneven(self, train: Shard, remainder: Optional[Remainder]) -> bool:
        """Whether any rank's batches this epoch leave out a row drawn again (estimator.data.repeats), so that
        the ranks' batches may differ in rows: one all_reduce an epoch, the same answer on every rank."""
        if self.ctx.world_size == 1:
            return False
        if remainder is not None:
            mine = remainder.repeats
        else:
            mine = leaves_out(self.spec) and train.plan().items > train.rows
        flag = torch.tensor([float(mine)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def checkpoint_inside(self, epoch: int, step: int, sums: torch.Tensor) -> None:
        """Every rank calls this at the same optimizer step: the sums so far are reduced (a collective), and
        rank 0 writes them with the position, so a resumed epoch reports what an uninterrupted one would."""
        if self.in_remainder:  # a position inside the rest of an epoch is not one of this layout's epochs
            return
        reduced = self.objective.layout.named(reduce_sums(sums.clone()))
        self.loop.finite.check_weights(self.model, epoch, step)
        self.save(Position(epoch, step, reduced, self.loop.global_step, self.layout()))

    def layout(self) -> List[int]:
        """What a position inside an epoch counts batches of: batch size, ranks, whether the ranks read in
        memory or streamed (their orders differ), whether estimator.data.remainder can replay the order, the
        epoch's batches when train_steps_per_epoch sets them (0: whole passes), and the window of balanced batches
        (estimator.data.balance; 0: none)."""
        spec = self.spec
        return [spec.batch_size, self.ctx.world_size, int(self.cached), int(known_order(spec)),
                spec.train_steps_per_epoch or 0, WINDOW if self.balanced else 0]

    def save(self, position: Position, at_epoch_end: bool = False) -> None:
        """The run's checkpoint, on the ranks that write it (the strategy says: rank 0, or every rank its shards
        then rank 0 the file); which copies it keeps is the retention's (estimator.train.retention)."""
        if not self.strategy.writes_checkpoints():
            return
        spec, rank0 = self.spec, self.ctx.rank == 0
        parts = self.strategy.model_state(self.model, self.optimizer, CheckpointAt(
            spec.data.store, spec.run, spec.launch_id, self.attempt, position.global_step, self.writer))
        state = checkpoint_file(parts.entries, self.history, position, self.rank.schedule.scheduler,
                                self.loop.scaler, self.extra_state, copy=self.writer.background) if rank0 else None
        kept = self.retention.plan(self.history, at_epoch_end) if rank0 else None

        def write() -> None:  # in the writer's thread: reads only `state`, `parts` and `kept`
            inject(self.faults, "checkpoint_write", self.ctx.rank, self.attempt, position.epochs, position.global_step)
            parts.write()
            if kept is not None:
                write_checkpoint(spec.data.store, state, kept.targets)
                self.retention.apply(kept, self.strategy, parts.folder)

        self.writer.submit(describe(position), write)


def same_layout(checkpoint: List[int], run: List[int]) -> bool:
    """A position inside an epoch counts this run's batches (a checkpoint that recorded less, [batch_size, ranks]
    before the reader was recorded, is taken at its word; one of 5 had no balanced window)."""
    checkpoint = list(checkpoint) + [0] if len(checkpoint) == 5 else checkpoint
    return checkpoint[:2] == run[:2] and all(a == b for a, b in zip(checkpoint[2:], run[2:]))


def optimizer_steps(optimizer: torch.optim.Optimizer) -> int:
    """Steps taken, where the optimizer counts them (Adam, AdamW, ...); 0 otherwise."""
    steps = [s.get("step") for s in optimizer.state.values() if "step" in s]
    return int(max(float(s) for s in steps)) if steps else 0


def step_scheduler(scheduler: Any, row: Dict[str, float], monitor: Optional[str] = None) -> None:
    """Once per epoch, on every rank alike (the row's metrics are already reduced over all ranks). A
    ReduceLROnPlateau steps on `monitor`, by default val_loss where there is one, else loss."""
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        scheduler.step(row[monitor] if monitor else row.get("val_loss", row["loss"]))
    else:
        scheduler.step()


def progress_rows(history: Sequence[Dict[str, float]], seconds: Dict[int, float]) -> List[Dict[str, float]]:
    """The progress file's rows: the history's, each epoch this launch ran with its seconds under
    PROGRESS_SECONDS (the driver's epoch line tells them; they are not part of the history)."""
    return [dict(row, **{PROGRESS_SECONDS: seconds[i]}) if i in seconds else dict(row) for i, row in enumerate(history)]


def format_metrics(row: Dict[str, float]) -> str:
    return " ".join(f"{k}={v:.4f}" for k, v in row.items() if k != "epoch")


def call_callbacks(callbacks: Sequence[Any], method: str, *args: Any) -> None:
    for callback in callbacks:
        hook = getattr(callback, method, None)
        if hook is not None:
            hook(*args)
