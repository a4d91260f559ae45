"""Live training progress on the driver: poll the run's progress file while the ranks train.

Rank 0 rewrites `runs/<run_id>/progress.json` after every epoch; this watcher reads it every
`interval` seconds in a background thread and reports each new epoch once, so per-epoch numbers show
up on the driver (a notebook cell, SparkBackend's stdout) during training, not only in executor logs.
"""
from __future__ import annotations

import json
import logging
import threading
from typing import Any, Callable, Dict, List

from store import RunLayout, Store

log = logging.getLogger("estimator")


class ProgressWatcher:
    def __init__(self, store: Store, run: RunLayout, report: Callable[[Dict[str, Any]], None], interval: float = 1.0):
        self.store, self.run, self.report, self.interval = store, run, report, interval
        self.seen = 0
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
        if not self.store.exists(self.run.progress):
            return
        history: List[Dict[str, Any]] = json.loads(self.store.read_bytes(self.run.progress))
        for row in history[self.seen:]:
            self.report(row)
        self.seen = max(self.seen, len(history))
