"""One Store class for every fsspec URL: local paths, file://, hdfs://, abfs://, s3://, memory://."""
from __future__ import annotations

import copy
import os
import posixpath
import threading
import uuid
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple
from urllib.parse import urlsplit

import fsspec
from fsspec.core import url_to_fs

from store.layout import DataLayout, RunLayout

_REDACTED = "***"
# Hadoop-style URLs: the authority (namenode host:port) is part of the URL, not of the path, and the
# path is known without connecting (a driver without libhdfs can still name hdfs:// paths).
_AUTHORITY_SCHEMES = ("hdfs", "viewfs", "webhdfs", "swebhdfs")
# Filesystems whose rename does not replace an existing file (HDFS's namenode answers "false").
_RENAME_KEEPS_TARGET = ("webhdfs", "swebhdfs")
DEFAULT_MAX_DATA_BYTES = 50 * 2**30  # materialized data kept in a store (the copies running fits use stay)
DEFAULT_MAX_DATA_AGE = 14 * 86400.0  # seconds a materialized copy is kept after a fit last used it
DEFAULT_MAX_RUN_BYTES = 20 * 2**30  # run folders (checkpoints, logs) kept in a store, least recently modified go
DEFAULT_MAX_RUN_AGE = 30 * 86400.0  # seconds a run folder is kept after it last changed

# the package's extras that install a scheme's fsspec filesystem (setup.cfg)
PACKAGE_EXTRAS = {"s3": ("s3", "s3a", "s3n"), "azure": ("abfs", "abfss", "az", "adl")}


