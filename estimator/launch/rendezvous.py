"""How the ranks meet, without waiting on Spark: every task knows every task's host from the barrier task's
infos; rank 0's task opens a TCPStore and leaves its port in the launch's folder of the store (the others poll
for it: milliseconds on a local or mounted store), and every rank checks in at that TCPStore, carrying what the
others must know (its GPUs, and in the direct mode its row count). Spark's `allGather` is not used: each call
costs about a second, since Spark polls. Each step has the rendezvous timeout, and a rank that does not arrive is
named (its rank and host) instead of a generic timeout minutes later. pyspark is not imported here."""
from __future__ import annotations

import json
import logging
import time
from datetime import timedelta
from typing import Any, List, Optional, Sequence, Tuple

import torch.distributed as dist
from torch.distributed import TCPStore

from estimator.failures import FailureKind, RendezvousFailed

log = logging.getLogger("estimator")

LATE_AT_CHECKIN = ("A rank is late when loading the model/data spec or initializing its device takes longer: raise "
                   "rendezvous_timeout, or look at that executor's log.")
UNREACHABLE = ("Executors must reach each other on ephemeral TCP ports; check firewalls and network security groups "
               "between executors.")
LATE_TO_START = ("Their tasks started but their Python workers were still starting, importing torch or loading the "
                 "training spec: raise rendezvous_timeout, or look at those executors' logs.")


def check_in(store: dist.Store, rank: int, hosts: Sequence[str], timeout: float, message: str = "",
             step: str = "checkin", late: str = "arrive", advice: str = LATE_AT_CHECKIN,
             who: Optional[Sequence[str]] = None) -> List[str]:
    """Every rank checks in at rank 0's store with `message`; returns every rank's message, in rank order.

    Rank 0 waits for all of them (the store answers as each arrives: no polling interval) and, after `timeout`
    seconds, names the ranks (and hosts) that did not `late` ("arrive"); the others wait for rank 0's verdict.
    `step` keeps two check-ins on one store apart; `who` names the participants (default: "rank r").
    """
    keys = [f"{step}/{r}" for r in range(len(hosts))]
    store.set(keys[rank], message)
    if rank == 0:
        try:
            store.wait(keys, timedelta(seconds=timeout))
        except Exception:  # noqa: BLE001 - the store's timeout: name who is missing
            waiting = [r for r in range(1, len(hosts)) if not store.check([keys[r]])]
            if waiting:
                missing = ", ".join(f"{who[r] if who else f'rank {r}'} (host {hosts[r]})" for r in waiting)
                verdict = (f"{missing} did not {late} within rendezvous_timeout={timeout:g} s; "
                           f"{len(hosts) - len(waiting)} of {len(hosts)} ranks did. {advice}")
                store.set(f"{step}/verdict", verdict)
                time.sleep(0.5)  # let the waiting ranks read the verdict before this store goes away
                raise RendezvousFailed(0, verdict) from None
        store.set(f"{step}/verdict", "ok")
    else:
        try:
            store.wait([f"{step}/verdict"], timedelta(seconds=timeout + 30))
        except Exception as exc:  # noqa: BLE001 - a timeout, or rank 0's store went away
            if "timeout" in str(exc).lower() or "timed out" in str(exc).lower():
                raise RendezvousFailed(rank, f"rank 0 (host {hosts[0]}) gave no verdict within rendezvous_timeout="
                                             f"{timeout:g} s (+30 s): {type(exc).__name__}: {exc}") from None
            time.sleep(2)  # rank 0 failed first: let its own error reach the driver before this echo
            raise RendezvousFailed(rank, f"rank {rank} lost rank 0's rendezvous store (host {hosts[0]}): rank 0 "
                                         f"failed or was stopped ({type(exc).__name__}: {exc})",
                                   kind=FailureKind.PEER) from None
        verdict = store.get(f"{step}/verdict").decode()
        if verdict != "ok":
            raise RendezvousFailed(rank, verdict)
    return [store.get(key).decode() for key in keys]


def publish(store: Any, path: str, host: str, port: int) -> None:
    """Rank 0: where its TCPStore listens, for the other ranks (find_rank0)."""
    store.write_bytes_atomic(path, json.dumps({"host": host, "port": port}).encode())


def find_rank0(store: Any, path: str, rank: int, hosts: Sequence[str], timeout: float) -> Tuple[int, TCPStore]:
    """The port of rank 0's TCPStore, read from the launch's folder as soon as rank 0 has written it (polled
    every 2 ms at first, backing off to 0.1 s: a remote store's request costs more), and a connection to it.
    An address that refuses (left by an earlier attempt of a retried barrier stage) is read again, until
    `timeout` seconds have passed."""
    deadline, delay, refused = time.monotonic() + timeout, 0.002, None
    while True:
        port = _published_port(store, path)
        if port is not None:
            try:
                return port, _client(hosts[0], port, len(hosts), max(1.0, min(10.0, deadline - time.monotonic())),
                                     timeout)
            except Exception as exc:  # noqa: BLE001 - read the address again until the deadline
                refused = exc
        if time.monotonic() > deadline:
            if refused is not None:
                raise _unreachable(rank, hosts[0], port, timeout, refused)
            raise RendezvousFailed(rank, f"rank 0 (host {hosts[0]}) did not reach the rendezvous within "
                                         f"rendezvous_timeout={timeout:g} s (rank {rank} waited for its store's "
                                         f"address). {LATE_TO_START}")
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


def _published_port(store: Any, path: str) -> Optional[int]:
    try:
        return int(json.loads(store.read_bytes(path))["port"]) if store.exists(path) else None
    except (FileNotFoundError, ValueError, KeyError):  # written atomically; a half-listed write reads next time
        return None


def connect(rank: int, host: str, port: int, world: int, timeout: float) -> TCPStore:
    """A connection to rank 0's TCPStore at an address already known (a rank whose task did not connect for it)."""
    try:
        return _client(host, port, world, timeout, timeout)
    except Exception as exc:  # noqa: BLE001 - unreachable rank 0: say which address and why it matters
        raise _unreachable(rank, host, port, timeout, exc) from None


def _client(host: str, port: int, world: int, wait: float, timeout: float) -> TCPStore:
    """A client of rank 0's TCPStore: `wait` seconds to connect, then `timeout` for each wait on it."""
    client = TCPStore(host, port, world, is_master=False, timeout=timedelta(seconds=wait))
    if wait != timeout:
        client.set_timeout(timedelta(seconds=timeout))
    return client


def _unreachable(rank: int, host: str, port: int, timeout: float, exc: Exception) -> RendezvousFailed:
    return RendezvousFailed(rank, f"rank {rank} could not connect to rank 0's rendezvous store at {host}:{port} "
                                  f"within rendezvous_timeout={timeout:g} s ({type(exc).__name__}: {exc}). "
                                  f"{UNREACHABLE}")
