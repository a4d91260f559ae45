"""One rank after the tasks met, wherever it runs (its task's process, or a process of its own when a task
has several GPUs; LocalLauncher's processes too): its device, decided alike on every rank from the facts
gathered when the tasks met (Placement), the check-in at rank 0's store, the process group, and training."""
from __future__ import annotations

import logging
import os
import resource
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Optional, Tuple

import torch
from torch.distributed import TCPStore

from estimator.core.faults import Fault, inject
from estimator.core.spec import TrainSpec, WorkerResult
from estimator.data.shards import EarlyRead
from estimator.failures import RankFailed
from estimator.launch.rendezvous import check_in, connect
from estimator.train.distributed import RankContext, plan_devices, run_rank, shared_gpus
from estimator.train.worker import train_worker

log = logging.getLogger("estimator")


@dataclass(frozen=True)
class Placement:
    """Where every rank runs, as gathered when the tasks met (the same on every rank)."""

    hosts: Tuple[str, ...]  # per rank
    gpu_counts: Tuple[int, ...]  # per rank: CUDA devices its process sees (0 with use_gpu=False)
    addresses: Tuple[Optional[str], ...]  # per rank: the GPU address Spark gave it
    port: int  # rank 0's store, on hosts[0]
    threads: int  # torch threads per rank: the task's cores over its ranks
    by_spark: bool = True  # Spark placed the ranks (its GPU addresses are worth naming); False: LocalLauncher

    @property
    def world(self) -> int:
        return len(self.hosts)


def train_rank(spec: TrainSpec, faults: Tuple[Fault, ...], attempt: int, rank: int, place: Placement,
               early: Optional[EarlyRead] = None, server: Optional[TCPStore] = None) -> WorkerResult:
    """One rank after the rendezvous, in its task's process or a process of its own: its device (the same
    decision on every rank, from gathered facts: all ranks fail alike or none does), the torch rendezvous,
    training. `early`: its shards, opened already; `server`: this process's connection to rank 0's store (or the
    store itself, on rank 0), when it has one already."""
    started = time.perf_counter()
    if early is None:
        early = EarlyRead.for_spec(spec, rank, place.world, faults, attempt,
                                   ranks_on_host=place.hosts.count(place.hosts[rank]))
        if early is not None:
            early.begin()
    torch.set_num_threads(place.threads)  # the cores Spark gave this task, not every core of the host
    # a fast tokenizer's batches run on a thread pool of every core of the host (Rust's rayon), beside the ranks'
    # torch threads: the reader's decode workers are the parallelism (yours wins if you set it)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        devices = plan_devices(spec.use_gpu, place.hosts, place.gpu_counts, place.addresses)
    except RuntimeError as exc:
        spark_gpus = list(place.addresses)
        if not place.by_spark:
            raise RankFailed(rank, str(exc)) from None
        raise RankFailed(rank, f"{exc} Spark assigned GPU addresses {spark_gpus} to ranks 0-{place.world - 1}"
                               + (" (none: set spark.task.resource.gpu.amount)" if not any(spark_gpus) else
                                  " but torch.cuda sees none: check the executors' CUDA drivers and CUDA_VISIBLE_DEVICES")
                               + ".") from None
    shared = shared_gpus(place.hosts, devices)  # nccl refuses two ranks on one device: gloo (the driver says so)
    if shared and rank == 0:
        log.info("ranks share GPUs: %s", "; ".join(f"{h} {d}: ranks {r}" for (h, d), r in shared.items()))
    inject(faults, "before_checkin", rank, attempt)
    store = server or connect(rank, place.hosts[0], place.port, place.world, spec.rendezvous_timeout)
    check_in(store, rank, place.hosts, spec.rendezvous_timeout)
    ctx = RankContext(rank, place.world, place.hosts[:rank].count(place.hosts[rank]), devices[rank], place.hosts[0],
                      place.port, place.addresses[rank], bool(shared))
    result = run_rank(ctx, store, lambda c: train_worker(spec, c, faults, attempt, early),
                      timeout=timedelta(seconds=spec.collective_timeout))
    del store
    return replace(result, setup_seconds=time.perf_counter() - started - result.seconds - result.teardown_seconds,
                   peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
