"""The per-rank training loop: `train_worker(spec, ctx)`. torch only, no pyspark.

It runs the same inside a Spark barrier task and in a local process (tests, LocalLauncher).
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import threading
import time
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import cloudpickle
import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from estimator.data import ShardBatches, plan_steps, read_rows, reshape, shard_range, torch_dtype_array
from estimator.distributed import RankContext
from estimator.faults import Fault, inject
from estimator.host_allreduce import HostAllreduce
from estimator.losses import Objective
from estimator.pickling import rebuild_optimizer
from estimator.spec import DataSpec, Piece, TrainSpec, UserObjects, WorkerResult, total_rows

log = logging.getLogger("estimator")
CHECKPOINT_FORMAT = 1
Batch = Dict[str, np.ndarray]


def train_worker(spec: TrainSpec, ctx: RankContext, faults: Tuple[Fault, ...] = (), attempt: int = 0,
                 early: Optional["EarlyRead"] = None) -> WorkerResult:
    """Train this rank; `early` holds its shards when the launcher started reading them already."""
    started = time.perf_counter()
    objs: UserObjects = cloudpickle.loads(spec.payload)
    device = torch.device(ctx.device)
    model = objs.model.to(device)
    optimizer = build_optimizer(objs, model)
    scheduler = objs.lr_scheduler_fn(optimizer) if objs.lr_scheduler_fn is not None else None
    history: List[Dict[str, float]] = []
    global_step = 0
    if spec.resume_from:  # a retry or a refit of this run_id: continue after the last finished epoch
        state = load_checkpoint(spec.data.store, spec.resume_from, device)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])  # after the scheduler's constructor reset the lr
        if scheduler is not None and state.get("lr_scheduler") is not None:
            scheduler.load_state_dict(state["lr_scheduler"])
        history = [dict(row) for row in state["history"]]
        global_step = int(state.get("global_step", 0))
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
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
        return _train(spec, ctx, objs, model, ddp, optimizer, scheduler, history, global_step, started,
                      allreduce, faults, attempt, early)
    except BaseException:
        if comm is not None:
            comm.abort()  # the peers stop waiting for this rank in the next allreduce
        raise
    finally:
        if comm is not None:
            comm.close()


def gradient_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def _train(spec: TrainSpec, ctx: RankContext, objs: UserObjects, model: nn.Module, ddp: nn.Module,
           optimizer: torch.optim.Optimizer, scheduler: Any, history: List[Dict[str, float]], global_step: int,
           started: float, allreduce: str, faults: Tuple[Fault, ...], attempt: int,
           early: Optional["EarlyRead"]) -> WorkerResult:
    device = torch.device(ctx.device)
    objective = Objective(objs.build_losses(), objs.loss_weights, objs.metrics, spec.data.label_cols,
                          weighted=spec.data.sample_weight_col is not None)
    opening = time.perf_counter()
    train, val = early.result(ctx) if early is not None else open_readers(spec, ctx)
    waited = time.perf_counter() - opening
    loop = TrainLoop(spec, ctx, ddp, optimizer, objective, objs.transformation_fn)
    loop.global_step = global_step
    callbacks = objs.callbacks if ctx.rank == 0 else []
    _call(callbacks, "on_train_begin", {})
    try:
        for epoch in range(len(history), spec.epochs):
            # Each epoch's randomness (dropout; the shuffle is seeded the same way) depends only on
            # (seed, epoch, rank): an epoch repeated after a failure is the epoch an uninterrupted run had.
            torch.manual_seed(int(np.random.SeedSequence([spec.seed, epoch, ctx.rank]).generate_state(1)[0]))
            inject(faults, "epoch", ctx.rank, attempt, epoch + 1)
            sums = loop.train_epoch(epoch, train.epoch(epoch))
            if val is not None:
                sums = torch.cat([sums, loop.evaluate(model, val.epoch(epoch))])
            row = {"epoch": float(epoch + 1), **objective.summarize(reduce_sums(sums), with_val=val is not None)}
            history.append(row)
            if scheduler is not None:
                step_scheduler(scheduler, row)
            if ctx.rank == 0:
                save_checkpoint(spec, model, optimizer, epoch + 1, history, loop.global_step, scheduler)
                spec.data.store.write_bytes_atomic(spec.run.progress, json.dumps(history).encode())
                if spec.verbose:
                    log.info("epoch %d/%d %s", epoch + 1, spec.epochs, format_metrics(row))
            _call(callbacks, "on_epoch_end", epoch, dict(row))
    finally:
        train.close()
        if val is not None:
            val.close()
    _call(callbacks, "on_train_end", {"history": history})
    del ddp, loop  # the caller's teardown needs DDP gone before destroy_process_group
    return WorkerResult(ctx.rank, tuple(history), str(device), train.rows, time.perf_counter() - started,
                        reader=train.describe() + (f"; val {val.describe()}" if val is not None else ""),
                        optimizer_steps=optimizer_steps(optimizer), assigned_gpu=ctx.assigned_gpu,
                        allreduce=allreduce, read_seconds=early.seconds if early is not None else waited,
                        read_wait_seconds=waited)


class TrainLoop:
    """One epoch of training or validation over batches, with accumulation and NaN checks."""

    def __init__(self, spec: TrainSpec, ctx: RankContext, ddp: nn.Module, optimizer: torch.optim.Optimizer,
                 objective: Objective, transformation_fn: Any):
        self.spec, self.ctx, self.ddp, self.optimizer = spec, ctx, ddp, optimizer
        self.objective, self.transformation_fn = objective, transformation_fn
        self.device = torch.device(ctx.device)
        self.global_step = 0  # optimizer steps over the whole run (carried over a resume)

    def train_epoch(self, epoch: int, batches: Iterable[Batch]) -> torch.Tensor:
        self.ddp.train()
        every = self.spec.backward_passes_per_step
        sums = torch.zeros(self.objective.width, dtype=torch.float64, device=self.device)
        self.optimizer.zero_grad(set_to_none=True)
        for step, (batch, last) in enumerate(with_last(batches)):
            features, labels, weights = self.tensors(batch)
            stepping = (step + 1) % every == 0 or last  # a partial accumulation still steps at epoch end
            with contextlib.nullcontext() if stepping else self.ddp.no_sync():  # no allreduce while accumulating
                loss, batch_sums = self.objective(as_tuple(self.ddp(*features)), labels, weights)
                self.check_finite(loss, epoch, step)
                (loss / every if every > 1 else loss).backward()
            if stepping:
                self.optimizer.step()
                self.global_step += 1
                self.optimizer.zero_grad(set_to_none=True)
            sums += batch_sums
        return sums

    def evaluate(self, model: nn.Module, batches: Iterable[Batch]) -> torch.Tensor:
        """Exact validation over this rank's batches. Runs the plain module, not DDP: ranks may have
        different numbers of validation batches, and no collective may run per batch."""
        model.eval()
        sums = torch.zeros(self.objective.width, dtype=torch.float64, device=self.device)
        with torch.no_grad():
            for batch in batches:
                features, labels, weights = self.tensors(batch)
                sums += self.objective(as_tuple(model(*features)), labels, weights)[1]
        return sums

    def tensors(self, batch: Batch):
        if self.transformation_fn is not None:
            batch = transform_batch(self.transformation_fn, batch)
        return to_tensors(batch, self.spec.data, self.device)

    def check_finite(self, loss: torch.Tensor, epoch: int, step: int) -> None:
        if self.spec.terminate_on_nan and not torch.isfinite(loss.detach()).all():
            raise FloatingPointError(f"Loss is {loss.item()} at epoch {epoch + 1}, step {step + 1} on rank "
                                     f"{self.ctx.rank}; stopping because terminate_on_nan=True.")


class ArrowShard:
    """A rank's shard read with pyarrow.dataset and kept in memory (see estimator.data)."""

    def __init__(self, spec: TrainSpec, pieces: Sequence[Piece], rank: int, world_size: int, training: bool):
        start, stop = shard_range(total_rows(pieces), rank, world_size)
        self.shard = ShardBatches(prepare_arrays(spec.data, read_rows(spec.data.store, pieces, start, stop,
                                                                      spec.data.columns)), stop - start)
        self.rows, self.spec, self.rank, self.world_size, self.training = stop - start, spec, rank, world_size, training
        self.total = total_rows(pieces)

    def epoch(self, epoch: int) -> Iterator[Batch]:
        spec = self.spec
        if self.training:
            steps, items = plan_steps(self.total, self.world_size, spec.batch_size, spec.train_steps_per_epoch)
            seed = np.random.SeedSequence([spec.seed, epoch, self.rank]).entropy
            return self.shard.epoch(spec.batch_size, steps, items, spec.shuffle, seed)
        steps = math.ceil(self.rows / spec.val_batch_size)
        if spec.validation_steps_per_epoch is not None:
            steps = min(steps, spec.validation_steps_per_epoch)
        return self.shard.epoch(spec.val_batch_size, steps, min(self.rows, steps * spec.val_batch_size), False, 0)

    def describe(self) -> str:
        return "arrow"

    def close(self) -> None:
        pass


