"""Launchers start `num_proc` ranks and return each rank's WorkerResult.

- SparkBarrierLauncher (here): barrier tasks of `mapInArrow` (classic and Spark Connect sessions alike), one per
  rank, or one per N ranks when Spark gives each task N GPUs (estimator.launch.task_ranks); they meet at rank 0's
  TCPStore, its address left in the store (estimator.launch.rendezvous), then everything goes through torch.distributed
  (estimator.launch.rank_setup). A failing rank leaves a typed record in the store.
- LocalLauncher (estimator.launch.local): ranks as local processes (or in-process for one rank), the same
  per-rank code.
pyspark is imported only inside the barrier task and the launcher's methods.
"""
from __future__ import annotations

import functools
import inspect
import json
import logging
import pickle
import posixpath
import re
import resource
import shutil
import threading
import time
from dataclasses import replace
from datetime import timedelta
from typing import Any, Callable, Dict, Iterator, List, Optional, Protocol, Tuple

import torch
from torch.distributed import TCPStore

from estimator.core.devices import task_gpus
from estimator.core.faults import Fault, from_env, inject
from estimator.core.spec import TrainSpec, WorkerResult
from estimator.data.shards import EarlyRead
from estimator.data.spill import Spilled, local_data, rank_data, spill, spill_root
from estimator.failures import FailureKind, RankFailed, RendezvousFailed, as_rank_failure
from estimator.launch.failure_watch import FailureWatch, stopped_by_driver
from estimator.launch.liveness import LaunchWatch, remove_if_ours, wait_for_other_launch
from estimator.launch.rank_setup import Placement, train_rank
from estimator.launch.rendezvous import LATE_TO_START, check_in, find_rank0, publish
from estimator.launch.session import executor_python, job_tag, tag_canceller

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
        """`source`: the direct mode's DataFrame in num_proc partitions (estimator.fit.direct); the ranks are the
        barrier tasks of its last stage and train on their partitions' rows. `per_task`: ranks per task (one
        per GPU a task is given): num_proc / per_task tasks."""
        store, launch = spec.data.store, spec.run.launch(spec.launch_id)
        payload = pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL)
        store.write_bytes_atomic(spec.run.launch_spec(spec.launch_id), payload)
        log.info("Launch %s: a spec of %d bytes for the ranks (a model given as a factory is built on the ranks and "
                 "adds none of its weights)", spec.launch_id, len(payload))
        task = functools.partial(_barrier_task, store, spec.run, spec.launch_id, from_env(), spec.attempt,
                                 FAILED_RANK_WAIT, spec.data.columns if source is not None else None, per_task)
        tasks = num_proc // per_task
        ranks = (source if source is not None else self.spark.range(0, tasks, 1, tasks)).mapInArrow(
            task, RESULT_SCHEMA, barrier=True)
        try:
            rows = self._collect(ranks, spec, num_proc)
            failed = [row["rank"] for row in rows if not row["result"]]  # ranks that failed and were stopped
            if failed:
                raise launch_failure(store, spec.run, spec.launch_id, num_proc, "", per_task) or RankFailed(
                    failed[0], "the rank failed and its failure record could not be read back from the store")
        except RankFailed:
            raise
        except Exception as exc:  # noqa: BLE001 - a rank's failure arrives wrapped in Spark's error
            failure = launch_failure(store, spec.run, spec.launch_id, num_proc, str(exc), per_task,
                                     executor_python(self.spark))
            if failure is None:
                raise
            log.debug("Spark's report of the failed training job: %s", exc)  # the Java frames, for DEBUG only
            raise failure from None
        finally:
            _remove_quietly(store, launch)  # a task still running finds it gone and ends (LaunchWatch)
            remove_if_ours(store, spec.run, spec.launch_id)  # rank 0's beat, if a killed task left it
        results = sorted((pickle.loads(row["result"]) for row in rows), key=lambda r: r.rank)
        for r in results:
            if r.assigned_gpu is not None:
                log.info("rank %d ran on %s (Spark assigned GPU %s to it)", r.rank, r.device, r.assigned_gpu)
        if any(r.device.startswith("cuda") and r.allreduce.startswith("gloo") for r in results):
            log.warning("Ranks shared GPUs (spark.task.resource.gpu.amount < 1): nccl refuses two ranks on one "
                        "device, so gradients were averaged with gloo, through host memory (slower). Give each "
                        "rank a whole GPU for nccl.")
        return results

    def _collect(self, ranks: Any, spec: TrainSpec, num_proc: int) -> List[Any]:
        """The barrier job's rows, collected on a thread of its own (inheriting the caller's Spark job group and
        tags), so that Ctrl-C reaches this thread while the job runs rather than inside pyspark's socket read,
        where pyspark's own handler cannot cancel it: the job is cancelled by its tag, the ranks' tasks end
        (a checkpoint is written atomically: the last one stays whole), and KeyboardInterrupt goes on up."""
        from pyspark import InheritableThread

        store, text = spec.data.store, f"{self.description} {spec.launch_id}"
        box: Dict[str, Any] = {}

        def job() -> None:
            try:
                with job_tag(self.spark, text) as cancel, FailureWatch(store, spec.run, spec.launch_id, num_proc,
                                                                       cancel):
                    box["rows"] = ranks.collect()
            except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
                box["error"] = exc

        # pyspark >= 4 copies a Connect session's tags too (session=); 3.5's takes no session (the tags are added
        # inside the thread by job_tag either way)
        session = {"session": self.spark} if "session" in inspect.signature(InheritableThread.__init__).parameters \
            else {}
        thread = InheritableThread(job, name=f"training-job-{spec.launch_id}", daemon=True, **session)
        thread.start()
        try:
            while thread.is_alive():
                thread.join(0.2)
        except KeyboardInterrupt:
            interrupted(self.spark, text, spec, thread)
            raise
        if "error" in box:
            raise box["error"]
        return box["rows"]


