"""Launchers start `num_proc` ranks and return each rank's WorkerResult.

- SparkBarrierLauncher: one Spark barrier task per rank; one `allGather` to rendezvous (each call
  costs about a second, since Spark polls), then everything goes through torch.distributed.
- LocalLauncher: ranks as local processes (or in-process for one rank); same per-rank code.
pyspark is imported only inside the Spark launcher.
"""
from __future__ import annotations

import json
import multiprocessing
import pickle
import re
from datetime import timedelta
from typing import Any, Iterator, List, Optional, Protocol

import torch
from torch.distributed import TCPStore

from estimator.distributed import RankContext, RankFailed, choose_device, run_rank
from estimator.spec import TrainSpec, WorkerResult
from estimator.worker import train_worker

RENDEZVOUS_TIMEOUT = timedelta(minutes=5)


class Launcher(Protocol):
    def run(self, spec: TrainSpec, num_proc: int) -> List[WorkerResult]: ...


# -- Spark --------------------------------------------------------------------------------------
class SparkBarrierLauncher:
    def __init__(self, spark: Any, description: str = "TorchEstimator.fit"):
        self.spark = spark
        self.description = description

    def run(self, spec: TrainSpec, num_proc: int) -> List[WorkerResult]:
        sc = self.spark.sparkContext
        check_slots(sc, num_proc)
        blob = sc.broadcast(pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL))
        sc.setJobDescription(f"{self.description}: train on {num_proc} ranks")
        try:
            rdd = sc.parallelize(range(num_proc), num_proc).barrier()
            payloads = rdd.mapPartitions(lambda _: _spark_rank(blob.value)).collect()
        except Exception as exc:  # noqa: BLE001 - a rank's failure arrives wrapped in Java text
            failure = rank_failure(str(exc))
            if failure is None:
                raise
            raise failure from None
        finally:
            sc.setJobDescription(None)
            blob.unpersist()
        return sorted((pickle.loads(p) for p in payloads), key=lambda r: r.rank)


_RANK_FAILED = re.compile(r"RankFailed: Training failed on rank (\d+):\n(.*?)(?:\n\s*SQLSTATE|\n\tat |\Z)", re.S)


def rank_failure(text: str) -> Optional[RankFailed]:
    """The first rank's own error and Python traceback, out of Spark's job-failure text."""
    match = _RANK_FAILED.search(text)
    return RankFailed(int(match.group(1)), match.group(2).rstrip()) if match else None


def task_slots(sc: Any) -> int:
    """Tasks the cluster can run at once now (0 while no executor has registered)."""
    jsc = sc._jsc.sc()
    return int(jsc.maxNumConcurrentTasks(jsc.resourceProfileManager().defaultResourceProfile()))


def check_slots(sc: Any, num_proc: int) -> None:
    """A barrier stage needs all its tasks at once; Spark would otherwise retry for minutes."""
    slots = task_slots(sc)
    if 0 < slots < num_proc:
        raise ValueError(f"The 'num_proc' parameter of TorchEstimator must be at most the {slots} task slots this "
                         f"Spark application has. Got {num_proc} instead. Lower num_proc or add executors/cores.")


def _spark_rank(spec_bytes: bytes) -> Iterator[bytes]:
    """The body of one barrier task: rendezvous once through Spark, then train."""
    from pyspark import BarrierTaskContext

    spec: TrainSpec = pickle.loads(spec_bytes)
    task = BarrierTaskContext.get()
    rank = task.partitionId()
    hosts = [info.address.rsplit(":", 1)[0] for info in task.getTaskInfos()]
    world = len(hosts)
    server: Optional[TCPStore] = None
    message = {"gpus": torch.cuda.device_count() if spec.use_gpu is not False else 0}
    if rank == 0:  # rank 0 owns the store; its OS-chosen port travels in the one allGather
        server = TCPStore(hosts[0], 0, world, is_master=True, timeout=RENDEZVOUS_TIMEOUT, wait_for_workers=False)
        message["port"] = server.port
    gathered = [json.loads(m) for m in task.allGather(json.dumps(message))]
    port = gathered[0]["port"]
    store = server or TCPStore(hosts[0], port, world, is_master=False, timeout=RENDEZVOUS_TIMEOUT)
    local_rank = hosts[:rank].count(hosts[rank])
    gpu = task.resources().get("gpu")
    device = choose_device(spec.use_gpu, [m["gpus"] for m in gathered], local_rank,
                           gpu.addresses[0] if gpu is not None and gpu.addresses else None)
    ctx = RankContext(rank, world, local_rank, device, hosts[0], port)
    result = run_rank(ctx, store, lambda c: train_worker(spec, c))
    del store, server
    yield pickle.dumps(result)


# -- local processes ----------------------------------------------------------------------------
class LocalLauncher:
    """Ranks on this machine, without Spark: in-process for one rank, spawned processes otherwise."""

    def __init__(self, use_processes: Optional[bool] = None):
        self.use_processes = use_processes

    def run(self, spec: TrainSpec, num_proc: int) -> List[WorkerResult]:
        server = TCPStore("127.0.0.1", 0, num_proc, is_master=True, wait_for_workers=False,
                          timeout=RENDEZVOUS_TIMEOUT)
        try:
            if num_proc == 1 and not self.use_processes:
                return [_local_rank(spec, 0, 1, server.port)]
            return self._spawn(spec, num_proc, server.port)
        finally:
            del server

    def _spawn(self, spec: TrainSpec, num_proc: int, port: int) -> List[WorkerResult]:
        mp = multiprocessing.get_context("spawn")
        with mp.Pool(num_proc) as pool:
            handles = [pool.apply_async(_local_rank, (spec, r, num_proc, port)) for r in range(num_proc)]
            return [h.get() for h in handles]


def _local_rank(spec: TrainSpec, rank: int, world: int, port: int) -> WorkerResult:
    store = TCPStore("127.0.0.1", port, world, is_master=False, timeout=RENDEZVOUS_TIMEOUT)
    device = choose_device(spec.use_gpu, [torch.cuda.device_count()] * world, rank, None)
    ctx = RankContext(rank, world, rank, device, "127.0.0.1", port)
    return run_rank(ctx, store, lambda c: train_worker(spec, c))



__all__ = ["Launcher", "SparkBarrierLauncher", "LocalLauncher", "RankFailed"]
