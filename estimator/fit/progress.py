"""Live training progress on the driver: poll the run's progress file while the ranks train.

Rank 0 rewrites `runs/<run_id>/progress.json` after every epoch; this watcher reads it every
`interval` seconds in a background thread and reports each new epoch once, so per-epoch numbers show
up on the driver (a notebook cell, SparkBackend's stdout) during training, not only in executor logs.
With verbose=2 rank 0 also rewrites `steps.json` (the epoch's batch, rows/s, running loss) about once a
second, which `StepBar` shows as a tqdm progress bar (a widget in notebooks).
"""
from __future__ import annotations

import importlib.util
import json
import logging
import sys
import threading
from typing import Any, Callable, Dict, List, Optional

from store import RunLayout, Store

log = logging.getLogger("estimator")


class ProgressWatcher:
    def __init__(self, store: Store, run: RunLayout, report: Callable[[Dict[str, Any]], None], interval: float = 1.0,
                 steps: Optional[Callable[[Dict[str, Any]], None]] = None, seen: int = 0):
        """`seen`: the epochs the run had already finished when this launch began (a resumed run's), not
        reported again."""
        self.store, self.run, self.report, self.interval, self.steps = store, run, report, interval, steps
        self.seen = seen
        self.step_state: Optional[Dict[str, Any]] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="training-progress", daemon=True)

    def __enter__(self) -> "ProgressWatcher":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.poll()  # the last epochs, written just before the job ended

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.poll()
            except Exception as e:  # noqa: BLE001 - progress is best effort; training goes on
                log.debug("progress poll failed: %s", e)

    def poll(self) -> None:
        if self.steps is not None and self.store.exists(self.run.steps):
            state = json.loads(self.store.read_bytes(self.run.steps))
            if state != self.step_state and state["epoch"] > self.seen:  # not an epoch already reported
                self.step_state = state
                self.steps(state)
        if not self.store.exists(self.run.progress):
            return
        history: List[Dict[str, Any]] = json.loads(self.store.read_bytes(self.run.progress))
        for row in history[self.seen:]:
            self.report(row)
        self.seen = max(self.seen, len(history))


class StepBar:
    """verbose=2: the running epoch as a tqdm bar (tqdm.auto: a widget in notebooks), on stderr like the epoch
    lines. `StepBar.open` gives None (and says so once) without tqdm."""

    _said = False

    def __init__(self, file: Any = None):
        from tqdm.auto import tqdm

        self.tqdm, self.file = tqdm, file if file is not None else sys.stderr
        self.bar: Any = None
        self.epoch: Optional[int] = None

    @classmethod
    def open(cls, verbose: int) -> Optional["StepBar"]:
        if verbose < 2:
            return None
        if importlib.util.find_spec("tqdm") is None:
            if not cls._said:
                cls._said = True
                log.warning("verbose=2 shows a progress bar of each epoch's steps with tqdm, which is not installed "
                            "(pip install tqdm); the epoch lines still print.")
            return None
        return cls()

    def update(self, state: Dict[str, Any]) -> None:
        if state["epoch"] != self.epoch:
            self.close()
            self.epoch = state["epoch"]
            # initial: the steps done before the bar opened are not counted as done in no time (tqdm's batch/s)
            self.bar = self.tqdm(total=state["steps"], initial=state["step"], desc=f"epoch {state['epoch']}",
                                 unit="batch", file=self.file, leave=False, dynamic_ncols=True)
        elif state["step"] > self.bar.n:
            self.bar.update(state["step"] - self.bar.n)  # tqdm's rate: the steps over the time between two reads
        postfix = {"rows/s": f"{state['rows_per_second']:.0f}"}
        if state.get("loss") is not None:
            postfix["loss"] = f"{state['loss']:.4f}"
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        """Before an epoch's line is printed (and at the end), so the line does not land inside the bar."""
        if self.bar is not None:
            self.bar.close()
            self.bar, self.epoch = None, None