def interrupted(spark: Any, text: str, spec: TrainSpec, job: Any) -> None:
    """Ctrl-C during a launch: its job cancelled by its tag and its folder removed (every task ends its process
    within seconds: LaunchWatch), then one line saying how to go on. Returns once rank 0's task has stopped
    beating, so that a fit right after does not wait for it."""
    from estimator.console import say_to_user  # the driver's console (not imported by the ranks)

    try:
        tag_canceller(spark, text)()
    except Exception:  # noqa: BLE001 - pyspark's own handler may have cancelled it already
        log.debug("could not cancel the training job by its tag", exc_info=True)
    job.join(30)
    store, run_id = spec.data.store, posixpath.basename(spec.run.root.rstrip("/"))
    _remove_quietly(store, spec.run.launch(spec.launch_id))
    try:
        wait_for_other_launch(store, spec.run, run_id, 30.0, lambda line: None)
    except Exception:  # noqa: BLE001 - the next fit of the run waits for it and says so
        log.debug("launch %s still beats", spec.launch_id, exc_info=True)
    (say_to_user if spec.verbose else log.info)(
        f"Interrupted: the training job of run {run_id!r} was cancelled. To continue from its last checkpoint, "
        f"fit again with run_id={run_id!r}.")


def launch_failure(store: Any, run: Any, launch_id: str, num_proc: int, text: str, per_task: int = 1,
                   python: str = "") -> Optional[RankFailed]:
    """The cause of a failed launch: the failure records the ranks left in the store (the first that is not
    a peer's echo of another rank's failure), else what Spark's error text tells (a rank's worker died, or
    a record could not be written); None when the failure is not a rank's (e.g. Spark refused the job). When
    the records are all echoes and the text names a rank whose Python worker died (killed, out of memory, a
    native crash: it left no record), that death is the cause, not the connection its peers lost."""
    records = []
    for rank in range(num_proc):
        try:
            records.append(json.loads(store.read_bytes(run.failure(launch_id, rank))))
        except FileNotFoundError:
            continue
        except Exception:  # noqa: BLE001 - the text below still names the failure
            log.debug("could not read rank %d's failure record", rank, exc_info=True)
    records.sort(key=lambda r: (r["kind"] == FailureKind.PEER.value, r["time"]))
    if records and records[0]["kind"] != FailureKind.PEER.value:
        return RankFailed.from_record(records[0])
    from_text = rank_failure(text, per_task, python)
    if records and (from_text is None or from_text.kind is not FailureKind.WORKER_DEATH):
        return RankFailed.from_record(records[0])  # only echoes: the first is what there is
    return from_text


