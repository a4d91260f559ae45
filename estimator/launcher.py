"""Launchers start `num_proc` ranks and return each rank's WorkerResult.

- SparkBarrierLauncher: one Spark barrier task per rank; one `allGather` to rendezvous (each call
  costs about a second, since Spark polls), then everything goes through torch.distributed.
- LocalLauncher: ranks as local processes (or in-process for one rank); same per-rank code.
pyspark is imported only inside the Spark launcher.
"""
from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import pickle
import re
import resource
import threading
import time
from dataclasses import replace
from datetime import timedelta
from typing import Any, Callable, Dict, Iterator, List, Optional, Protocol, Tuple

import torch
from torch.distributed import TCPStore

from estimator.distributed import (RankContext, RankFailed, RendezvousFailed, assigned_gpu, check_in, choose_device,
                                   run_rank)
from estimator.faults import Fault, from_env, inject
from estimator.spec import TrainSpec, WorkerResult
from estimator.data import EarlyRead
from estimator.worker import train_worker

log = logging.getLogger("estimator")


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
        faults, attempt = from_env(), spec.attempt
        sc.setJobDescription(f"{self.description}: train on {num_proc} ranks")
        try:
            rdd = sc.parallelize(range(num_proc), num_proc).barrier()
            with _sql_worker_env(self.spark):
                payloads = rdd.mapPartitions(lambda _: _spark_rank(blob.value, faults, attempt)).collect()
            blob.unpersist()  # after a failure, killed tasks may still read it: Spark's cleaner drops it later
        except Exception as exc:  # noqa: BLE001 - a rank's failure arrives wrapped in Java text
            failure = rank_failure(str(exc))
            if failure is None:
                raise
            log.debug("Spark's report of the failed training job: %s", exc)  # the Java frames, for DEBUG only
            raise failure from None
        finally:
            sc.setJobDescription(None)
            _remove_quietly(spec.data.store, spec.run.launch(spec.launch_id))
        results = sorted((pickle.loads(p) for p in payloads), key=lambda r: r.rank)
        for r in results:
            if r.assigned_gpu is not None:
                log.info("rank %d ran on %s (Spark assigned GPU %s to its task)", r.rank, r.device, r.assigned_gpu)
        return results


_RANK_FAILED = re.compile(r"(RankFailed|RendezvousFailed): rank (\d+): ([^\n]*)(.*?)(?:\n\s*SQLSTATE|\n\tat |\Z)",
                          re.S)


_BARRIER_TASK_FAILED = re.compile(r"barrier task ResultTask\(\d+, (\d+)\) finished unsuccessfully\.\s*\n(?:\S*Exception: )?"
                                  r"([^\n]*)")


def rank_failure(text: str) -> Optional[RankFailed]:
    """The first rank's own error and Python traceback, out of Spark's job-failure text; or, when a
    rank's process died without one (killed, out of memory, a crash in native code), which rank it was."""
    match = _RANK_FAILED.search(text)
    if not match:
        died = _BARRIER_TASK_FAILED.search(text)
        if died is None:
            return None
        reason = died.group(2).strip()
        if "Python worker exited unexpectedly" in reason:
            reason = ("its Python worker exited unexpectedly (crashed): killed, out of memory, os._exit or a crash in "
                      "native code. The executor's stderr holds whatever it printed.")
        return RankFailed(int(died.group(1)), reason)
    kind = RendezvousFailed if match.group(1) == "RendezvousFailed" else RankFailed
    formatted = match.group(4).strip("\n").rstrip() or match.group(3)
    return kind(int(match.group(2)), formatted, match.group(3))


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


