"""Failure injection for tests: make a chosen rank sleep, raise or die at a named point.

Faults are read once on the driver from the environment variable SPARK_TORCH_ESTIMATOR_FAULTS (a JSON
list) and travel to the ranks inside the launch, so tests can kill a Python worker mid-epoch or delay a
rank's rendezvous without changing the code under test. Nothing happens when the variable is unset.

    [{"point": "epoch", "rank": 1, "action": "exit", "epoch": 2, "attempt": 0}]

points: "before_barrier" (before the tasks meet), "before_checkin" (after they met, before the torch
rendezvous), "read" (the rank's Arrow shard read, which runs on a thread during the rendezvous),
"epoch" (at the start of an epoch; "epoch" selects which, 1-based), "step" (before each training batch;
"step" selects the optimizer step it leads to, 1-based over the whole run), "checkpoint_write" (rank 0's
checkpoint write, in the writer's thread: "epoch" selects the finished epochs the checkpoint holds, "step" its
optimizer steps; "sleep" makes the store slow).
actions: "sleep" ("seconds"), "raise", "exit" (os._exit: the Python worker dies without cleanup).
"attempt" (optional) limits the fault to one launch attempt (0 = the first).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Optional, Tuple

ENV = "SPARK_TORCH_ESTIMATOR_FAULTS"
POINTS = ("before_barrier", "before_checkin", "read", "epoch", "step", "checkpoint_write")
ACTIONS = ("sleep", "raise", "exit")


class InjectedFault(RuntimeError):
    pass


@dataclass(frozen=True)
class Fault:
    point: str
    rank: int
    action: str
    seconds: float = 0.0
    epoch: Optional[int] = None
    attempt: Optional[int] = None
    step: Optional[int] = None

    def matches(self, point: str, rank: int, attempt: int, epoch: Optional[int], step: Optional[int]) -> bool:
        return (self.point == point and self.rank == rank and (self.attempt is None or self.attempt == attempt)
                and (self.epoch is None or self.epoch == epoch) and (self.step is None or self.step == step))


def from_env() -> Tuple[Fault, ...]:
    text = os.environ.get(ENV)
    if not text:
        return ()
    faults = tuple(Fault(**item) for item in json.loads(text))
    for fault in faults:
        if fault.point not in POINTS or fault.action not in ACTIONS:
            raise ValueError(f"{ENV}: unknown point or action in {fault}; points {POINTS}, actions {ACTIONS}.")
    return faults


def inject(faults: Tuple[Fault, ...], point: str, rank: int, attempt: int = 0, epoch: Optional[int] = None,
           step: Optional[int] = None) -> None:
    for fault in faults:
        if not fault.matches(point, rank, attempt, epoch, step):
            continue
        if fault.action == "sleep":
            time.sleep(fault.seconds)
        elif fault.action == "raise":
            raise InjectedFault(f"injected fault at {point} on rank {rank} (attempt {attempt}, epoch {epoch}"
                                + (f", step {step})" if step is not None else ")"))
        else:
            os._exit(17)