_RANK_FAILED = re.compile(r"(RankFailed|RendezvousFailed): rank (\d+): ([^\n]*)(.*?)(?:\n\s*SQLSTATE|\n\tat |\Z)",
                          re.S)


_BARRIER_TASK_FAILED = re.compile(r"barrier task ResultTask\(\d+, (\d+)\) finished unsuccessfully\.\s*\n(?:\S*Exception: )?"
                                  r"([^\n]*)")


_NO_MODULE = re.compile(r"ModuleNotFoundError: No module named '([^']+)'")


def rank_failure(text: str, per_task: int = 1, python: str = "") -> Optional[RankFailed]:
    """From Spark's job-failure text alone: the first rank's own error and Python traceback; a module the
    executors' Python could not import before any of this project's code ran (`python`: which Python that is);
    or, when a task's process died without one (killed, out of memory, a crash in native code), which rank it was
    (with several ranks per task: the task's first rank, and the message names them all)."""
    match = _RANK_FAILED.search(text)
    missing = _NO_MODULE.search(text)
    if not match and missing:
        return RankFailed(0, f"ModuleNotFoundError: No module named {missing.group(1)!r} in the executors' Python "
                             f"({python or 'unknown'}), before the training code ran. Install it there (README 'On a "
                             "cluster' lists what executors need), or set PYSPARK_PYTHON to a Python that has it "
                             "before the SparkSession starts (spark.pyspark.python set in a script's builder is not "
                             "read).", kind=FailureKind.ENVIRONMENT)
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
    which stops the job (estimator.launch.failure_watch); the error goes to Spark only when the record could not be
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
        with LaunchWatch(store, run, launch_id, beats=first == 0):
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


