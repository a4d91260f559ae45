"""Where a run keeps its data, checkpoints and logs: one class over fsspec.

No Spark and no torch here: the store is used by the driver and by every rank.
"""
from store.horovod import AdlsStore, DBFSLocalStore, HDFSStore
from store.layout import DataLayout, RunLayout
from store.store import LocalStore, Store, StoreUnavailable

__all__ = ["Store", "LocalStore", "HDFSStore", "DBFSLocalStore", "AdlsStore", "RunLayout", "DataLayout", "StoreUnavailable"]
