"""Launchers start `num_proc` ranks and return each rank's WorkerResult.

- SparkBarrierLauncher: one Spark barrier task per rank (barrier mapInArrow: classic and Spark Connect
  sessions alike); one `allGather` to rendezvous (each call costs about a second, since Spark polls),
  then everything goes through torch.distributed. A failing rank leaves a typed record in the store.
- LocalLauncher: ranks as local processes (or in-process for one rank); same per-rank code.
pyspark is imported only inside the Spark launcher.
"""
from __future__ import annotations

import functools
import json
import logging
import multiprocessing
import os
import pickle
import re
import resource
import shutil
import threading
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Callable, Dict, Iterator, List, Optional, Protocol, Tuple

import torch
from torch.distributed import TCPStore

from estimator.distributed import (FailureKind, RankContext, RankFailed, RendezvousFailed, as_rank_failure,
                                   check_in, failure_kind, plan_devices, run_rank, shared_gpus,
                                   task_gpus)
from estimator.failure_watch import FailureWatch, stopped_by_driver
from estimator.faults import Fault, from_env, inject
from estimator.session import job_tag
from estimator.spec import TrainSpec, WorkerResult
from estimator.data import EarlyRead
from estimator.data.spill import Spilled, local_data, rank_data, spill, spill_root
from estimator.worker import train_worker

log = logging.getLogger("estimator")


class Launcher(Protocol):
    def run(self, spec: TrainSpec, num_proc: int) -> List[WorkerResult]: ...


# -- Spark --------------------------------------------------------------------------------------
RESULT_SCHEMA = "rank long, result binary"
FAILED_RANK_WAIT = 30.0  # seconds a failed rank waits for the driver's stop marker before raising to Spark


class SparkBarrierLauncher:
    """`num_proc` barrier tasks of `spark.range(num_proc).mapInArrow(..., barrier=True)`: the same job on
    classic and Spark Connect sessions. The ranks read what to train from the launch's folder in the store,
    send their results back as rows, and leave a failure record there when they fail."""

    def __init__(self, spark: Any, description: str = "TorchEstimator.fit"):
        self.spark = spark
        self.description = description

    def run(self, spec: TrainSpec, num_proc: int, source: Any = None, per_task: int = 1) -> List[WorkerResult]:
        """`source`: the direct mode's DataFrame in num_proc partitions (estimator.direct); the ranks are the
        barrier tasks of its last stage and train on their partitions' rows. `per_task`: ranks per task (one
        per GPU a task is given): num_proc / per_task tasks."""
        store, launch = spec.data.store, spec.run.launch(spec.launch_id)
        store.write_bytes_atomic(spec.run.launch_spec(spec.launch_id),
                                 pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL))
        task = functools.partial(_barrier_task, store, spec.run, spec.launch_id, from_env(), spec.attempt,
                                 FAILED_RANK_WAIT, spec.data.columns if source is not None else None, per_task)
        tasks = num_proc // per_task
        ranks = (source if source is not None else self.spark.range(0, tasks, 1, tasks)).mapInArrow(
            task, RESULT_SCHEMA, barrier=True)
        try:
            with job_tag(self.spark, f"{self.description} {spec.launch_id}") as cancel, \
                    FailureWatch(store, spec.run, spec.launch_id, num_proc, cancel):
                rows = ranks.collect()
            failed = [row["rank"] for row in rows if not row["result"]]  # ranks that failed and were stopped
            if failed:
                raise launch_failure(store, spec.run, spec.launch_id, num_proc, "", per_task) or RankFailed(
                    failed[0], "the rank failed and its failure record could not be read back from the store")
        except RankFailed:
            raise
        except Exception as exc:  # noqa: BLE001 - a rank's failure arrives wrapped in Spark's error
            failure = launch_failure(store, spec.run, spec.launch_id, num_proc, str(exc), per_task)
            if failure is None:
                raise
            log.debug("Spark's report of the failed training job: %s", exc)  # the Java frames, for DEBUG only
            raise failure from None
        finally:
            _remove_quietly(store, launch)
        results = sorted((pickle.loads(row["result"]) for row in rows), key=lambda r: r.rank)
        for r in results:
            if r.assigned_gpu is not None:
                log.info("rank %d ran on %s (Spark assigned GPU %s to it)", r.rank, r.device, r.assigned_gpu)
        return results