def open_readers(spec: TrainSpec, ctx: RankContext) -> Tuple[Any, Optional[Any]]:
    if spec.reader.kind == "petastorm":
        from estimator.data_petastorm import PetastormShard

        train = PetastormShard(spec, spec.data.train, ctx, training=True)
        return train, PetastormShard(spec, spec.data.val, ctx, training=False) if spec.data.val else None
    return read_arrow_shards(spec, ctx.rank, ctx.world_size)


def read_arrow_shards(spec: TrainSpec, rank: int, world_size: int) -> Tuple[ArrowShard, Optional[ArrowShard]]:
    return ArrowShard(spec, spec.data.train, rank, world_size, True), (
        ArrowShard(spec, spec.data.val, rank, world_size, False) if spec.data.val else None)


class EarlyRead:
    """This rank's Arrow shards, read on a thread while the rendezvous waits for the peers.

    A rank knows its rank and the world size before Spark's barrier (partition id, task count), so the
    read can overlap the barrier's polling (about a second) instead of following it. The launcher
    calls `begin()` once its own warm-up is done: both need the CPU (a rank usually has one core).
    `result()` begins the read if nobody did. An error in the read is raised where the read used to
    happen: by `train_worker` on that rank, after the rendezvous.
    """

    def __init__(self, spec: TrainSpec, rank: int, world_size: int, faults: Tuple[Fault, ...] = (), attempt: int = 0):
        self.rank, self.world_size = rank, world_size
        self.seconds = 0.0  # the read itself
        self._box: Dict[str, Any] = {}
        self._thread = threading.Thread(target=self._read, args=(spec, faults, attempt), daemon=True,
                                        name=f"shard-read-rank-{rank}")

    def begin(self) -> None:
        if self._thread.ident is None:
            self._thread.start()

    def _read(self, spec: TrainSpec, faults: Tuple[Fault, ...], attempt: int) -> None:
        started = time.perf_counter()
        try:
            inject(faults, "read", self.rank, attempt)
            self._box["shards"] = read_arrow_shards(spec, self.rank, self.world_size)
        except BaseException as exc:  # noqa: BLE001 - raised again by result(), on the training thread
            self._box["error"] = exc
        self.seconds = time.perf_counter() - started

    def result(self, ctx: RankContext) -> Tuple[ArrowShard, Optional[ArrowShard]]:
        if (ctx.rank, ctx.world_size) != (self.rank, self.world_size):
            raise RuntimeError(f"shards read early for rank {self.rank} of {self.world_size}, "
                               f"but this is rank {ctx.rank} of {ctx.world_size}")
        self.begin()
        self._thread.join()
        box, self._box = self._box, {}  # the arrays belong to the readers from here on
        if "error" in box:
            raise box["error"]
        return box["shards"]

    @classmethod
    def for_spec(cls, spec: TrainSpec, rank: int, world_size: int, faults: Tuple[Fault, ...] = (),
                 attempt: int = 0) -> Optional["EarlyRead"]:
        """An early read for the Arrow reader; petastorm opens its own reader threads at training time."""
        return cls(spec, rank, world_size, faults, attempt) if spec.reader.kind != "petastorm" else None


