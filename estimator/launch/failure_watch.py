"""A failed launch ends quietly: the ranks' tasks end by themselves, and the driver raises the failure once.

When a rank's Python raises out of a barrier task, Spark logs its traceback and the Java frames twice (the
executor's ERROR and the scheduler's WARN: about 130 lines for one failure on 2 ranks in local mode) before the
driver can say anything. Instead, a failing rank leaves its record in the launch folder and waits. The driver's
`FailureWatch` sees the cause's record and writes the stop marker once every rank has a record (the peers
fail too once the cause leaves the process group); the ranks then end their tasks normally, with an empty
result, and the driver raises the failure from the records (`launcher.launch_failure`). A rank that does not
fail in `grace` seconds (stuck in a collective) is stopped by cancelling the job by its tag: a line per task.
A rank whose driver writes no stop marker within `wait` seconds raises to Spark as before: nothing is lost.
Nothing of the user's other Spark work, or of the session's log settings, is touched.
"""
from __future__ import annotations

import json
import logging
import posixpath
import threading
import time
from typing import Any, Callable, Dict, Optional

log = logging.getLogger("estimator")


class FailureWatch:
    """Polls a launch's folder while its ranks run (`interval` s). Once a record names a cause (a record that is
    not a peer's echo of another rank's failure, or peers' records that stood `grace` s without one): the stop
    marker when every rank has a record, or, after `grace` s more, the marker and `cancel` (the job's tag)."""

    def __init__(self, store: Any, run: Any, launch_id: str, num_proc: int, cancel: Callable[[], None],
                 interval: float = 0.5, grace: float = 3.0):
        self.store, self.run, self.launch_id, self.num_proc, self.cancel = store, run, launch_id, num_proc, cancel
        self.interval, self.grace = interval, grace
        self.names = {posixpath.basename(run.failure(launch_id, rank)) for rank in range(num_proc)}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rank-failure-watch", daemon=True)

    def __enter__(self) -> "FailureWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._done.set()
        self._thread.join()

    def _loop(self) -> None:
        first_seen: Optional[float] = None
        caused: Optional[float] = None
        while not self._done.wait(self.interval):
            try:
                kinds = self._records()
            except Exception:  # noqa: BLE001 - a read may race a write; the next poll sees it
                log.debug("could not read the failure records of launch %s", self.launch_id, exc_info=True)
                continue
            if not kinds:
                continue
            now = time.monotonic()
            first_seen = first_seen or now
            if caused is None and (any(k != "peer" for k in kinds.values()) or now - first_seen >= self.grace):
                caused = now
            if caused is None:
                continue
            if len(kinds) >= self.num_proc:
                self._stop(cancel=False)
                return
            if now - caused >= self.grace:
                self._stop(cancel=True)
                return

    def _records(self) -> Dict[str, str]:
        folder = self.run.launch(self.launch_id)
        if not self.store.exists(folder):
            return {}
        return {posixpath.basename(path): json.loads(self.store.read_bytes(path)).get("kind", "user")
                for path in self.store.ls(folder) if posixpath.basename(path) in self.names}

    def _stop(self, cancel: bool) -> None:
        log.debug("launch %s failed: ending its tasks%s", self.launch_id, " and cancelling its job" if cancel else "")
        try:
            self.store.write_bytes_atomic(self.run.stop(self.launch_id), b"stop")
        except Exception:  # noqa: BLE001 - the ranks raise by themselves after their wait
            log.debug("could not write the stop marker", exc_info=True)
        if cancel:
            try:
                self.cancel()
            except Exception:  # noqa: BLE001 - as above
                log.debug("could not cancel the training job", exc_info=True)


def stopped_by_driver(store: Any, marker: str, seconds: float, interval: float = 0.2) -> bool:
    """On a rank that left its failure record: wait for the driver's stop marker; False after `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if store.exists(marker):
                return True
        except Exception:  # noqa: BLE001 - keep waiting; the deadline still holds
            log.debug("could not look for the stop marker", exc_info=True)
        time.sleep(interval)
    return False
