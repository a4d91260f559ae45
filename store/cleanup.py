"""What a store no longer needs, removed when asked (`Store.cleanup`). A store otherwise only grows: every
distinct DataFrame, split or column set is materialized once, every run_id keeps its folder, and a
materialization that was interrupted (or lost a race with a concurrent fit) leaves an attempt folder that no
commit marker names."""
from __future__ import annotations

import datetime
import json
import posixpath
import time
from typing import Any, Dict, List, Optional

from store.layout import DataLayout


def cleanup(store: Any, keep_runs: Optional[int] = None, older_than: Optional[float] = None, grace: float = 3600.0,
            dry_run: bool = False) -> List[str]:
    """Remove, and return the URLs of:
    - attempt folders of materialized data that the data's commit marker does not name, once nothing in them
      changed for `grace` seconds (a materialization still writing is left alone);
    - with `older_than` (seconds): runs and materialized data sets not modified for that long (a later fit of
      the same data writes it again);
    - with `keep_runs=N`: every run but the N most recently modified.
    `dry_run=True` only lists them. The user's own files outside `data/` and `runs/` are never touched."""
    now, doomed = time.time(), []
    for root in _folders(store, store.path("data")):
        layout = DataLayout(root)
        committed = None
        if store.exists(layout.commit_marker):
            committed = layout.attempt(json.loads(store.read_bytes(layout.commit_marker))["attempt"])
        if older_than is not None and committed is not None and now - _modified(store, root) > older_than:
            doomed.append(root)
            continue
        for child in _folders(store, root):
            if posixpath.basename(child).startswith("attempt-") and _strip(store, child) != _strip(store, committed) \
                    and now - _modified(store, child) > grace:
                doomed.append(child)
    runs = sorted(_folders(store, store.path("runs")), key=lambda r: _modified(store, r), reverse=True)
    for i, run in enumerate(runs):
        if (keep_runs is not None and i >= keep_runs) or (older_than is not None
                                                          and now - _modified(store, run) > older_than):
            doomed.append(run)
    if not dry_run:
        for path in doomed:
            store.rm(path)
    return [store.url(path) for path in doomed]


def _folders(store: Any, path: str) -> List[str]:
    if not store.exists(path):
        return []
    return sorted(_strip(store, info["name"]) for info in store.fs.ls(path, detail=True)
                  if info.get("type") == "directory")


def _strip(store: Any, path: Optional[str]) -> Optional[str]:
    return None if path is None else store.fs._strip_protocol(path).rstrip("/")


def _modified(store: Any, path: str) -> float:
    """When anything under `path` last changed (the newest file), in seconds since the epoch."""
    infos: Dict[str, Dict[str, Any]] = store.fs.find(path, detail=True)
    times = [_mtime(info) for info in infos.values()] or [_mtime(store.fs.info(path))]
    return max((t for t in times if t is not None), default=time.time())


def _mtime(info: Dict[str, Any]) -> Optional[float]:
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