def _spark_task(spec_bytes: bytes, faults: Tuple[Fault, ...], attempt: int, per_task: int,
                spilled: Optional[Spilled] = None) -> List[WorkerResult]:
    """The body of one barrier task: meet at rank 0's TCPStore (every task's GPUs; no Spark allGather), then
    train its ranks: in this process for one rank, in a spawned process per GPU for several
    (estimator.launch.task_ranks). Each step has the rendezvous timeout (in the direct mode, the meeting waits
    that long plus the time this rank took to receive its rows: the peers receive theirs too)."""
    from pyspark import BarrierTaskContext

    started = time.perf_counter()
    task = BarrierTaskContext.get()
    first = task.partitionId() * per_task
    ranks = range(first, first + per_task)
    for rank in ranks:
        inject(faults, "before_barrier", rank, attempt)
    spec: TrainSpec = pickle.loads(spec_bytes)
    task_hosts = tuple(info.address.rsplit(":", 1)[0] for info in task.getTaskInfos())
    hosts = tuple(host for host in task_hosts for _ in range(per_task))  # per rank
    world, timeout = len(hosts), spec.rendezvous_timeout
    own = replace(spec, data=local_data(spec.data, spilled)) if spilled is not None else spec
    early = EarlyRead.for_spec(own, first, world, faults, attempt, ranks_on_host=hosts.count(hosts[first])) \
        if per_task == 1 else None
    server: Optional[TCPStore] = None
    addresses = task_gpus(task)
    message: Dict[str, Any] = {"gpus": torch.cuda.device_count() if spec.use_gpu is not False else 0,
                               "gpu": addresses}
    if spilled is not None:
        message["rows"] = spilled.counts
    address = spec.run.rendezvous(spec.launch_id)
    if first == 0:  # rank 0's task owns the store; its OS-chosen port goes to the launch's folder
        server = TCPStore(hosts[0], 0, world, is_master=True, timeout=timedelta(seconds=timeout),
                          wait_for_workers=False)
        publish(spec.data.store, address, hosts[0], server.port)
    gathered, port, client = _meanwhile(
        lambda: _gather(spec.data.store, address, server, task.partitionId(), task_hosts, per_task,
                        json.dumps(message), timeout + (spilled.seconds if spilled else 0.0)),
        (lambda: _warm_up(early)) if per_task == 1 else None)  # several ranks per task: the ranks' own warm-up
    if per_task > 1 and any(len(m["gpu"]) < per_task for m in gathered):
        raise RankFailed(first, f"spark.task.resource.gpu.amount={per_task} but Spark gave the tasks GPU addresses "
                                f"{[m['gpu'] for m in gathered]}: a rank per GPU needs {per_task} per task.")
    place = Placement(hosts, tuple(m["gpus"] for m in gathered for _ in range(per_task)),
                      tuple((m["gpu"][i] if i < len(m["gpu"]) else None) for m in gathered for i in range(per_task)),
                      port, max(1, int(task.cpus()) // per_task))
    if spilled is not None:  # every rank the same checks over all ranks' rows, and the same plan
        spec = replace(own, data=rank_data(own.data, [m["rows"] for m in gathered]))
        if early is not None:
            early.plan_over(spec.data.largest_shard * world)
    if per_task == 1:
        results = [train_rank(spec, faults, attempt, first, place, early, client)]
    else:
        from estimator.launch.task_ranks import run_ranks

        results = run_ranks(train_rank, [(spec, faults, attempt, rank, place) for rank in ranks], list(ranks),
                            lambda failure: _record_failure(spec.data.store, spec.run, spec.launch_id, failure))
    server = client = None  # noqa: F841 - rank 0's store and this task's connection close with them
    early = None  # noqa: F841 - the shard it read goes with it
    total = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return [replace(r, setup_seconds=total - r.seconds - r.teardown_seconds, peak_rss_mb=max(peak, r.peak_rss_mb),
                    spill_seconds=spilled.seconds if spilled is not None else 0.0) for r in results]


def _gather(store: Any, address: str, server: Optional[TCPStore], task: int, hosts: Tuple[str, ...],
            per_task: int, message: str, timeout: float) -> Tuple[List[Dict[str, Any]], int, TCPStore]:
    """Every task's message (in task order) through rank 0's TCPStore, that store's port, and this task's
    connection to it. `hosts`: per task."""
    port, client = (server.port, server) if server is not None else find_rank0(store, address, task * per_task,
                                                                               hosts, timeout)
    who = [f"rank {t * per_task}" if per_task == 1 else f"ranks {t * per_task}-{(t + 1) * per_task - 1}"
           for t in range(len(hosts))]
    replies = check_in(client, task, hosts, timeout, message, step="gather", late="reach the rendezvous",
                       advice=LATE_TO_START, who=who)
    return [json.loads(m) for m in replies], port, client


def _meanwhile(gather: Callable[[], Any], warm_up: Optional[Callable[[], None]]) -> Any:
    """`gather()` on a thread of its own while `warm_up()` runs on this one; what gather returned or raised."""
    box: Dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = gather()
        except BaseException as exc:  # noqa: BLE001 - raised in the task's thread
            box["error"] = exc

    thread = threading.Thread(target=run, name="rendezvous", daemon=True)
    thread.start()
    if warm_up is not None:
        warm_up()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _warm_up(early: Optional[EarlyRead]) -> None:
    """While the ranks meet: the imports first, then this rank's shard read on its thread.
    Both need the CPU; run together in a fresh Python worker, they slowed each other down more than
    the overlap saved (first fits 0.7 s slower on the benchmark machine)."""
    _warm_imports()
    if early is not None:
        early.begin()


def _warm_imports() -> None:
    """The first torch.optim optimizer in a process imports torch._dynamo: about 2 s in a fresh Python
    worker on the benchmark machine. Paid here, while the ranks meet, it overlaps the rendezvous (a
    rank waits there for the slowest task's start) instead of adding to training; in a reused worker it costs
    nothing."""
    try:
        import torch._dynamo  # noqa: F401
    except Exception:  # noqa: BLE001 - only a warm-up; training imports it again and reports errors
        log.debug("warming up torch._dynamo failed", exc_info=True)


def _remove_quietly(store: Any, path: str) -> None:
    try:
        store.rm(path)
    except Exception:  # noqa: BLE001 - scratch files; a failure to clean them up must not fail the fit
        log.debug("could not remove %s", path, exc_info=True)


__all__ = ["Launcher", "SparkBarrierLauncher"]
