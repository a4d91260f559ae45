"""One rank's epochs: training and validation over its shards, the history row reduced over all ranks,
the learning-rate schedule, TensorBoard, the callbacks and rank 0's checkpoints (the last, and the best
epochs'). The step-level loop is estimator.train.loop's. torch only, no pyspark."""
from __future__ import annotations

import functools
import json
import logging
import posixpath
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from estimator.core.faults import Fault, inject
from estimator.core.spec import TrainSpec, UserObjects, WorkerResult
from estimator.data.cached import CachedShard
from estimator.data.feed import Decoders, Feed, decoding, rank_cores
from estimator.data.remainder import Remainder, known_order, remainder_for
from estimator.data.shards import EarlyRead, Shard, open_shards
from estimator.data.lm import batch_tokenizer
from estimator.train.checkpoint import (CheckpointWriter, Position, checkpoint_state, describe, load_checkpoint,
                                        write_checkpoint)
from estimator.train.distributed import RankContext
from estimator.train.lightning import LightningObjective
from estimator.train.loop import TrainLoop, reduce_sums
from estimator.train.losses import Objective
from estimator.train.objectives import TokenObjective
from estimator.train.sharded_checkpoint import SHARDED, remove_unused, save_shards
from estimator.train.sharded_checkpoint import folder as sharded_folder
from estimator.train.sharding import local_bytes
from estimator.train.steps import StepObjective
from estimator.train.tensorboard import TensorBoardLog

log = logging.getLogger("estimator")
PROGRESS_SECONDS = "_epoch_seconds"  # a progress row's key for the epoch's seconds; not a history key