def launch_failure(store: Any, run: Any, launch_id: str, num_proc: int, text: str, per_task: int = 1
                   ) -> Optional[RankFailed]:
    """The cause of a failed launch: the failure records the ranks left in the store (the first that is not
    a peer's echo of another rank's failure), else what Spark's error text tells (a rank's worker died, or
    a record could not be written); None when the failure is not a rank's (e.g. Spark refused the job)."""
    records = []
    for rank in range(num_proc):
        try:
            records.append(json.loads(store.read_bytes(run.failure(launch_id, rank))))
        except FileNotFoundError:
            continue
        except Exception:  # noqa: BLE001 - the text below still names the failure
            log.debug("could not read rank %d's failure record", rank, exc_info=True)
    if records:
        records.sort(key=lambda r: (r["kind"] == FailureKind.PEER.value, r["time"]))
        return RankFailed.from_record(records[0])
    return rank_failure(text, per_task)


_RANK_FAILED = re.compile(r"(RankFailed|RendezvousFailed): rank (\d+): ([^\n]*)(.*?)(?:\n\s*SQLSTATE|\n\tat |\Z)",
                          re.S)


_BARRIER_TASK_FAILED = re.compile(r"barrier task ResultTask\(\d+, (\d+)\) finished unsuccessfully\.\s*\n(?:\S*Exception: )?"
                                  r"([^\n]*)")


def rank_failure(text: str, per_task: int = 1) -> Optional[RankFailed]:
    """From Spark's job-failure text alone: the first rank's own error and Python traceback; or, when a
    task's process died without one (killed, out of memory, a crash in native code), which rank it was (with
    several ranks per task: the task's first rank, and the message names them all)."""
    match = _RANK_FAILED.search(text)
    if not match:
        died = _BARRIER_TASK_FAILED.search(text)
        if died is None:
            return None
        reason = died.group(2).strip()
        if "Python worker exited unexpectedly" in reason:
            reason = ("its Python worker exited unexpectedly (crashed): killed, out of memory, os._exit or a crash in "
                      "native code. The executor's stderr holds whatever it printed.")
        first = int(died.group(1)) * per_task
        if per_task > 1:
            reason = f"the Spark task of ranks {first}-{first + per_task - 1}: {reason}"
        return RankFailed(first, reason, kind=FailureKind.WORKER_DEATH)
    kind = RendezvousFailed if match.group(1) == "RendezvousFailed" else RankFailed
    formatted = match.group(4).strip("\n").rstrip() or match.group(3)
    return kind(int(match.group(2)), formatted, match.group(3))


def _barrier_task(store: Any, run: Any, launch_id: str, faults: Tuple[Fault, ...], attempt: int, wait: float,
                  direct: Optional[Tuple[str, ...]], per_task: int, batches: Iterator[Any]) -> Iterator[Any]:
    """One barrier task of mapInArrow: `per_task` ranks (one per GPU it holds; usually one), their results as
    rows; on failure, a record in the store (what failed, on which rank, and its traceback) for the driver,
    which stops the job (estimator.failure_watch); the error goes to Spark only when the record could not be
    written or the driver wrote no stop marker in `wait` s. The input is one row (its partition id numbers the
    task), or in the direct mode the rank's rows: `direct` names the columns spilled to local disk before the
    rendezvous."""
    from pyspark import BarrierTaskContext

    first = BarrierTaskContext.get().partitionId() * per_task  # the task's first rank
    root = spill_root(f"{launch_id}-rank{first}")
    stopped = False
    try:
        spilled = spill(batches, root, direct) if direct is not None else None
        if spilled is None:
            for _ in batches:
                pass
        results = _spark_task(store.read_bytes(run.launch_spec(launch_id)), faults, attempt, per_task, spilled)
    except BaseException as exc:  # noqa: BLE001 - recorded, then raised as it is
        failure = as_rank_failure(first, exc)
        if _record_failure(store, run, launch_id, failure):
            stopped = stopped_by_driver(store, run.stop(launch_id), wait)
        if not stopped:
            raise failure from None
        yield _result_rows([(first + i, b"") for i in range(per_task)])  # stopped: the driver raises the failure
        return
    finally:
        if direct is not None:
            shutil.rmtree(root, ignore_errors=True)
    yield _result_rows([(r.rank, pickle.dumps(r)) for r in results])


def _record_failure(store: Any, run: Any, launch_id: str, failure: RankFailed) -> bool:
    """The failed rank's record for the driver; False when it could not be written."""
    try:
        store.write_bytes_atomic(run.failure(launch_id, failure.rank), json.dumps(failure.record()).encode())
        return True
    except Exception:  # noqa: BLE001 - the driver falls back to Spark's text
        log.debug("could not write rank %d's failure record", failure.rank, exc_info=True)
        return False