class Store:
    """A prefix URL plus the fsspec filesystem that serves it.

    The constructor only records; the filesystem is resolved lazily so that a Store pickles
    cheaply to executors (each process builds its own client).
    """

    max_data_bytes: Optional[int] = DEFAULT_MAX_DATA_BYTES  # class defaults: stores pickled before these existed
    max_data_age: Optional[float] = DEFAULT_MAX_DATA_AGE
    max_run_bytes: Optional[int] = DEFAULT_MAX_RUN_BYTES
    max_run_age: Optional[float] = DEFAULT_MAX_RUN_AGE
    url_prefixes: Tuple[str, ...] = ()  # a subclass naming prefixes is what `Store.create` makes for such URLs
    _by_prefix: List[type] = []  # those subclasses (store.horovod's), as they are defined

    def __init_subclass__(cls, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("url_prefixes"):
            Store._by_prefix.append(cls)

    def __init__(self, prefix: str, storage_options: Optional[Dict[str, Any]] = None, save_runs: bool = True,
                 checkpoint_filename: str = "checkpoint.pt", probe_timeout: float = 30.0,
                 max_data_bytes: Optional[int] = DEFAULT_MAX_DATA_BYTES,
                 max_data_age: Optional[float] = DEFAULT_MAX_DATA_AGE,
                 max_run_bytes: Optional[int] = DEFAULT_MAX_RUN_BYTES,
                 max_run_age: Optional[float] = DEFAULT_MAX_RUN_AGE):
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"Store prefix must be a non-empty URL or path. Got {prefix!r} instead.")
        if "/" in checkpoint_filename or not checkpoint_filename:
            raise ValueError(f"checkpoint_filename must be a file name. Got {checkpoint_filename!r} instead.")
        self.prefix = prefix
        self.storage_options = dict(storage_options or {})
        self.save_runs = save_runs  # False: a run's folder is removed once its TorchModel is built
        self.checkpoint_filename = checkpoint_filename
        if not isinstance(probe_timeout, (int, float)) or isinstance(probe_timeout, bool) or probe_timeout <= 0:
            raise ValueError(f"probe_timeout must be a number of seconds > 0. Got {probe_timeout!r} instead.")
        self.probe_timeout = float(probe_timeout)  # seconds the reachability probe before a fit may take
        for name, value in (("max_data_bytes", max_data_bytes), ("max_data_age", max_data_age),
                            ("max_run_bytes", max_run_bytes), ("max_run_age", max_run_age)):
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"{name} must be a number > 0, or None for no limit. Got {value!r} instead.")
        # Materialized data above this size, or unused this long (seconds), is removed, least recently used
        # first, after every fit that materializes (store.budget); None: no limit.
        self.max_data_bytes, self.max_data_age = max_data_bytes, max_data_age
        # Run folders over this size together, or unchanged this long, are removed, least recently modified first,
        # after every fit (store.runs): never the fit's own run, nor one being trained; None: no limit.
        self.max_run_bytes, self.max_run_age = max_run_bytes, max_run_age
        self._fs: Optional[fsspec.AbstractFileSystem] = None
        self._root: Optional[str] = None

    @classmethod
    def create(cls, prefix: str, storage_options: Optional[Dict[str, Any]] = None, **kwargs: Any) -> "Store":
        """A store for any fsspec URL or local path. Called on `Store` itself it picks the class a
        Horovod user expects: DBFSLocalStore for `dbfs:/` and `/dbfs/`, HDFSStore for `hdfs://`."""
        chosen = next((c for c in Store._by_prefix if prefix.startswith(c.url_prefixes)), cls) if cls is Store else cls
        return chosen(prefix, storage_options=storage_options, **kwargs)

    # -- filesystem ---------------------------------------------------------------------------
    def _resolve(self) -> None:
        if self._fs is None:
            prefix = os.path.abspath(os.path.expanduser(self.prefix)) if _is_plain_path(self.prefix) else self.prefix
            try:
                self._fs, root = url_to_fs(prefix, **self.storage_options)
            except (ValueError, ImportError) as exc:
                scheme = self.prefix.split("://", 1)[0] if "://" in self.prefix else ""
                extra = next((name for name, schemes in PACKAGE_EXTRAS.items() if scheme in schemes), None)
                fix = (f" (pip install 'spark-torch-estimator[{extra}]' installs it, on the driver and every "
                       "executor)" if extra else "")
                raise ValueError(
                    f"Store cannot open {self.prefix!r}: {exc}{fix}. Use a local path or an fsspec URL "
                    "(file://, hdfs://, abfs://, s3://, memory://) with its filesystem package installed."
                ) from None
            self._root = root.rstrip("/") or "/"

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        self._resolve()
        return self._fs  # type: ignore[return-value]

    @property
    def root(self) -> str:
        """The prefix as a path inside `fs` (no protocol)."""
        if self._scheme in _AUTHORITY_SCHEMES:
            return urlsplit(self.prefix).path.rstrip("/") or "/"
        self._resolve()
        return self._root  # type: ignore[return-value]

    @property
    def _scheme(self) -> str:
        return urlsplit(self.prefix).scheme if not _is_plain_path(self.prefix) else ""

    def path(self, *parts: str) -> str:
        """A path inside `fs` under the prefix."""
        return posixpath.join(self.root, *parts)

    def url(self, path: str) -> str:
        """A full URL for a path of this store, as other tools (Spark, pyarrow) name it."""
        if self.is_local:
            return "file://" + path
        if self._scheme in _AUTHORITY_SCHEMES:
            return f"{self._scheme}://{urlsplit(self.prefix).netloc}{path}"
        return self.fs.unstrip_protocol(path)

    @property
    def protocol(self) -> str:
        if self._scheme in _AUTHORITY_SCHEMES:
            return self._scheme
        protocol = self.fs.protocol
        return protocol if isinstance(protocol, str) else protocol[0]

    @property
    def is_local(self) -> bool:
        return self.protocol in ("file", "local")

    # -- layout -------------------------------------------------------------------------------
    def run(self, run_id: str) -> RunLayout:
        return RunLayout(self.path("runs", run_id), self.checkpoint_filename)

    # Horovod's Store names, for code that calls them
    def get_run_path(self, run_id: str) -> str:
        return self.url(self.run(run_id).root)

    def get_checkpoint_path(self, run_id: str) -> str:
        """The checkpoint file of the run, as Horovod's Store returns it."""
        return self.url(self.run(run_id).checkpoint)

    def get_checkpoint_filename(self) -> str:
        return self.checkpoint_filename

    def get_logs_path(self, run_id: str) -> str:
        return self.url(self.run(run_id).logs)

    def cleanup(self, keep_runs: Optional[int] = None, older_than: Optional[float] = None, grace: float = 3600.0,
                dry_run: bool = False) -> List[str]:
        """Remove orphaned materialization attempts, and runs/data by age or count; see store.cleanup."""
        from store.cleanup import cleanup

        return cleanup(self, keep_runs, older_than, grace, dry_run)

    def read(self, path: str) -> bytes:
        return self.read_bytes(self.fs._strip_protocol(path))

    def data(self, key: str) -> DataLayout:
        return DataLayout(self.path("data", key))

    # -- small I/O helpers --------------------------------------------------------------------
    def exists(self, path: str) -> bool:
        return self.fs.exists(path)

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(path, exist_ok=True)

    def read_bytes(self, path: str) -> bytes:
        with self.fs.open(path, "rb") as f:
            return f.read()

    def write_bytes_atomic(self, path: str, data: bytes) -> None:
        """Write to a temporary name beside `path`, then move it into place.

        On local disk and HDFS the move is atomic; on object stores the final object appears only
        when its upload completes, so a reader never sees a half-written file either way.
        """
        self.write_atomic(path, lambda f: f.write(data))

    def write_atomic(self, path: str, write: Callable[[Any], Any]) -> None:
        """`write(f)` streams the file's bytes into `f` (a temporary name beside `path`), then the file is moved
        into place, as write_bytes_atomic does: for what should not be held whole in memory first (a checkpoint
        as large as the model and its optimizer's state)."""
        parent = posixpath.dirname(path)
        self.makedirs(parent)
        tmp = posixpath.join(parent, f".tmp-{uuid.uuid4().hex}-{posixpath.basename(path)}")
        try:
            with self.fs.open(tmp, "wb") as f:
                write(f)
        except BaseException:
            try:  # a write that failed half-way leaves no partial file behind, where the store still answers
                if self.fs.exists(tmp):
                    self.fs.rm(tmp)
            except OSError:
                pass
            raise
        if self.protocol in _RENAME_KEEPS_TARGET and self.fs.exists(path):
            old = tmp + ".old"  # rename will not replace: move the old file aside first
            self.fs.mv(path, old)
            self.fs.mv(tmp, path)
            self.fs.rm(old)
        else:
            self.fs.mv(tmp, path)
        if self.protocol in _RENAME_KEEPS_TARGET and self.fs.exists(tmp):
            raise OSError(f"{self!r} refused to rename {tmp} to {path}.")

    def check_writable(self, timeout: Optional[float] = None) -> None:
        """Write, read back and delete a small probe under the prefix, within `timeout` seconds
        (default: the store's probe_timeout).

        Runs before any Spark job, so that a wrong URL, missing credentials or a dead endpoint fail in
        seconds with a clear message instead of after materialization or inside every rank. Clients
        that retry (botocore, adlfs) are cut off by the timeout.
        """
        timeout = timeout or getattr(self, "probe_timeout", 30.0)
        outcome: List[BaseException] = []

        def probe() -> None:
            try:
                path = self.path(f".probe-{uuid.uuid4().hex}")
                self.makedirs(self.root)
                with self.fs.open(path, "wb") as f:
                    f.write(b"ok")
                if self.read_bytes(path) != b"ok":
                    raise OSError("the probe file read back different bytes")
                self.fs.rm(path)
            except BaseException as exc:  # noqa: BLE001 - reported below, redacted
                outcome.append(exc)

        worker = threading.Thread(target=probe, name="store-probe", daemon=True)
        worker.start()
        worker.join(timeout)
        if worker.is_alive():
            raise StoreUnavailable(f"Store {self!r} did not answer within {timeout:g} s. Check the URL, the "
                                   "endpoint and the network, or raise the store's probe_timeout "
                                   f"(Store.create(url, probe_timeout=...)).")
        if outcome:
            exc = outcome[0]
            raise StoreUnavailable(f"Store {self!r} is not reachable or not writable: "
                                   f"{type(exc).__name__}: {self.redact(str(exc))}") from None

    def redact(self, text: str) -> str:
        """`text` with every credential-like value of storage_options replaced by ***."""
        for value in _secret_values(self.storage_options):
            text = text.replace(value, _REDACTED)
        return text

    def ls(self, path: str) -> List[str]:
        return [p for p in self.fs.ls(path, detail=False)]

    def find(self, path: str, suffix: str = "") -> Iterator[str]:
        for p in sorted(self.fs.find(path)):
            if p.endswith(suffix):
                yield p

    def rm(self, path: str) -> None:
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    def without_credentials(self) -> "Store":
        """The same prefix with no storage_options (what gets persisted with a saved estimator)."""
        clone = copy.copy(self)
        clone.storage_options, clone._fs, clone._root = {}, None, None
        return clone

    # -- pickling and display: credentials stay out of reprs --------------------------------------
    def __getstate__(self) -> Dict[str, Any]:
        state = self.__dict__.copy()
        state["_fs"] = None
        state["_root"] = None
        return state

    def __repr__(self) -> str:
        opts = {k: _REDACTED for k in self.storage_options}
        return f"{type(self).__name__}({self.prefix!r}, storage_options={opts})"


class StoreUnavailable(ValueError):
    """The store cannot be used: unreachable, unauthorized or not writable."""


def _secret_values(options: Any) -> List[str]:
    """String values of (nested) storage_options long enough to be secrets, longest first."""
    found: List[str] = []
    if isinstance(options, dict):
        for value in options.values():
            found.extend(_secret_values(value))
    elif isinstance(options, str) and len(options) >= 4:
        found.append(options)
    return sorted(set(found), key=len, reverse=True)


class LocalStore(Store):
    """A store on a local (or shared, mounted) path."""

    def __init__(self, prefix_path: str, *args: Any, **kwargs: Any):
        super().__init__(prefix_path, *args, **kwargs)


def _is_plain_path(prefix: str) -> bool:
    return "://" not in prefix