class Run:
    """One rank's epochs: training, validation, the reduced history row, checkpoints."""

    def __init__(self, spec: TrainSpec, ctx: RankContext, objs: UserObjects, model: nn.Module, ddp: nn.Module,
                 optimizer: torch.optim.Optimizer, scheduler: Any, history: List[Dict[str, float]],
                 faults: Tuple[Fault, ...], attempt: int, trainer: Any = None):
        self.spec, self.ctx, self.objs, self.model, self.ddp = spec, ctx, objs, model, ddp
        self.optimizer, self.scheduler, self.history = optimizer, scheduler, history
        self.device = torch.device(ctx.device)
        self.objective = (None if objs.train_fn is not None  # train_fn computes its own loss
                          else StepObjective(objs.train_step, spec.step_metrics, spec.data) if objs.train_step is not None
                          else LightningObjective(model, spec.step_metrics, spec.val_metrics, trainer) if objs.lightning
                          else TokenObjective() if spec.data.lm is not None  # a causal LM's fine-tuning
                          else Objective(objs.build_losses(), objs.loss_weights, objs.metrics, spec.data.label_cols,
                                         weighted=spec.data.sample_weight_col is not None))
        self.loop = TrainLoop(spec, ctx, ddp, optimizer, self.objective, faults, attempt, self.checkpoint_inside)
        self.faults, self.attempt = faults, attempt
        self.waited = self.looped = 0.0
        self.seconds: Dict[int, float] = {}  # rank 0's wall seconds of each epoch this launch ran (the epoch line's)
        self.tensorboard: Optional[TensorBoardLog] = None
        self.extra_state: Dict[str, Any] = {}  # train_fn's own stateful objects, checkpointed by name (ctx.keep)
        self.restored_extra: Dict[str, Any] = {}  # their states in the checkpoint this run resumes from
        self.scheduler_monitor: Optional[str] = None  # the history key a ReduceLROnPlateau steps on
        self.scheduler_interval = "epoch"  # 'step': the loop steps it after every optimizer step (after_step)
        self.cached, self.in_remainder = False, False  # the training shard is in memory; training the rest of an epoch
        self.remainder: Optional[Remainder] = None  # the rest of the epoch the checkpoint stands in, other layout
        self.writer = CheckpointWriter(spec.checkpoint_async)  # rank 0's checkpoint writes (fsdp: every rank's)
        self.shard_group: Any = None  # strategy='fsdp': the gloo group DCP writes the shards over (worker)

    def train(self, position: Position, started: float, allreduce: str, early: Optional[EarlyRead]) -> WorkerResult:
        spec, ctx = self.spec, self.ctx
        opening = time.perf_counter()
        train, val = (early.result(ctx.rank, ctx.world_size) if early is not None
                      else open_shards(spec, ctx.rank, ctx.world_size))
        read_wait = time.perf_counter() - opening
        self.loop.global_step = position.global_step
        self.cached = isinstance(train, CachedShard)
        if position.step and not same_layout(position.layout, self.layout()):
            self.remainder = remainder_for(spec, train, position.epochs, position.layout, ctx.rank, ctx.world_size,
                                           position.step)
            if self.remainder is None:
                log.warning("rank %d: the checkpoint stands at batch %d of epoch %d with layout %s (batch_size, ranks, "
                            "in memory, order known, train_steps_per_epoch); this run has %s and the rows done "
                            "cannot be known, so the epoch starts over from its first batch", ctx.rank,
                            position.step, position.epochs + 1, position.layout, self.layout())
                position = Position(position.epochs, global_step=position.global_step)
        callbacks = self.objs.callbacks if ctx.rank == 0 else []
        self.tensorboard = (TensorBoardLog.open(spec.data.store, spec.run.logs, spec.log_every_n_steps, spec.launch_id)
                            if spec.tensorboard and ctx.rank == 0 else None)
        if self.tensorboard is not None:
            self.loop.on_step = self.tensorboard.step
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
        del self.ddp, self.loop  # the caller's teardown needs DDP gone before destroy_process_group
        reader = train.describe() + (f"; val {val.describe()}" if val is not None else "")
        return WorkerResult(ctx.rank, tuple(self.history), str(self.device), train.rows,
                            time.perf_counter() - started, reader=reader,
                            optimizer_steps=optimizer_steps(self.optimizer), assigned_gpu=ctx.assigned_gpu,
                            allreduce=allreduce, read_seconds=early.seconds if early is not None else read_wait,
                            read_wait_seconds=read_wait, data_wait_seconds=self.waited,
                            train_loop_seconds=self.looped, checkpoint_wait_seconds=self.writer.stalled,
                            state_bytes=local_bytes(self.model, self.optimizer))

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
            self.loop.steps_report.begin(remainder.steps if remainder else train.plan().steps,
                                         float(sum(inside.sums[2:3])) if inside.sums else 0.0)
        feed = self.feed(remainder.batches(self.spec, train) if remainder else train.epoch(epoch, inside.step), True)
        self.in_remainder = remainder is not None
        try:
            sums = self.loop.train_epoch(epoch, iter(feed), inside)
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
        row = {"epoch": float(epoch + 1),
               **self.objective.summarize(reduced[:-2], with_val=val is not None),
               "data_wait": reduced[-2] / max(reduced[-1], 1e-9)}  # of the ranks' training time, all ranks
        # rows/s: every rank's rows over the ranks' mean epoch time
        self.record(epoch, row, float(reduced[2]) / max(float(reduced[-1]) / ctx.world_size, 1e-9),
                    time.perf_counter() - began)

    def record(self, epoch: int, row: Dict[str, float], rows_per_second: float, seconds: float) -> None:
        """An epoch's history row (the same on every rank): NaN checks, TensorBoard, the learning-rate schedule,
        rank 0's checkpoint (and the best epochs') and the progress the driver shows. `seconds`: the epoch's
        training and validation on this rank, told in the driver's epoch line (not a history key)."""
        spec = self.spec
        self.history.append(row)
        self.seconds[epoch] = seconds
        self.loop.finite.check_epoch(self.model, row, epoch)  # before these weights are checkpointed
        if self.tensorboard is not None:
            self.tensorboard.epoch(epoch + 1, row, float(self.optimizer.param_groups[0]["lr"]), rows_per_second)
        if self.scheduler is not None and self.scheduler_interval == "epoch":
            step_scheduler(self.scheduler, row, self.scheduler_monitor)
        if self.ctx.rank == 0 or self.shard_group is not None:  # fsdp: every rank writes its shards
            self.save(Position(epoch + 1, global_step=self.loop.global_step), best=True)
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
        tokenize = batch_tokenizer(self.objs.tokenizer, data)
        gpu = self.device.type == "cuda"
        workers, pool = decoding(reader.train_workers if training else reader.val_workers,
                                 reader.pool_type if reader.kind == "arrow" else "thread",  # petastorm: its readers'
                                 fn is not None, tokenize is not None, gpu, rank_cores(gpu, torch.get_num_threads()))
        return Decoders(fn, workers, pool, reader.mp_start_method, name=f"decode-rank-{self.ctx.rank}",
                        tokenize=tokenize)

    def feed(self, batches: Iterator[Any], training: bool) -> Feed:
        return Feed(batches, self.spec.data, self.decoders[training], pin=self.device.type == "cuda",
                    name=f"feed-rank-{self.ctx.rank}")

    def checkpoint_inside(self, epoch: int, step: int, sums: torch.Tensor) -> None:
        """Every rank calls this at the same optimizer step: the sums so far are reduced (a collective), and
        rank 0 writes them with the position, so a resumed epoch reports what an uninterrupted one would."""
        if self.in_remainder:  # a position inside the rest of an epoch is not one of this layout's epochs
            return
        reduced = reduce_sums(sums.clone())
        self.loop.finite.check_weights(self.model, epoch, step)
        if self.ctx.rank == 0 or self.shard_group is not None:
            self.save(Position(epoch, step, reduced, self.loop.global_step, self.layout()))

    def layout(self) -> List[int]:
        """What a position inside an epoch counts batches of: batch size, ranks, whether the ranks read in
        memory or streamed (their orders differ), whether estimator.data.remainder can replay the order, and the
        epoch's batches when train_steps_per_epoch sets them (0: whole passes)."""
        spec = self.spec
        return [spec.batch_size, self.ctx.world_size, int(self.cached), int(known_order(spec)),
                spec.train_steps_per_epoch or 0]

    def save(self, position: Position, best: bool = False) -> None:
        """The run's checkpoint; at an epoch's end (`best`), also this epoch's own copy when it is among the
        save_top_k best by the monitor, and the copies of epochs that left the top k are removed. With fsdp every
        rank calls this: each writes its shards (estimator.train.sharded_checkpoint), then rank 0 the file."""
        spec, store, rank0 = self.spec, self.spec.data.store, self.ctx.rank == 0
        top = spec.monitor.top_k(self.history, spec.save_top_k) if best else []
        epoch = len(self.history)
        tag = f"step-{position.global_step}-{spec.launch_id}-{self.attempt}" if self.shard_group is not None else None
        pending = None
        if tag is not None and self.writer.background:
            self.writer.wait()  # one DCP write at a time over the group
            pending = save_shards(store, sharded_folder(spec.run, tag), self.model, self.optimizer, self.shard_group,
                                  background=True)  # the shards copied to the CPU here, written by DCP's thread
        state = checkpoint_state(self.model, self.optimizer, self.history, position, self.scheduler, self.loop.scaler,
                                 self.extra_state, copy=self.writer.background, sharded=tag) if rank0 else None
        targets = [spec.run.checkpoint] + ([spec.run.best(epoch)] if epoch in top else [])
        keep = {posixpath.basename(spec.run.best(e)) for e in top}

        def write() -> None:  # in the writer's thread: reads only `state` and these names
            inject(self.faults, "checkpoint_write", self.ctx.rank, self.attempt, position.epochs, position.global_step)
            if pending is not None:
                pending.result()  # every rank's shards and the folder's metadata are written
            elif tag is not None:
                save_shards(store, sharded_folder(spec.run, tag), self.model, self.optimizer, self.shard_group,
                            background=False)
            if not rank0:
                return
            write_checkpoint(store, state, targets)
            if best:
                for path in store.ls(spec.run.best_dir) if store.exists(spec.run.best_dir) else []:
                    if posixpath.basename(path) not in keep:
                        store.rm(path)
            if tag is not None:  # the folders no checkpoint names any more
                kept = store.ls(spec.run.best_dir) if store.exists(spec.run.best_dir) else []
                remove_unused(store, spec.run, {tag, *(load_checkpoint(store, p).get(SHARDED) for p in kept)})

        self.writer.submit(describe(position), write)


def same_layout(checkpoint: List[int], run: List[int]) -> bool:
    """A position inside an epoch counts this run's batches (a checkpoint that recorded less, [batch_size, ranks]
    before the reader was recorded, is taken at its word)."""
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