def build_optimizer(objs: UserObjects, model: nn.Module) -> torch.optim.Optimizer:
    """The user's optimizer rebuilt over this rank's model: same class, groups, hyperparams, state."""
    return rebuild_optimizer(objs.optimizer_cls, objs.optimizer_groups, objs.optimizer_defaults,
                             objs.optimizer_state, model)


def optimizer_steps(optimizer: torch.optim.Optimizer) -> int:
    """Steps taken, where the optimizer counts them (Adam, AdamW, ...); 0 otherwise."""
    steps = [s.get("step") for s in optimizer.state.values() if "step" in s]
    return int(max(float(s) for s in steps)) if steps else 0


def prepare_arrays(data: DataSpec, arrays: Dict[str, np.ndarray]) -> Batch:
    """torch-friendly dtypes, writable and contiguous (Arrow hands out read-only buffers); once per shard."""
    out = {c: torch_dtype_array(arrays[c]) for c in data.feature_cols + data.label_cols}
    if data.sample_weight_col:
        out[data.sample_weight_col] = arrays[data.sample_weight_col].astype(np.float32)
    return {k: np.require(v, requirements=["C", "W"]) for k, v in out.items()}


def transform_batch(fn: Any, batch: Batch) -> Batch:
    """Apply the user's transformation_fn to a batch as a pandas DataFrame (one row per sample;
    array columns hold one numpy array per row, as petastorm gives them)."""
    import pandas as pd

    frame = pd.DataFrame({k: list(v) if v.ndim > 1 else v for k, v in batch.items()})
    frame = fn(frame)
    out = {}
    for k in batch:
        column = frame[k].to_numpy()
        values = np.stack(column) if column.dtype == object else column
        out[k] = np.require(torch_dtype_array(values), requirements=["C", "W"])
    return out


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


