"""The fits of a tuning's grid (TrainValidationSplit and CrossValidator call Estimator.fitMultiple): each grid point
is a run of its own in the store, named after the point (`<run_id>-grid<i>`: a run_id set on the estimator never
has two points resume each other's checkpoints), and, under the MLflow run active where the tuning was called, a
child run of it named the same. The tuning runs each fit in a thread of its pool, where MLflow sees no active run:
the parent is read once, in the caller's thread. Fits side by side (`parallelism` > 1) that need more barrier
slots than the application has say so: their barrier stages wait for each other. No pyspark."""
from __future__ import annotations

import contextlib
import logging
import sys
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

log = logging.getLogger("estimator")


@dataclass
class Grid:
    """One fitMultiple's grid: the MLflow run its fits are children of, and how many of them are running."""

    parent_run: Optional[str] = None  # the MLflow run active where the tuning was called
    experiment: Optional[str] = None  # its experiment (a pool thread has no active experiment of its own)
    running: int = 0
    warned: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def here(cls) -> "Grid":
        """The grid of a fitMultiple called in this thread (MLflow's active run read only if mlflow is imported:
        a run can only be active then)."""
        mlflow = sys.modules.get("mlflow")
        active = mlflow.active_run() if mlflow is not None else None
        if active is None:
            return cls()
        return cls(parent_run=active.info.run_id, experiment=active.info.experiment_id)

    @contextlib.contextmanager
    def fitting(self) -> Iterator[None]:
        """Counts a fit running (in any of the tuning's threads)."""
        with self.lock:
            self.running += 1
        try:
            yield
        finally:
            with self.lock:
                self.running -= 1

    def check_slots(self, num_proc_tasks: int, slots: Optional[int]) -> None:
        """Warns once where the fits running now need more barrier tasks (`num_proc_tasks` each) than the
        application's `slots`: the tuning's parallelism then buys nothing for them."""
        with self.lock:
            running = self.running
            tell = bool(slots) and running * num_proc_tasks > slots and not self.warned
            self.warned = self.warned or tell
        if not tell:
            return
        side_by_side = max(slots // num_proc_tasks, 1)
        message = (f"{running} fits of the grid run at once (the tuning's parallelism), each of {num_proc_tasks} "
                   f"barrier tasks, and this Spark application has {slots} task slots: a fit's barrier stage waits "
                   f"until {num_proc_tasks} slots are free, so at most {side_by_side} run side by side. Set "
                   f"parallelism={side_by_side} (or lower num_proc, or add executors).")
        log.warning(message)
        warnings.warn(message, UserWarning, stacklevel=2)


@dataclass(frozen=True)
class GridPoint:
    """A fit's place in a grid: the grid, and the index of its param map (the tuning's validationMetrics')."""

    grid: Grid
    index: int

    def run_id(self, given: Any) -> str:
        """The store's run of this point: the estimator's run_id (or a new one) and the point's index."""
        return f"{given}-grid{self.index}"
