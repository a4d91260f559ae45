"""Several ranks in one Spark task: one spawned process per GPU the task was given.

A Spark task with N GPUs (spark.task.resource.gpu.amount = N) runs N ranks, as torchrun and pyspark's
TorchDistributor run N processes per task. The task's own Python worker does the rendezvous through Spark for
all of them, then starts N processes ("spawn": CUDA cannot be used after a fork) and waits. Each process is one
rank with its own rows, steps, device and failure record, exactly as a rank of its own task. No pyspark here.

A rank's outcome comes back through a pipe: its WorkerResult, or its failure record (rank number, kind,
traceback). A process that exits without either died (killed, out of memory, os._exit): a WORKER_DEATH of its
rank. The first failure is reported at once (the driver stops the run); the other ranks get `grace` seconds to
end on their own (a peer's collective fails fast), then are terminated. A rank process whose parent is gone
(Spark killed the task) exits within a second: nothing outlives its task.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import threading
import time
from multiprocessing.connection import wait
from typing import Any, Callable, Dict, List, Optional, Sequence

from estimator.failures import FailureKind, RankFailed, as_rank_failure

log = logging.getLogger("estimator")
GRACE_SECONDS = 30.0  # after a rank's failure, how long its task waits for the other ranks to end on their own


def run_ranks(target: Callable[..., Any], args: Sequence[tuple], ranks: Sequence[int],
              on_failure: Callable[[RankFailed], None], grace: float = GRACE_SECONDS) -> List[Any]:
    """`target(*args[i])` as rank `ranks[i]`, each in a spawned process; their results in rank order. Raises
    the failure that caused the others (a rank's own error before the peers' echoes of it); `on_failure` sees
    each failure as it arrives."""
    context = multiprocessing.get_context("spawn")
    children: Dict[int, Any] = {}  # rank -> (process, connection)
    try:
        for rank, rank_args in zip(ranks, args):
            receive, send = context.Pipe(duplex=False)
            process = context.Process(target=_rank_process, args=(target, rank_args, rank, send, os.getpid()),
                                      name=f"rank-{rank}")  # not daemonic: a rank may start reader processes
            process.start()
            send.close()
            children[rank] = (process, receive)
        return _collect(children, on_failure, grace)
    finally:
        for process, receive in children.values():
            if process.is_alive():
                process.terminate()
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join()
            receive.close()


def _collect(children: Dict[int, Any], on_failure: Callable[[RankFailed], None], grace: float) -> List[Any]:
    results: Dict[int, Any] = {}
    failures: List[RankFailed] = []
    waiting = dict(children)
    deadline: Optional[float] = None
    while waiting:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = wait([receive for _, receive in waiting.values()] + [p.sentinel for p, _ in waiting.values()],
                     timeout)
        if not ready:  # the grace after a failure is over: the rest are stuck in a collective
            for rank, (process, _) in waiting.items():
                log.warning("rank %d did not end within %g s of rank %d's failure: terminating it", rank, grace,
                            failures[0].rank)
                process.terminate()
            break
        for rank, (process, receive) in list(waiting.items()):
            if receive not in ready and process.sentinel not in ready:
                continue
            outcome = _outcome(rank, process, receive)
            del waiting[rank]
            if isinstance(outcome, RankFailed):
                failures.append(outcome)
                on_failure(outcome)
                deadline = deadline or time.monotonic() + grace
            else:
                results[rank] = outcome
    if failures:
        raise next((f for f in failures if f.kind is not FailureKind.PEER), failures[0])
    return [results[rank] for rank in sorted(results)]


def _outcome(rank: int, process: Any, receive: Any) -> Any:
    """What the rank's process sent (its result, or its failure), or its death when it sent nothing."""
    message = None
    try:
        if receive.poll():
            message = receive.recv()
    except (EOFError, OSError):
        message = None
    if message is None:
        process.join(5)
        code = process.exitcode
        return RankFailed(rank, f"its process exited (code {code}) without a result or an error: killed, out of "
                                "memory, os._exit or a crash in native code. The executor's stderr holds whatever "
                                "it printed.", kind=FailureKind.WORKER_DEATH)
    kind, payload = message
    process.join(30)
    return RankFailed.from_record(payload) if kind == "failed" else pickle.loads(payload)


def _rank_process(target: Callable[..., Any], args: tuple, rank: int, send: Any, parent: int) -> None:
    """The body of a rank's process: run it, send its result or failure record, and die with the task."""
    threading.Thread(target=_exit_with_parent, args=(parent,), name="parent-watch", daemon=True).start()
    try:
        message = ("ok", pickle.dumps(target(*args), protocol=pickle.HIGHEST_PROTOCOL))
    except BaseException as exc:  # noqa: BLE001 - sent to the task as a record
        message = ("failed", as_rank_failure(rank, exc).record())
    send.send(message)
    send.close()


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)
