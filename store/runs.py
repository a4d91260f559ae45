"""Run folders kept within the store's budget: after every fit, runs not modified for `Store.max_run_age`, then
the least recently modified while all runs together are over `Store.max_run_bytes`, are removed - never the fit's
own run, nor one a launch is still training (its alive.json beats). A run keeps everything needed to continue or
inspect it (checkpoint, best epochs, TensorBoard logs, history) until then. No Spark and no torch here."""
from __future__ import annotations

import logging
import posixpath
import time
from dataclasses import dataclass
from typing import Any, Collection, List, Optional

from store.budget import folders
from store.cleanup import mtime

log = logging.getLogger("estimator")
LIVE_S = 120.0  # a run whose alive.json changed this recently is being trained


@dataclass(frozen=True)
class RunFolder:
    path: str
    nbytes: int
    modified: float  # its newest file
    live: bool  # a launch beat it within LIVE_S


def run_folders(store: Any, now: Optional[float] = None) -> List[RunFolder]:
    """Every run folder of the store with its size and last change (one recursive listing per run)."""
    now = time.time() if now is None else now
    found = []
    for path in folders(store, store.path("runs")):
        infos = store.fs.find(path, detail=True)
        times = {posixpath.basename(name): mtime(info) for name, info in infos.items()}
        modified = max((t for t in times.values() if t is not None), default=now)
        alive = times.get("alive.json")
        found.append(RunFolder(path, sum(int(info.get("size") or 0) for info in infos.values()), modified,
                               alive is not None and now - alive < LIVE_S))
    return found


def enforce_runs(store: Any, keep: Collection[str] = (), now: Optional[float] = None) -> List[RunFolder]:
    """Remove the runs over the budget (see the module); `keep`: run folders never removed. Returns the removed."""
    age, budget = getattr(store, "max_run_age", None), getattr(store, "max_run_bytes", None)
    if age is None and budget is None:
        return []
    now = time.time() if now is None else now
    runs = sorted(run_folders(store, now), key=lambda r: r.modified)
    total, removed = sum(r.nbytes for r in runs), []
    for run in runs:
        too_old = age is not None and now - run.modified > age
        too_big = budget is not None and total > budget
        if (too_old or too_big) and not run.live and run.path not in keep:
            store.rm(run.path)
            removed.append(run)
            total -= run.nbytes
    if removed:
        log.info("Store budget: removed %d run folders (%.1f MB) not modified since %s", len(removed),
                 sum(r.nbytes for r in removed) / 1e6,
                 time.strftime("%Y-%m-%d %H:%M", time.localtime(max(r.modified for r in removed))))
    return removed