def to_tensors(batch: Batch, data: DataSpec, device: torch.device
               ) -> Tuple[List[torch.Tensor], List[torch.Tensor], Optional[torch.Tensor]]:
    def t(name: str, shape: Optional[Sequence[int]]) -> torch.Tensor:
        values = reshape(batch[name], shape, name)
        return torch.from_numpy(np.ascontiguousarray(values)).to(device, non_blocking=True)

    features = [t(c, data.input_shapes[i] if data.input_shapes else None) for i, c in enumerate(data.feature_cols)]
    labels = [t(c, data.label_shapes[i] if data.label_shapes else None) for i, c in enumerate(data.label_cols)]
    weights = t(data.sample_weight_col, None) if data.sample_weight_col else None
    return features, labels, weights


def reduce_sums(sums: torch.Tensor) -> List[float]:
    """One all_reduce per epoch: every rank's (loss * rows, rows, metric * rows, ...) summed."""
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    return sums.cpu().tolist()


def as_tuple(outputs: Any) -> Tuple[torch.Tensor, ...]:
    return tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)


def save_checkpoint(spec: TrainSpec, model: nn.Module, optimizer: torch.optim.Optimizer, epoch: int,
                    history: List[Dict[str, float]], global_step: int, scheduler: Any = None) -> None:
    """Everything a resumed run needs, written atomically (a reader never sees half a checkpoint)."""
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch,
                "global_step": global_step, "history": history,
                "lr_scheduler": scheduler.state_dict() if scheduler is not None else None,
                "rng": {"torch": torch.get_rng_state(), "numpy_seed": [spec.seed, epoch]},
                "format": CHECKPOINT_FORMAT}, buffer)
    spec.data.store.write_bytes_atomic(spec.run.checkpoint, buffer.getvalue())


def step_scheduler(scheduler: Any, row: Dict[str, float]) -> None:
    """Once per epoch, on every rank alike (the row's metrics are already reduced over all ranks)."""
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        scheduler.step(row.get("val_loss", row["loss"]))
    else:
        scheduler.step()


def load_checkpoint(store: Any, path: str, device: Any = "cpu") -> Dict[str, Any]:
    """A checkpoint's tensors and plain values only (weights_only=True: no code is unpickled)."""
    return torch.load(io.BytesIO(store.read_bytes(path)), map_location=device, weights_only=True)


def format_metrics(row: Dict[str, float]) -> str:
    return " ".join(f"{k}={v:.4f}" for k, v in row.items() if k != "epoch")


def _call(callbacks: Sequence[Any], method: str, *args: Any) -> None:
    for callback in callbacks:
        hook = getattr(callback, method, None)
        if hook is not None:
            hook(*args)
