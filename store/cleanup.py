"""What a store no longer needs, removed when asked (`Store.cleanup`). Materialized data is kept within the
store's budget by itself (store.budget); runs keep their folders until removed here, and a materialization that
was interrupted (or lost a race with a concurrent fit) leaves an attempt folder that no commit marker names."""
from __future__ import annotations

import datetime
import posixpath
import time
from typing import Any, Dict, List, Optional

from store.budget import copies, folders, leased, remove, strip


def cleanup(store: Any, keep_runs: Optional[int] = None, older_than: Optional[float] = None, grace: float = 3600.0,
            dry_run: bool = False) -> List[str]:
    """Remove, and return the URLs of:
    - attempt folders of materialized data that no commit marker names, once nothing in them changed for
      `grace` seconds (a materialization still writing is left alone);
    - with `older_than` (seconds): runs not modified, and materialized copies not used by a fit, for that long
      (a later fit of the same data writes it again); never a copy a running fit holds;
    - with `keep_runs=N`: every run but the N most recently modified.
    `dry_run=True` only lists them. The user's own files outside `data/` and `runs/` are never touched.
    (Materialized data is also kept within the store's budget after every fit: store.budget.)"""
    now, doomed, old_copies = time.time(), [], []
    committed = {}
    for copy in copies(store):
        committed[strip(store, copy.attempt)] = copy
        if older_than is not None and now - copy.used > older_than and not leased(store, copy, now):
            old_copies.append(copy)
    for root in folders(store, store.path("data")):
        for child in folders(store, root):
            if posixpath.basename(child).startswith("attempt-") and child not in committed \
                    and now - _modified(store, child) > grace:
                doomed.append(child)
    runs = sorted(folders(store, store.path("runs")), key=lambda r: _modified(store, r), reverse=True)
    for i, run in enumerate(runs):
        if (keep_runs is not None and i >= keep_runs) or (older_than is not None
                                                          and now - _modified(store, run) > older_than):
            doomed.append(run)
    if not dry_run:
        for copy in old_copies:
            remove(store, copy.layout, copy.fingerprint)
        for path in doomed:
            store.rm(path)
    return [store.url(path) for path in [c.attempt for c in old_copies] + doomed]


def _modified(store: Any, path: str) -> float:
    """When anything under `path` last changed (the newest file), in seconds since the epoch."""
    infos: Dict[str, Dict[str, Any]] = store.fs.find(path, detail=True)
    times = [mtime(info) for info in infos.values()] or [mtime(store.fs.info(path))]
    return max((t for t in times if t is not None), default=time.time())


def mtime(info: Dict[str, Any]) -> Optional[float]:
    """fsspec backends name it differently: mtime (local), LastModified (s3), last_modified (abfs),
    modificationTime in ms (webhdfs)."""
    for key in ("mtime", "LastModified", "last_modified", "modificationTime", "created"):
        value = info.get(key)
        if value is None:
            continue
        if isinstance(value, datetime.datetime):
            return value.timestamp()
        if isinstance(value, (int, float)):
            return value / 1000.0 if key == "modificationTime" else float(value)
    return None
