"""Who am I, who are my peers: the rank's context, its device, process-group setup and teardown. torch only.

The launcher finds the peers (Spark barrier tasks, or local processes) and hands each rank a
connected `TCPStore`; everything after that is the same everywhere.
"""
from __future__ import annotations

import dataclasses
import gc
import logging
import os
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

import torch
import torch.distributed as dist

from estimator.failures import RankFailed, as_rank_failure

log = logging.getLogger("estimator")
T = TypeVar("T")


@dataclass(frozen=True)
class RankContext:
    rank: int
    world_size: int
    local_rank: int
    device: str  # "cpu" or "cuda:N"
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    assigned_gpu: Optional[str] = None  # the GPU address Spark gave this rank (one of its task's resources()['gpu'])
    shared_gpus: bool = False  # some ranks of the group share a GPU (spark.task.resource.gpu.amount < 1)

    @property
    def backend(self) -> str:
        """nccl between GPUs, except where ranks share one (nccl refuses two ranks on one device); else gloo."""
        return "nccl" if self.device.startswith("cuda") and not self.shared_gpus else "gloo"


def choose_device(use_gpu: Optional[bool], gpu_counts: Sequence[int], local_rank: int,
                  assigned_gpu: Optional[str], gpus_here: Optional[int] = None) -> str:
    """The same decision on every rank, from every rank's GPU count (gathered at rendezvous). `gpus_here`: the
    CUDA devices of the rank's host (default: this process's), used only when Spark assigned no GPU."""
    everyone_has_gpu = len(gpu_counts) > 0 and all(n > 0 for n in gpu_counts)
    if use_gpu and not everyone_has_gpu:
        missing = [rank for rank, n in enumerate(gpu_counts) if n == 0]
        raise RuntimeError(f"use_gpu=True but ranks {missing} see no CUDA device. Set use_gpu=False "
                           "(or leave it None to use GPUs only when every rank has one).")
    if not everyone_has_gpu or use_gpu is False:
        return "cpu"
    here = torch.cuda.device_count() if gpus_here is None else gpus_here
    index = int(assigned_gpu) if assigned_gpu is not None else local_rank % max(1, here)
    return f"cuda:{index}"


def plan_devices(use_gpu: Optional[bool], hosts: Sequence[str], gpu_counts: Sequence[int],
                 addresses: Sequence[Optional[str]]) -> List[str]:
    """Every rank's device, computed alike on every rank from the gathered facts (per rank: its host, its
    host's CUDA device count, the GPU address Spark gave it)."""
    return [choose_device(use_gpu, gpu_counts, list(hosts[:r]).count(hosts[r]), addresses[r], gpu_counts[r])
            for r in range(len(hosts))]


def shared_gpus(hosts: Sequence[str], devices: Sequence[str]) -> Dict[Tuple[str, str], List[int]]:
    """The GPUs that more than one rank uses, (host, device) -> ranks: what spark.task.resource.gpu.amount < 1
    does (several tasks on one GPU). nccl refuses such a group; the launcher uses gloo for it."""
    users: Dict[Tuple[str, str], List[int]] = {}
    for rank, (host, device) in enumerate(zip(hosts, devices)):
        if device.startswith("cuda"):
            users.setdefault((host, device), []).append(rank)
    return {gpu: ranks for gpu, ranks in users.items() if len(ranks) > 1}


def forget_sharding_specs() -> None:
    """Empty DTensor's caches of each op's output spec (one in C++, one per thread in Python), whose keys hold the
    meshes of a finished fit's process group: a Spark Python worker lives for many fits, and strategy='fsdp'
    gives each sharding a mesh of its own (estimator.train.sharding.shard), so they would grow with every fit.
    Nothing to do where DTensor was never imported."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    clear = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear is not None:
        clear()
    try:
        from torch.distributed.tensor import DTensor

        propagator = DTensor._op_dispatcher.sharding_propagator
        propagator.propagate_op_sharding.cache_clear()
        propagator._propagate_tensor_meta_cached.cache_clear()
    except (ImportError, AttributeError):  # another torch's internals: the caches stay
        pass


def run_rank(ctx: RankContext, store: dist.Store, work: Callable[[RankContext], T],
             timeout: timedelta = timedelta(minutes=30)) -> T:
    """Init the process group, run `work`, and always tear the group down cleanly.

    The order matters: DistributedDataParallel must be garbage before destroy_process_group
    (a live DDP object at destroy time deadlocks), and the group must not outlive the task,
    because Spark reuses its Python workers for the next job.
    """
    os.environ.update(MASTER_ADDR=ctx.master_addr, MASTER_PORT=str(ctx.master_port), RANK=str(ctx.rank),
                      WORLD_SIZE=str(ctx.world_size), LOCAL_RANK=str(ctx.local_rank))
    if ctx.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(ctx.device))
    bound = {"device_id": torch.device(ctx.device)} if ctx.backend == "nccl" else {}  # nccl: the rank's own GPU
    dist.init_process_group(ctx.backend, store=store, rank=ctx.rank, world_size=ctx.world_size, timeout=timeout,
                            **bound)
    failure: Optional[RankFailed] = None
    result: Optional[T] = None
    # What the process held before this rank (its imports, earlier fits' survivors) is left out of the teardown's
    # collection, which then scans only what training made: 0.11 s less for a worker with torch and transformers
    # loaded (250k objects). Unfrozen after it, so that later collections see them again.
    gc.freeze()
    try:
        result = work(ctx)
        finished = time.perf_counter()
        dist.barrier()  # nobody tears down while a peer still needs the group
    except Exception as exc:  # noqa: BLE001 - re-raised below, after teardown, with the traceback as text
        failure = as_rank_failure(ctx.rank, exc)
        if failure is exc:  # keep its kind, not its frames: they hold DDP
            failure = type(exc)(ctx.rank, traceback.format_exc(), exc.summary, exc.kind, exc.at)
    # The traceback (and the frames holding DDP) is released once the except block ends.
    try:
        gc.collect()
        if dist.is_initialized():  # a train_fn that ended it itself is refused by name (TrainFnMisuse)
            dist.destroy_process_group()
    finally:
        gc.unfreeze()
    forget_sharding_specs()
    if failure is not None:
        raise failure
    if dataclasses.is_dataclass(result) and hasattr(result, "teardown_seconds"):
        result = dataclasses.replace(result, teardown_seconds=time.perf_counter() - finished)
    return result  # type: ignore[return-value]
