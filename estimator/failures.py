"""What failed on a rank, as types: the kind of failure (FailureKind: the driver retries or not from it), and the
exception that carries it to the driver (RankFailed: its rank, its own exception line and traceback). No torch
needed to import it: the data layer's exceptions name their kind with FailureKind members."""
from __future__ import annotations

import enum
import re
import time
import traceback
from typing import Optional


class FailureKind(str, enum.Enum):
    """What failed on a rank. The driver decides from it whether another launch can help."""

    RENDEZVOUS = "rendezvous"  # the ranks did not all meet (late, unreachable)
    PEER = "peer"  # this rank stopped because another rank failed: never the cause
    USER = "user"  # an exception from the model, loss, transformation_fn... or anything not named below
    NAN = "nan"  # a non-finite loss with terminate_on_nan: it would recur
    READ = "read"  # reading the training data from the store
    WRITE = "write"  # writing a checkpoint to the store
    WORKER_DEATH = "worker_death"  # the rank's Python worker died without an error (killed, out of memory)
    DATA = "data"  # the DataFrame's rows cannot be trained on (the direct mode checks them on the ranks): they recur
    ENVIRONMENT = "environment"  # the executor's Python lacks a module the ranks import: it recurs
    USAGE = "usage"  # a train_fn that breaks its contract (no epoch reported, its own process group): it recurs
    MODEL = "model"  # the model's forward failed on the first batch (checked there, not on the driver): it recurs

    @property
    def retryable(self) -> bool:
        return self not in (FailureKind.NAN, FailureKind.DATA, FailureKind.ENVIRONMENT, FailureKind.USAGE,
                            FailureKind.MODEL)


class RankFailed(RuntimeError):
    """A rank failed. The message's first line is `rank N: <its exception type>: <message>`, then its Python
    traceback once.

    Attributes:
        rank: The rank that failed.
        summary: The exception's line, `<type>: <message>`.
        formatted: The rank's traceback, or the explanation when the rank left none (e.g. a crashed worker).
        kind: What failed (a FailureKind): whether another launch can help.
        at: When the rank met the failure (seconds since the epoch).
    """

    default_kind = FailureKind.USER

    def __init__(self, rank: int, formatted: str, summary: Optional[str] = None,
                 kind: Optional[FailureKind] = None, at: Optional[float] = None):
        self.rank, self.formatted = rank, formatted.rstrip()
        # when the rank met it: the driver takes the earliest cause, whatever order the records are written in (a
        # peer's echo of it, e.g. gloo's "Connection closed by peer", can be written first)
        self.at = time.time() if at is None else at
        self.summary = summary or exception_line(self.formatted)
        self.kind = FailureKind(kind) if kind is not None else self.default_kind
        body = "" if self.formatted == self.summary else "\n" + self.formatted
        super().__init__(f"rank {rank}: {self.summary}{body}")

    def __reduce__(self):  # crosses process boundaries (LocalLauncher's pool) with its own arguments
        return type(self), (self.rank, self.formatted, self.summary, self.kind, self.at)

    def record(self) -> dict:
        """What a rank leaves in the store for the driver (launcher.launch_failure reads it back)."""
        return {"rank": self.rank, "kind": self.kind.value, "summary": self.summary, "formatted": self.formatted,
                "rendezvous": isinstance(self, RendezvousFailed), "time": self.at}

    @staticmethod
    def from_record(record: dict) -> "RankFailed":
        cls = RendezvousFailed if record.get("rendezvous") else RankFailed
        return cls(int(record["rank"]), record["formatted"], record["summary"], FailureKind(record["kind"]),
                   record.get("time"))


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
        if _is_dist_error(current):
            return FailureKind.PEER
        if isinstance(current, ImportError):
            return FailureKind.ENVIRONMENT
        current = current.__cause__ or current.__context__
    return FailureKind.USER


def as_rank_failure(rank: int, exc: BaseException) -> RankFailed:
    """`exc`, raised on rank `rank` (inside an except block), as the RankFailed the driver sees."""
    if isinstance(exc, RankFailed):
        return exc
    summary = f"{type(exc).__name__}: {exc}".splitlines()[0]
    kind = failure_kind(exc)
    if kind is FailureKind.ENVIRONMENT:  # which Python lacks it, where: spark.pyspark.python may not be what ran
        import socket
        import sys

        summary += (f" (executor {socket.gethostname()}, Python {sys.executable} {sys.version.split()[0]}). Install "
                    "it in the executors' Python (README 'On a cluster' lists what they need), or point "
                    "PYSPARK_PYTHON at a Python that has it.")
    return RankFailed(rank, traceback.format_exc(), summary, kind)


def exception_line(formatted: str) -> str:
    """`Type: message` from a formatted traceback (its last unindented `Name: ...` line), else the first line."""
    lines = [line for line in formatted.splitlines() if line.strip()]
    if lines and lines[0].startswith("Traceback (most recent call last)"):
        named = [line for line in lines if re.match(r"[A-Za-z_][\w.]*(: |$)", line)]
        if named:
            return named[-1]
    return lines[0] if lines else ""


class NotEnoughSlots(RuntimeError):
    """A retry found fewer task slots than the ranks it may run on (min_num_proc), and they did not come back
    within rendezvous_timeout: no barrier stage is launched that Spark could not schedule."""


class RunInUse(RuntimeError):
    """Another launch still trains the run (its heartbeat goes on): a fit does not read, resume or return a
    checkpoint that another launch is writing."""


class RunMismatch(ValueError):
    """A fit under the run_id of a run that trained other rows or with other params (estimator.fit.run_identity):
    it would continue that run, or return its model. Raised before anything trains."""


class RendezvousFailed(RankFailed):
    """The ranks did not all meet (a rank did not arrive in time, or could not reach rank 0)."""

    default_kind = FailureKind.RENDEZVOUS


def _is_dist_error(exc: BaseException) -> bool:
    """A torch.distributed error: a peer went away. torch is imported only where a rank failed (it is there). gloo's
    transport raises a plain RuntimeError naming its source ('.../gloo/transport/tcp/pair.cc:537] Read error
    [127.0.0.1]:57032: Connection reset by peer'): a collective whose peer died, never the cause."""
    import torch.distributed as dist

    return isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and "gloo/transport/" in str(exc))
