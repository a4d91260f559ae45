"""The store's materialized data kept within a budget: leases held by running fits, last use, and removal of
the least recently used copies when the data outgrows `Store.max_data_bytes` or lies unused longer than
`Store.max_data_age`. Applied after every materialization; no Spark and no torch here."""
from __future__ import annotations

import json
import logging
import posixpath
import time
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from store.layout import COMMITTED, LEASE, DataLayout

log = logging.getLogger("estimator")
STALE_LEASE = 86400.0  # a lease this old belongs to a driver that died without ending its fit


@dataclass(frozen=True)
class Copy:
    """One committed copy of data: where it lies, its marker, its size and when a fit last used it."""

    layout: DataLayout
    fingerprint: str
    marker: Dict[str, Any]
    used: float

    @property
    def nbytes(self) -> int:
        return int(self.marker.get("bytes") or 0)

    @property
    def attempt(self) -> str:
        return self.layout.attempt(self.marker["attempt"])


def copies(store: Any) -> List[Copy]:
    """Every committed copy in the store, from its markers (one listing per shape folder)."""
    found = []
    for root in folders(store, store.path("data")):
        layout = DataLayout(root)
        for fingerprint in fingerprints(store, layout):
            marker = json.loads(store.read_bytes(layout.commit_marker(fingerprint)))
            found.append(Copy(layout, fingerprint, marker, last_used(store, layout, fingerprint, marker)))
    return found


def fingerprints(store: Any, layout: DataLayout) -> List[str]:
    """The fingerprints of the copies committed in one shape folder (one listing)."""
    if not store.exists(layout.root):
        return []
    return [name[:-len(COMMITTED)] for name in _names(store, layout.root) if name.endswith(COMMITTED)]


def last_used(store: Any, layout: DataLayout, fingerprint: str, marker: Dict[str, Any]) -> float:
    try:
        return float(json.loads(store.read_bytes(layout.used(fingerprint)))["used"])
    except (FileNotFoundError, OSError, ValueError, KeyError):
        return float(marker.get("created") or 0.0)


def take_lease(store: Any, layout: DataLayout, fingerprint: str) -> str:
    """Mark the copy in use by this fit (and used now); returns the lease's path for `release`."""
    path = layout.lease(fingerprint, uuid.uuid4().hex[:12])
    store.write_bytes_atomic(path, json.dumps({"since": time.time()}).encode())
    mark_used(store, layout, fingerprint)
    return path


def release(store: Any, lease: str) -> None:
    root, name = posixpath.split(lease)
    mark_used(store, DataLayout(root), name.split(LEASE)[0])
    store.rm(lease)


def mark_used(store: Any, layout: DataLayout, fingerprint: str) -> None:
    store.write_bytes_atomic(layout.used(fingerprint), json.dumps({"used": time.time()}).encode())


def remove(store: Any, layout: DataLayout, fingerprint: str) -> None:
    """The marker first (no fit finds the copy any more), then its rows."""
    marker = layout.commit_marker(fingerprint)
    if not store.exists(marker):
        return
    attempt = layout.attempt(json.loads(store.read_bytes(marker))["attempt"])
    for path in (marker, layout.used(fingerprint), attempt):
        if store.exists(path):
            store.rm(path)


def enforce(store: Any, now: Optional[float] = None) -> List[Copy]:
    """Remove the copies unused for longer than `store.max_data_age`, then the least recently used ones while
    the data is over `store.max_data_bytes`; never a copy a running fit holds a lease on. Returns the removed."""
    now = time.time() if now is None else now
    everything = sorted(copies(store), key=lambda c: c.used)
    total, removed = sum(c.nbytes for c in everything), []
    for copy in everything:
        too_old = store.max_data_age is not None and now - copy.used > store.max_data_age
        too_big = store.max_data_bytes is not None and total > store.max_data_bytes
        if (too_old or too_big) and not leased(store, copy, now):
            remove(store, copy.layout, copy.fingerprint)
            removed.append(copy)
            total -= copy.nbytes
    if removed:
        log.info("Store budget: removed %d materialized copies (%.1f MB) unused since %s", len(removed),
                 sum(c.nbytes for c in removed) / 1e6, time.strftime("%Y-%m-%d %H:%M", time.localtime(
                     max(c.used for c in removed))))
    if store.max_data_bytes is not None and total > store.max_data_bytes:
        log.warning("The store's materialized data (%.1f MB) is over max_data_bytes (%.1f MB): the copies "
                    "running fits use are kept until they end.", total / 1e6, store.max_data_bytes / 1e6)
    return removed


def leased(store: Any, copy: Copy, now: float) -> bool:
    prefix = copy.fingerprint + LEASE
    for name in _names(store, copy.layout.root):
        if name.startswith(prefix):
            try:
                since = json.loads(store.read_bytes(posixpath.join(copy.layout.root, name)))["since"]
            except (FileNotFoundError, OSError, ValueError, KeyError):
                continue  # released meanwhile
            if now - since < STALE_LEASE:
                return True
    return False


def folders(store: Any, path: str) -> List[str]:
    if not store.exists(path):
        return []
    return sorted(strip(store, info["name"]) for info in store.fs.ls(path, detail=True)
                  if info.get("type") == "directory")


def strip(store: Any, path: Optional[str]) -> Optional[str]:
    return None if path is None else store.fs._strip_protocol(path).rstrip("/")


def _names(store: Any, path: str) -> List[str]:
    return sorted(posixpath.basename(strip(store, p)) for p in store.fs.ls(path, detail=False))
