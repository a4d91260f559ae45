"""Who am I, who are my peers: process-group setup and teardown for one rank. torch only.

The launcher finds the peers (Spark barrier tasks, or local processes) and hands each rank a
connected `TCPStore`; everything after that is the same everywhere.
"""
from __future__ import annotations

import dataclasses
import enum
import gc
import logging
import os
import re
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

import torch
import torch.distributed as dist

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


class FailureKind(str, enum.Enum):
    """What failed on a rank. The driver decides from it whether another launch can help."""

    RENDEZVOUS = "rendezvous"  # the ranks did not all meet (late, unreachable)
    PEER = "peer"  # this rank stopped because another rank failed: never the cause
    USER = "user"  # an exception from the model, loss, transformation_fn... or anything not named below
    NAN = "nan"  # a non-finite loss with terminate_on_nan: it would recur
    READ = "read"  # reading the training data from the store
    WORKER_DEATH = "worker_death"  # the rank's Python worker died without an error (killed, out of memory)
    DATA = "data"  # the DataFrame's rows cannot be trained on (the direct mode checks them on the ranks): they recur

    @property
    def retryable(self) -> bool:
        return self not in (FailureKind.NAN, FailureKind.DATA)


class RankFailed(RuntimeError):
    """A rank failed. The message's first line is `rank N: <its exception type>: <message>`, then its Python
    traceback once. `summary` is that exception line, `formatted` the traceback (or the explanation when the
    rank left none, e.g. a crashed worker); `kind` says what failed."""

    default_kind = FailureKind.USER

    def __init__(self, rank: int, formatted: str, summary: Optional[str] = None,
                 kind: Optional[FailureKind] = None):
        self.rank, self.formatted = rank, formatted.rstrip()
        self.summary = summary or exception_line(self.formatted)
        self.kind = FailureKind(kind) if kind is not None else self.default_kind
        body = "" if self.formatted == self.summary else "\n" + self.formatted
        super().__init__(f"rank {rank}: {self.summary}{body}")

    def __reduce__(self):  # crosses process boundaries (LocalLauncher's pool) with its own arguments
        return type(self), (self.rank, self.formatted, self.summary, self.kind)

    def record(self) -> dict:
        """What a rank leaves in the store for the driver (launcher.launch_failure reads it back)."""
        return {"rank": self.rank, "kind": self.kind.value, "summary": self.summary, "formatted": self.formatted,
                "rendezvous": isinstance(self, RendezvousFailed), "time": time.time()}

    @staticmethod
    def from_record(record: dict) -> "RankFailed":
        cls = RendezvousFailed if record.get("rendezvous") else RankFailed
        return cls(int(record["rank"]), record["formatted"], record["summary"], FailureKind(record["kind"]))


def failure_kind(exc: BaseException) -> FailureKind:
    """The kind of an exception raised on a rank: named by the exception (its `failure_kind`, on it or on an
    exception it was raised from), a torch.distributed error (a peer went away), else the user's code."""
    seen = set()
    current: Optional[BaseException] = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, RankFailed):
            return current.kind
        named = getattr(current, "failure_kind", None)
        if named is not None:
            return FailureKind(named)
        if isinstance(current, dist.DistError):
            return FailureKind.PEER
        current = current.__cause__ or current.__context__
    return FailureKind.USER


def as_rank_failure(rank: int, exc: BaseException) -> RankFailed:
    """`exc`, raised on rank `rank` (inside an except block), as the RankFailed the driver sees."""
    if isinstance(exc, RankFailed):
        return exc
    summary = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return RankFailed(rank, traceback.format_exc(), summary, failure_kind(exc))


def exception_line(formatted: str) -> str:
    """`Type: message` from a formatted traceback (its last unindented `Name: ...` line), else the first line."""
    lines = [line for line in formatted.splitlines() if line.strip()]
    if lines and lines[0].startswith("Traceback (most recent call last)"):
        named = [line for line in lines if re.match(r"[A-Za-z_][\w.]*(: |$)", line)]
        if named:
            return named[-1]
    return lines[0] if lines else ""


class RendezvousFailed(RankFailed):
    """The ranks did not all meet (a rank did not arrive in time, or could not reach rank 0)."""

    default_kind = FailureKind.RENDEZVOUS


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


def task_gpus(task: Any) -> List[str]:
    """The GPU addresses Spark assigned to a task (spark.task.resource.gpu.amount), from its TaskContext;
    empty without a task or without GPUs."""
    gpu = task.resources().get("gpu") if task is not None else None
    return list(gpu.addresses) if gpu is not None and gpu.addresses else []


def assigned_gpu(task: Any) -> Optional[str]:
    """The first GPU address Spark assigned to a task; None without a task or without GPUs."""
    addresses = task_gpus(task)
    return addresses[0] if addresses else None


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
    dist.init_process_group(ctx.backend, store=store, rank=ctx.rank, world_size=ctx.world_size, timeout=timeout)
    failure: Optional[RankFailed] = None
    result: Optional[T] = None
    try:
        result = work(ctx)
        finished = time.perf_counter()
        dist.barrier()  # nobody tears down while a peer still needs the group
    except Exception as exc:  # noqa: BLE001 - re-raised below, after teardown, with the traceback as text
        failure = as_rank_failure(ctx.rank, exc)
        if failure is exc:  # keep its kind, not its frames: they hold DDP
            failure = type(exc)(ctx.rank, traceback.format_exc(), exc.summary, exc.kind)
    # The traceback (and the frames holding DDP) is released once the except block ends.
    gc.collect()
    dist.destroy_process_group()
    if failure is not None:
        raise failure
    if dataclasses.is_dataclass(result) and hasattr(result, "teardown_seconds"):
        result = dataclasses.replace(result, teardown_seconds=time.perf_counter() - finished)
    return result  # type: ignore[return-value]