def _spark_rank(spec_bytes: bytes, faults: Tuple[Fault, ...], attempt: int) -> Iterator[bytes]:
    """The body of one barrier task: meet through Spark once (rank 0's store port), check in at that
    store (naming late ranks), then train. Each step has the rendezvous timeout."""
    from pyspark import BarrierTaskContext

    started = time.perf_counter()
    task = BarrierTaskContext.get()
    rank = task.partitionId()
    inject(faults, "before_barrier", rank, attempt)
    spec: TrainSpec = pickle.loads(spec_bytes)
    hosts = [info.address.rsplit(":", 1)[0] for info in task.getTaskInfos()]
    world, timeout = len(hosts), spec.rendezvous_timeout
    arrived = _announce(spec, rank, hosts[rank])
    early = EarlyRead.for_spec(spec, rank, world, faults, attempt, ranks_on_host=hosts.count(hosts[rank]))
    server: Optional[TCPStore] = None
    assigned = assigned_gpu(task)
    message = {"gpus": torch.cuda.device_count() if spec.use_gpu is not False else 0, "gpu": assigned}
    if rank == 0:  # rank 0 owns the store; its OS-chosen port travels in the one allGather
        server = TCPStore(hosts[0], 0, world, is_master=True, timeout=timedelta(seconds=timeout),
                          wait_for_workers=False)
        message["port"] = server.port
    replies = _all_gather(task, json.dumps(message), timeout, while_waiting=lambda: _warm_up(early))
    if replies is None:
        arrived.join(5)
        raise RendezvousFailed(rank, _late_at_barrier(spec, rank, hosts, timeout))
    gathered = [json.loads(m) for m in replies]
    port = gathered[0]["port"]
    local_rank = hosts[:rank].count(hosts[rank])
    torch.set_num_threads(max(1, int(task.cpus())))  # the cores Spark gave this task, not every core of the host
    try:  # the same decision on every rank, from gathered facts: all ranks fail alike or none does
        device = choose_device(spec.use_gpu, [m["gpus"] for m in gathered], local_rank, assigned)
    except RuntimeError as exc:
        spark_gpus = [m["gpu"] for m in gathered]
        raise RankFailed(rank, f"{exc} Spark assigned GPU addresses {spark_gpus} to ranks 0-{world - 1}"
                               + (" (none: set spark.task.resource.gpu.amount)" if not any(spark_gpus) else
                                  " but torch.cuda sees none: check the executors' CUDA drivers and CUDA_VISIBLE_DEVICES")
                               + ".") from None
    inject(faults, "before_checkin", rank, attempt)
    store = server or _connect(rank, hosts[0], port, world, timeout)
    check_in(store, rank, hosts, timeout)
    ctx = RankContext(rank, world, local_rank, device, hosts[0], port, assigned)
    result = run_rank(ctx, store, lambda c: train_worker(spec, c, faults, attempt, early),
                      timeout=timedelta(seconds=spec.collective_timeout))
    del store, server, early
    total = time.perf_counter() - started
    result = replace(result, setup_seconds=total - result.seconds - result.teardown_seconds,
                     peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    yield pickle.dumps(result)


def _announce(spec: TrainSpec, rank: int, host: str) -> threading.Thread:
    """Leave this rank's arrival marker in the store, off the critical path (read only on a timeout)."""
    def write() -> None:
        try:
            spec.data.store.write_bytes_atomic(spec.run.arrival(spec.launch_id, rank),
                                               json.dumps({"rank": rank, "host": host, "pid": os.getpid()}).encode())
        except Exception:  # noqa: BLE001 - only diagnostics; the rendezvous does not depend on it
            log.debug("could not write the arrival marker of rank %d", rank, exc_info=True)

    thread = threading.Thread(target=write, name=f"arrival-rank-{rank}", daemon=True)
    thread.start()
    return thread


@contextlib.contextmanager
def _sql_worker_env(spark: Any) -> Iterator[None]:
    """Run the ranks in Python workers that the model's transform can reuse afterwards.

    Spark keeps one pool of Python workers per environment, and SQL UDFs (our transform) add
    SPARK_SIMPLIFIED_TRACEBACK=1 to theirs, so an RDD job's workers are never reused for them: the
    transform after a fit started new workers and paid for importing torch again (2-3 s per worker on
    the benchmark machine). Giving the training job the same variable puts its workers, torch already
    imported, in the pool the transform draws from. Rank errors travel as text in RankFailed, so the
    simplified traceback loses nothing of them.
    """
    sc = spark.sparkContext
    enabled = str(spark.conf.get("spark.sql.execution.pyspark.udf.simplifiedTraceback.enabled", "true"))
    owned = enabled.lower() == "true" and "SPARK_SIMPLIFIED_TRACEBACK" not in sc.environment
    if owned:
        sc.environment["SPARK_SIMPLIFIED_TRACEBACK"] = "1"  # read when the job's Python function is built
    try:
        yield
    finally:
        if owned:
            sc.environment.pop("SPARK_SIMPLIFIED_TRACEBACK", None)


def _warm_up(early: Optional[EarlyRead]) -> None:
    """While Spark's barrier polls: the imports first, then this rank's shard read on its thread.
    Both need the CPU; run together in a fresh Python worker, they slowed each other down more than
    the overlap saved (first fits 0.7 s slower on the benchmark machine)."""
    _warm_imports()
    if early is not None:
        early.begin()


def _warm_imports() -> None:
    """The first torch.optim optimizer in a process imports torch._dynamo: about 2 s in a fresh Python
    worker on the benchmark machine. Paid here, while Spark's barrier polls (about 1 s), it overlaps
    the rendezvous instead of adding to training; in a reused worker it costs nothing."""
    try:
        import torch._dynamo  # noqa: F401
    except Exception:  # noqa: BLE001 - only a warm-up; training imports it again and reports errors
        log.debug("warming up torch._dynamo failed", exc_info=True)


def _all_gather(task: Any, message: str, timeout: float,
                while_waiting: Optional[Callable[[], None]] = None) -> Optional[List[str]]:
    """Spark's allGather, abandoned after `timeout` seconds (Spark's own barrier timeout is a year).
    `while_waiting` runs on this thread meanwhile."""
    box: Dict[str, Any] = {}

    def gather() -> None:
        try:
            box["replies"] = task.allGather(message)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the task's thread
            box["error"] = exc

    thread = threading.Thread(target=gather, name="spark-barrier", daemon=True)
    thread.start()
    started = time.monotonic()
    if while_waiting is not None:
        while_waiting()
    thread.join(max(0.0, timeout - (time.monotonic() - started)))
    if "error" in box:
        raise box["error"]
    return box.get("replies")


def _late_at_barrier(spec: TrainSpec, rank: int, hosts: List[str], timeout: float) -> str:
    try:
        present = {int(os.path.basename(p)[len("rank-"):-len(".json")])
                   for p in spec.data.store.ls(spec.run.launch(spec.launch_id)) if p.endswith(".json")}
    except Exception:  # noqa: BLE001 - the markers only refine the message
        present = {rank}
    late = [r for r in range(len(hosts)) if r not in present]
    who = ", ".join(f"rank {r} (host {hosts[r]})" for r in late) if late else "some ranks"
    return (f"{who} did not reach Spark's barrier within rendezvous_timeout={timeout:g} s (rank {rank} waited). "
            "Their tasks started but their Python workers were still starting, importing torch or loading "
            "the training spec: raise rendezvous_timeout, or look at those executors' logs.")


def _connect(rank: int, host: str, port: int, world: int, timeout: float) -> TCPStore:
    try:
        return TCPStore(host, port, world, is_master=False, timeout=timedelta(seconds=timeout))
    except Exception as exc:  # noqa: BLE001 - unreachable rank 0: say which address and why it matters
        raise RendezvousFailed(rank, f"rank {rank} could not connect to rank 0's rendezvous store at {host}:{port} "
                                     f"within rendezvous_timeout={timeout:g} s ({type(exc).__name__}: {exc}). "
                                     "Executors must reach each other on ephemeral TCP ports; check firewalls "
                                     "and network security groups between executors.") from None


def _remove_quietly(store: Any, path: str) -> None:
    try:
        store.rm(path)
    except Exception:  # noqa: BLE001 - scratch files; a failure to clean them up must not fail the fit
        log.debug("could not remove %s", path, exc_info=True)


# -- local processes ----------------------------------------------------------------------------
class LocalLauncher:
    """Ranks on this machine, without Spark: in-process for one rank, spawned processes otherwise."""

    def __init__(self, use_processes: Optional[bool] = None):
        self.use_processes = use_processes

    def run(self, spec: TrainSpec, num_proc: int) -> List[WorkerResult]:
        server = TCPStore("127.0.0.1", 0, num_proc, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=spec.rendezvous_timeout))
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
            results, failures = [], []
            for handle in handles:
                try:
                    results.append(handle.get())
                except Exception as exc:  # noqa: BLE001 - every rank's outcome first, then the cause
                    failures.append(exc)
        if failures:  # the failing rank's own error, not a peer's echo of it
            raise next((f for f in failures if "PeerFailed" not in str(f)), failures[0])
        return results


def _local_rank(spec: TrainSpec, rank: int, world: int, port: int) -> WorkerResult:
    store = TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=spec.rendezvous_timeout))
    check_in(store, rank, ["127.0.0.1"] * world, spec.rendezvous_timeout)
    device = choose_device(spec.use_gpu, [torch.cuda.device_count()] * world, rank, None)
    ctx = RankContext(rank, world, rank, device, "127.0.0.1", port)
    return run_rank(ctx, store, lambda c: train_worker(spec, c), timeout=timedelta(seconds=spec.collective_timeout))



__all__ = ["Launcher", "SparkBarrierLauncher", "LocalLauncher", "RankFailed", "RendezvousFailed"]
