"""The per-rank training loop: `train_worker(spec, ctx)`. torch only, no pyspark.

It runs the same inside a Spark barrier task and in a local process (tests, LocalLauncher).
"""
from __future__ import annotations

import io
import logging
import time
from typing import Dict, List, Sequence, Tuple

import cloudpickle
import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from estimator.data import ShardBatches, plan_steps, read_rows, reshape, shard_range, torch_dtype_array
from estimator.distributed import RankContext
from estimator.losses import Objective
from estimator.spec import DataSpec, Piece, TrainSpec, UserObjects, WorkerResult, total_rows
from store import RunLayout

log = logging.getLogger("estimator")


def train_worker(spec: TrainSpec, ctx: RankContext) -> WorkerResult:
    started = time.perf_counter()
    torch.manual_seed(spec.seed + ctx.rank)  # dropout differs per rank; weights come from rank 0
    objs: UserObjects = cloudpickle.loads(spec.payload)
    device = torch.device(ctx.device)
    model = objs.model.to(device)
    optimizer = build_optimizer(objs, model)
    objective = Objective(objs.losses, objs.loss_weights, objs.metrics, spec.data.label_cols,
                          weighted=spec.data.sample_weight_col is not None)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    train = load_shard(spec.data, spec.data.train, ctx)
    val = load_shard(spec.data, spec.data.val, ctx) if spec.data.val else None
    steps, items = plan_steps(spec.data.train_rows, ctx.world_size, spec.batch_size, spec.train_steps_per_epoch)
    history: List[Dict[str, float]] = []
    for epoch in range(spec.epochs):
        seed = [spec.seed, epoch, ctx.rank]
        batches = train.epoch(spec.batch_size, steps, items, spec.shuffle, np.random.SeedSequence(seed).entropy)
        sums = train_epoch(ddp, optimizer, objective, batches, spec.data, device)
        if val is not None:
            sums = torch.cat([sums, evaluate(model, objective, val, spec, device)])
        row = {"epoch": float(epoch + 1), **objective.summarize(reduce_sums(sums), with_val=val is not None)}
        history.append(row)
        if ctx.rank == 0:
            save_checkpoint(spec, model, optimizer, epoch + 1, history)
            if spec.verbose:
                log.info("epoch %d/%d %s", epoch + 1, spec.epochs, _format(row))
    del ddp  # the caller's teardown needs DDP gone before destroy_process_group
    return WorkerResult(ctx.rank, tuple(history), str(device), train.rows, time.perf_counter() - started)


def build_optimizer(objs: UserObjects, model: nn.Module) -> torch.optim.Optimizer:
    """The user's optimizer rebuilt over this rank's model: same class, groups, hyperparams, state."""
    params = list(model.parameters())
    groups = [{"params": [params[i] for i in indices]} for indices in objs.optimizer_groups]
    optimizer = objs.optimizer_cls(groups, **objs.optimizer_defaults)
    optimizer.load_state_dict(objs.optimizer_state)
    return optimizer


def load_shard(data: DataSpec, pieces: Sequence[Piece], ctx: RankContext) -> ShardBatches:
    total = total_rows(pieces)
    start, stop = shard_range(total, ctx.rank, ctx.world_size)
    arrays = read_rows(data.store, pieces, start, stop, data.columns)
    return ShardBatches(prepare_arrays(data, arrays), stop - start)


def prepare_arrays(data: DataSpec, arrays: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """Cast to torch-friendly dtypes and reshape to input/label shapes, once per shard."""
    out = {}
    for i, col in enumerate(data.feature_cols):
        shape = data.input_shapes[i] if data.input_shapes else None
        out[col] = reshape(torch_dtype_array(arrays[col]), shape, col)
    for i, col in enumerate(data.label_cols):
        shape = data.label_shapes[i] if data.label_shapes else None
        out[col] = reshape(torch_dtype_array(arrays[col]), shape, col)
    if data.sample_weight_col:
        out[data.sample_weight_col] = arrays[data.sample_weight_col].astype(np.float32)
    # Arrow hands out read-only buffers; torch wants writable, contiguous ones (copied once here).
    return {k: np.require(v, requirements=["C", "W"]) for k, v in out.items()}


def to_tensors(batch: Dict[str, np.ndarray], data: DataSpec, device: torch.device
               ) -> Tuple[List[torch.Tensor], List[torch.Tensor], "torch.Tensor | None"]:
    def t(name: str) -> torch.Tensor:
        return torch.from_numpy(batch[name]).to(device, non_blocking=True)

    weights = t(data.sample_weight_col) if data.sample_weight_col else None
    return [t(c) for c in data.feature_cols], [t(c) for c in data.label_cols], weights


def train_epoch(ddp: nn.Module, optimizer: torch.optim.Optimizer, objective: Objective, batches,
                data: DataSpec, device: torch.device) -> torch.Tensor:
    ddp.train()
    sums = torch.zeros(objective.width, dtype=torch.float64, device=device)
    for batch in batches:
        features, labels, weights = to_tensors(batch, data, device)
        optimizer.zero_grad(set_to_none=True)
        outputs = as_tuple(ddp(*features))
        loss, batch_sums = objective(outputs, labels, weights)
        loss.backward()
        optimizer.step()
        sums += batch_sums
    return sums


def evaluate(model: nn.Module, objective: Objective, val: ShardBatches, spec: TrainSpec,
             device: torch.device) -> torch.Tensor:
    """Exact validation over this rank's whole val shard (or validation_steps_per_epoch batches).

    Runs the plain module, not DDP: ranks may have different numbers of val batches, and no
    collective may run per batch.
    """
    model.eval()
    bs = spec.val_batch_size
    steps = -(-val.rows // bs)
    if spec.validation_steps_per_epoch is not None:
        steps = min(steps, spec.validation_steps_per_epoch)
    sums = torch.zeros(objective.width, dtype=torch.float64, device=device)
    with torch.no_grad():
        for batch in val.epoch(bs, steps, min(val.rows, steps * bs), False, 0):
            features, labels, weights = to_tensors(batch, spec.data, device)
            _, batch_sums = objective(as_tuple(model(*features)), labels, weights)
            sums += batch_sums
    return sums


def reduce_sums(sums: torch.Tensor) -> List[float]:
    """One all_reduce per epoch: every rank's (loss * rows, rows, metric * rows, ...) summed."""
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    return sums.cpu().tolist()


def as_tuple(outputs) -> Tuple[torch.Tensor, ...]:
    return tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)


def save_checkpoint(spec: TrainSpec, model: nn.Module, optimizer: torch.optim.Optimizer, epoch: int,
                    history: List[Dict[str, float]]) -> None:
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch,
                "history": history}, buffer)
    spec.data.store.write_bytes_atomic(RunLayout(spec.run_root).checkpoint, buffer.getvalue())


def _format(row: Dict[str, float]) -> str:
    return " ".join(f"{k}={v:.4f}" for k, v in row.items() if k != "epoch")
