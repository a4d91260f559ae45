"""How the ranks meet, in two steps, each with the rendezvous timeout: Spark's barrier (one `allGather`: the
tasks' hosts, GPUs and rank 0's store port; each call costs about a second, since Spark polls), then every rank
checks in at rank 0's TCPStore before the process group starts, so that a missing rank is named (its rank and
host) instead of a generic timeout minutes later. pyspark is not imported here: the barrier task is passed in."""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch.distributed as dist
from torch.distributed import TCPStore

from estimator.core.spec import TrainSpec
from estimator.failures import FailureKind, RendezvousFailed

log = logging.getLogger("estimator")


def check_in(store: dist.Store, rank: int, hosts: Sequence[str], timeout: float, poll: float = 0.05) -> None:
    """Every rank checks in at rank 0's store before the process group starts.

    Rank 0 waits for all of them and, after `timeout` seconds, names the ranks (and hosts) that did not
    arrive; the others wait for rank 0's verdict. Without this a missing rank shows up as a generic
    store timeout minutes later.
    """
    store.set(f"checkin/{rank}", hosts[rank])
    if rank == 0:
        deadline = time.monotonic() + timeout
        waiting = list(range(1, len(hosts)))
        while True:
            waiting = [r for r in waiting if not store.check([f"checkin/{r}"])]
            if not waiting:
                store.set("checkin/verdict", "ok")
                return
            if time.monotonic() > deadline:
                missing = ", ".join(f"rank {r} (host {hosts[r]})" for r in waiting)
                verdict = (f"{missing} did not arrive within rendezvous_timeout={timeout:g} s; {len(hosts) - len(waiting)}"
                           f" of {len(hosts)} ranks did. A rank is late when loading the model/data spec or "
                           "initializing its device takes longer: raise rendezvous_timeout, or look at that "
                           "executor's log.")
                store.set("checkin/verdict", verdict)
                time.sleep(0.5)  # let the waiting ranks read the verdict before this store goes away
                raise RendezvousFailed(0, verdict)
            time.sleep(poll)
    try:
        store.wait(["checkin/verdict"], timedelta(seconds=timeout + 30))
        verdict = store.get("checkin/verdict").decode()
    except Exception as exc:  # noqa: BLE001 - a timeout, or rank 0's store went away
        if "timeout" in str(exc).lower() or "timed out" in str(exc).lower():
            raise RendezvousFailed(rank, f"rank 0 (host {hosts[0]}) gave no verdict within rendezvous_timeout="
                                         f"{timeout:g} s (+30 s): {type(exc).__name__}: {exc}") from None
        time.sleep(2)  # rank 0 failed first: let its own error reach the driver before this echo
        raise RendezvousFailed(rank, f"rank {rank} lost rank 0's rendezvous store (host {hosts[0]}): rank 0 "
                                     f"failed or was stopped ({type(exc).__name__}: {exc})",
                               kind=FailureKind.PEER) from None
    if verdict != "ok":
        raise RendezvousFailed(rank, verdict)


def announce(spec: TrainSpec, ranks: range, host: str) -> threading.Thread:
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


def all_gather(task: Any, message: str, timeout: float,
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


def late_at_barrier(spec: TrainSpec, rank: int, hosts: List[str], timeout: float) -> str:
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


def connect(rank: int, host: str, port: int, world: int, timeout: float) -> TCPStore:
    try:
        return TCPStore(host, port, world, is_master=False, timeout=timedelta(seconds=timeout))
    except Exception as exc:  # noqa: BLE001 - unreachable rank 0: say which address and why it matters
        raise RendezvousFailed(rank, f"rank {rank} could not connect to rank 0's rendezvous store at {host}:{port} "
                                     f"within rendezvous_timeout={timeout:g} s ({type(exc).__name__}: {exc}). "
                                     "Executors must reach each other on ephemeral TCP ports; check firewalls "
                                     "and network security groups between executors.") from None