def _result_rows(rows: List[Tuple[int, bytes]]) -> Any:
    import pyarrow as pa

    return pa.RecordBatch.from_pydict({"rank": [r for r, _ in rows], "result": [b for _, b in rows]},
                                      schema=pa.schema([("rank", pa.int64()), ("result", pa.binary())]))


@dataclass(frozen=True)
class Placement:
    """Where every rank runs, as gathered at Spark's barrier (the same on every rank)."""

    hosts: Tuple[str, ...]  # per rank
    gpu_counts: Tuple[int, ...]  # per rank: CUDA devices its process sees (0 with use_gpu=False)
    addresses: Tuple[Optional[str], ...]  # per rank: the GPU address Spark gave it
    port: int  # rank 0's store, on hosts[0]
    threads: int  # torch threads per rank: the task's cores over its ranks

    @property
    def world(self) -> int:
        return len(self.hosts)


def _spark_task(spec_bytes: bytes, faults: Tuple[Fault, ...], attempt: int, per_task: int,
                spilled: Optional[Spilled] = None) -> List[WorkerResult]:
    """The body of one barrier task: meet through Spark once (rank 0's store port, every task's GPUs), then
    train its ranks: in this process for one rank, in a spawned process per GPU for several
    (estimator.task_ranks). Each step has the rendezvous timeout (in the direct mode, Spark's barrier waits
    that long plus the time this rank took to receive its rows: the peers receive theirs too)."""
    from pyspark import BarrierTaskContext

    started = time.perf_counter()
    task = BarrierTaskContext.get()
    first = task.partitionId() * per_task
    ranks = range(first, first + per_task)
    for rank in ranks:
        inject(faults, "before_barrier", rank, attempt)
    spec: TrainSpec = pickle.loads(spec_bytes)
    hosts = tuple(info.address.rsplit(":", 1)[0] for info in task.getTaskInfos() for _ in range(per_task))
    world, timeout = len(hosts), spec.rendezvous_timeout
    arrived = _announce(spec, ranks, hosts[first])
    own = replace(spec, data=local_data(spec.data, spilled)) if spilled is not None else spec
    early = EarlyRead.for_spec(own, first, world, faults, attempt, ranks_on_host=hosts.count(hosts[first])) \
        if per_task == 1 else None
    server: Optional[TCPStore] = None
    addresses = task_gpus(task)
    message: Dict[str, Any] = {"gpus": torch.cuda.device_count() if spec.use_gpu is not False else 0,
                               "gpu": addresses}
    if first == 0:  # rank 0's task owns the store; its OS-chosen port travels in the one allGather
        server = TCPStore(hosts[0], 0, world, is_master=True, timeout=timedelta(seconds=timeout),
                          wait_for_workers=False)
        message["port"] = server.port
    if spilled is not None:
        message["rows"] = spilled.counts
    replies = _all_gather(task, json.dumps(message), timeout + (spilled.seconds if spilled else 0.0),
                          while_waiting=lambda: _warm_up(early))
    if replies is None:
        arrived.join(5)
        raise RendezvousFailed(first, _late_at_barrier(spec, first, hosts, timeout))
    gathered = [json.loads(m) for m in replies]
    if per_task > 1 and any(len(m["gpu"]) < per_task for m in gathered):
        raise RankFailed(first, f"spark.task.resource.gpu.amount={per_task} but Spark gave the tasks GPU addresses "
                                f"{[m['gpu'] for m in gathered]}: a rank per GPU needs {per_task} per task.")
    place = Placement(hosts, tuple(m["gpus"] for m in gathered for _ in range(per_task)),
                      tuple((m["gpu"][i] if i < len(m["gpu"]) else None) for m in gathered for i in range(per_task)),
                      gathered[0]["port"], max(1, int(task.cpus()) // per_task))
    if spilled is not None:  # every rank the same checks over all ranks' rows, and the same plan
        spec = replace(own, data=rank_data(own.data, [m["rows"] for m in gathered]))
        if early is not None:
            early.plan_over(spec.data.largest_shard * world)
    if per_task == 1:
        results = [train_rank(spec, faults, attempt, first, place, early, server)]
    else:
        from estimator.task_ranks import run_ranks

        results = run_ranks(train_rank, [(spec, faults, attempt, rank, place) for rank in ranks], list(ranks),
                            lambda failure: _record_failure(spec.data.store, spec.run, spec.launch_id, failure))
    del server
    early = None  # noqa: F841 - the shard it read goes with it
    total = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return [replace(r, setup_seconds=total - r.seconds - r.teardown_seconds, peak_rss_mb=max(peak, r.peak_rss_mb),
                    spill_seconds=spilled.seconds if spilled is not None else 0.0) for r in results]


def train_rank(spec: TrainSpec, faults: Tuple[Fault, ...], attempt: int, rank: int, place: Placement,
               early: Optional[EarlyRead] = None, server: Optional[TCPStore] = None) -> WorkerResult:
    """One rank after the rendezvous, in its task's process or a process of its own: its device (the same
    decision on every rank, from gathered facts: all ranks fail alike or none does), the torch rendezvous,
    training. `early`: its shards, opened already; `server`: rank 0's store, when this process holds it."""
    started = time.perf_counter()
    if early is None:
        early = EarlyRead.for_spec(spec, rank, place.world, faults, attempt,
                                   ranks_on_host=place.hosts.count(place.hosts[rank]))
        if early is not None:
            early.begin()
    torch.set_num_threads(place.threads)  # the cores Spark gave this task, not every core of the host
    try:
        devices = plan_devices(spec.use_gpu, place.hosts, place.gpu_counts, place.addresses)
    except RuntimeError as exc:
        spark_gpus = list(place.addresses)
        raise RankFailed(rank, f"{exc} Spark assigned GPU addresses {spark_gpus} to ranks 0-{place.world - 1}"
                               + (" (none: set spark.task.resource.gpu.amount)" if not any(spark_gpus) else
                                  " but torch.cuda sees none: check the executors' CUDA drivers and CUDA_VISIBLE_DEVICES")
                               + ".") from None
    shared = shared_gpus(place.hosts, devices)
    if shared and rank == 0:
        log.warning("Ranks share GPUs (%s; spark.task.resource.gpu.amount < 1): nccl refuses two ranks on one "
                    "device, so gradients are averaged with gloo (through host memory, slower). Give each task a "
                    "whole GPU for nccl.", "; ".join(f"{h} {d}: ranks {r}" for (h, d), r in shared.items()))
    inject(faults, "before_checkin", rank, attempt)
    store = server or _connect(rank, place.hosts[0], place.port, place.world, spec.rendezvous_timeout)
    check_in(store, rank, place.hosts, spec.rendezvous_timeout)
    ctx = RankContext(rank, place.world, place.hosts[:rank].count(place.hosts[rank]), devices[rank], place.hosts[0],
                      place.port, place.addresses[rank], bool(shared))
    result = run_rank(ctx, store, lambda c: train_worker(spec, c, faults, attempt, early),
                      timeout=timedelta(seconds=spec.collective_timeout))
    del store
    return replace(result, setup_seconds=time.perf_counter() - started - result.seconds - result.teardown_seconds,
                   peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def _announce(spec: TrainSpec, ranks: range, host: str) -> threading.Thread:
    """Leave the task's ranks' arrival markers in the store, off the critical path (read only on a timeout)."""
    def write() -> None:
        for rank in ranks:
            try:
                spec.data.store.write_bytes_atomic(spec.run.arrival(spec.launch_id, rank), json.dumps(
                    {"rank": rank, "host": host, "pid": os.getpid()}).encode())
            except Exception:  # noqa: BLE001 - only diagnostics; the rendezvous does not depend on it
                log.debug("could not write the arrival marker of rank %d", rank, exc_info=True)

    thread = threading.Thread(target=write, name=f"arrival-rank-{ranks[0]}", daemon=True)
    thread.start()
    return thread


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
                   for p in spec.data.store.ls(spec.run.launch(spec.launch_id))
                   if os.path.basename(p).startswith("rank-") and p.endswith(".json")}
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
            raise next((f for f in failures if failure_kind(f) is not FailureKind.PEER), failures[0])
        return results


def _local_rank(spec: TrainSpec, rank: int, world: int, port: int) -> WorkerResult:
    store = TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=spec.rendezvous_timeout))
    hosts = ["127.0.0.1"] * world
    check_in(store, rank, hosts, spec.rendezvous_timeout)
    devices = plan_devices(spec.use_gpu, hosts, [torch.cuda.device_count()] * world, [None] * world)
    ctx = RankContext(rank, world, rank, devices[rank], "127.0.0.1", port,
                      shared_gpus=bool(shared_gpus(hosts, devices)))
    return run_rank(ctx, store, lambda c: train_worker(spec, c), timeout=timedelta(seconds=spec.collective_timeout))


__all__ = ["Launcher", "SparkBarrierLauncher", "LocalLauncher", "RankFailed", "RendezvousFailed"]
