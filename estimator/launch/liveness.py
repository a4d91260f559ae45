"""Is a launch of this run still training? Rank 0's task beats a file of the run while it trains, so that a fit
never reads, resumes or returns the checkpoint of a launch still writing it: one left running by an interrupted
fit of an older release, or by a fit of the same run_id in another notebook. And every task ends its process
once its driver has stopped waiting for it (LaunchWatch).

A beat is a counter, not a clock: the driver compares two reads, so hosts with skewed clocks cannot fool it."""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from typing import Any, Callable, Dict, Optional

from estimator.failures import RunInUse

log = logging.getLogger("estimator")
BEAT_S = 2.0  # how often the task of rank 0 rewrites the file
STALE_BEATS = 4  # a file unchanged for this many beats is a launch that died without removing it


class LaunchWatch:
    """On every task of a launch, for as long as it trains. The driver removes the launch's folder once it stops
    waiting for the launch (it ended, failed or was interrupted with Ctrl-C): a task that finds the folder gone
    has nobody to report to, so it ends its process (the ranks' last checkpoint is whole: checkpoints are written
    atomically), whether or not Spark's cancellation reached it. On rank 0's task (`beats`) it also rewrites
    `run.alive` every `interval` s, and removes it at the end."""

    def __init__(self, store: Any, run: Any, launch_id: str, beats: bool, interval: float = BEAT_S,
                 end: Callable[[int], None] = os._exit):
        self.store, self.run, self.launch_id, self.beats, self.interval = store, run, launch_id, beats, interval
        self.end = end
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="launch-watch", daemon=True)
        self._beat = 0

    def __enter__(self) -> "LaunchWatch":
        if self.beats:
            self._write()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._done.set()
        self._thread.join()
        if self.beats:
            remove_if_ours(self.store, self.run, self.launch_id)

    def _loop(self) -> None:
        while not self._done.wait(self.interval):
            if self.beats:
                self._write()
            if not self._launch_there():
                log.warning("Launch %s: its driver stopped waiting for it (interrupted or failed); ending this "
                            "task's process", self.launch_id)
                if self.beats:
                    remove_if_ours(self.store, self.run, self.launch_id)
                self.end(1)
                return

    def _launch_there(self) -> bool:
        try:
            return self.store.exists(self.run.launch_spec(self.launch_id))
        except Exception:  # noqa: BLE001 - a store that does not answer now says nothing about the driver
            return True

    def _write(self) -> None:
        self._beat += 1
        try:
            self.store.write_bytes_atomic(self.run.alive, json.dumps(
                {"launch": self.launch_id, "beat": self._beat, "host": socket.gethostname(),
                 "pid": os.getpid()}).encode())
        except Exception:  # noqa: BLE001 - a missed beat is not a failure of training
            log.debug("could not write the heartbeat of launch %s", self.launch_id, exc_info=True)


def read_beat(store: Any, run: Any) -> Optional[Dict[str, Any]]:
    try:
        return json.loads(store.read_bytes(run.alive)) if store.exists(run.alive) else None
    except (OSError, ValueError):  # removed or rewritten while read: read again at the next look
        return {}


def remove_if_ours(store: Any, run: Any, launch_id: str) -> None:
    """The file gone, unless another launch has rewritten it since (never remove a live launch's beat)."""
    try:
        beat = read_beat(store, run)
        if beat is not None and beat.get("launch") in (launch_id, None):
            store.rm(run.alive)
    except Exception:  # noqa: BLE001 - a stale file is recognized as stale by the next fit
        log.debug("could not remove the heartbeat of launch %s", launch_id, exc_info=True)


def wait_for_other_launch(store: Any, run: Any, run_id: str, wait_s: float, say: Callable[[str], None],
                          interval: float = BEAT_S) -> None:
    """Before a fit launches on run `run_id`: return once no other launch beats it (at once when none does);
    a launch that stops beating for STALE_BEATS beats is dead and its file is removed. RunInUse after `wait_s` s
    of beats."""
    beat = read_beat(store, run)
    if beat is None:
        return
    say(f"Run {run_id!r} is being trained by another launch ({_where(beat)}); waiting up to {wait_s:.0f} s for it "
        "to end before this fit reads its checkpoint.")
    started = unchanged_since = time.monotonic()
    last = beat
    while beat is not None:
        now = time.monotonic()
        if beat != last:
            last, unchanged_since = beat, now
        elif now - unchanged_since >= STALE_BEATS * interval:
            log.info("Run %s: launch %s stopped beating without ending (its tasks were killed)", run_id,
                     beat.get("launch"))
            remove_if_ours(store, run, beat.get("launch", ""))
            return
        if now - started >= wait_s:
            raise RunInUse(f"Run {run_id!r} is still being trained by another launch ({_where(beat)}) after "
                           f"{wait_s:.0f} s. Let it finish and fit again to continue from its checkpoint, cancel "
                           f"its Spark job (tagged 'TorchEstimator.fit {run_id} {beat.get('launch')}'), or fit "
                           "under another run_id.")
        time.sleep(interval / 2)
        beat = read_beat(store, run)


def _where(beat: Dict[str, Any]) -> str:
    return f"launch {beat.get('launch')}, rank 0 on host {beat.get('host')}, pid {beat.get('pid')}"
