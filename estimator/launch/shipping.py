"""The executors run this project's code (the ranks, the Parquet writer, the transform): send it from the
driver, so that a cluster needs only torch and pyarrow installed, and runs exactly the driver's version.

One zip of the `estimator` and `store` packages (their .py files, named by a hash of their content) is added
to the session once with `spark.addArtifacts(zip, pyfile=True)` (pyspark 4, classic and Connect; pyspark 3.5's
classic sessions: `addPyFile`). Classic `local[...]` masters run their executors from the driver's own Python
and get nothing.
"""
from __future__ import annotations

import atexit
import hashlib
import io
import logging
import os
import shutil
import sys
import tempfile
import threading
import warnings
import zipfile
from typing import Any, List, Optional, Set, Tuple

import pyspark

from estimator.launch.session import conf, executor_python, is_connect

log = logging.getLogger("estimator")
PACKAGES = ("estimator", "store")
NOT_SHIPPED = ("estimator/cluster.py",)  # driver-side helpers only (local Spark servers for examples and tests)
_lock = threading.Lock()
_zip: Optional[str] = None
_shipped: Set[str] = set()  # the sessions (Connect session ids, classic application ids) that have it


def package_zip() -> str:
    """The zip of this project's packages, built once per driver process."""
    global _zip
    with _lock:
        if _zip is None or not os.path.exists(_zip):
            _zip = _build_zip()
        return _zip


def _build_zip() -> str:
    import estimator

    root = os.path.dirname(os.path.dirname(os.path.abspath(estimator.__file__)))
    files = []
    for package in PACKAGES:
        for folder, dirs, names in os.walk(os.path.join(root, package)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            files += [os.path.join(folder, n) for n in sorted(names) if n.endswith(".py")]
    buffer, digest = io.BytesIO(), hashlib.sha256()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in files:
            name = os.path.relpath(path, root).replace(os.sep, "/")
            if name in NOT_SHIPPED:
                continue
            with open(path, "rb") as handle:
                data = handle.read()
            digest.update(name.encode() + b"\0" + data)
            archive.writestr(zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0)), data)
    return temporary_file("spark-torch-estimator-packages", f"spark_torch_estimator-{digest.hexdigest()[:16]}.zip",
                          buffer.getvalue())


def temporary_file(folder: str, name: str, data: bytes) -> str:
    """`data` in <temp dir>/<folder>/<pid>-<name>, written once (atomically) for a name that says its content, and
    removed when this process exits: the sessions it ships the file to end with it (files of hundreds of MB, a model
    for transform, were left behind for good)."""
    path = os.path.join(tempfile.gettempdir(), folder, f"{os.getpid()}-{name}")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if not os.path.exists(path):
        temporary = f"{path}.{threading.get_ident()}.tmp"
        with open(temporary, "wb") as handle:
            handle.write(data)
        os.replace(temporary, path)
        _written.append((os.getpid(), path))
    return path


def _remove_written() -> None:
    for pid, path in _written:
        if pid == os.getpid():  # not in a forked child that exits normally: the files are its parent's
            try:
                os.remove(path)
            except OSError:
                pass


_written: List[Tuple[int, str]] = []
atexit.register(_remove_written)


def check_local_python(spark: Any) -> None:
    """Local mode runs its Python workers with PYSPARK_PYTHON, by default `python3` on the PATH: a script started
    as .venv/bin/python without the venv activated gets workers without torch or this project. Said once, before
    any job, when that Python lies in another folder than the driver's."""
    python = executor_python(spark)
    found = shutil.which(python) or python
    if os.path.dirname(os.path.abspath(found)) == os.path.dirname(os.path.abspath(sys.executable)):
        return
    with _lock:
        if f"local-python:{python}" in _shipped:
            return
        _shipped.add(f"local-python:{python}")
    warnings.warn(f"Spark's Python workers run {python!r} ({found}), not this driver's Python ({sys.executable}): "
                  "they need torch and this project too. Unless that Python has them, set "
                  f"PYSPARK_PYTHON={sys.executable} before the SparkSession starts.", UserWarning, stacklevel=4)


def needs_shipping(spark: Any) -> bool:
    """Connect sessions always (their server's executors are not the client's Python); classic sessions
    unless their master is local."""
    if is_connect(spark):
        return True
    return not (conf(spark, "spark.master") or "local").startswith("local")


def ship_package(spark: Any) -> None:
    """Make the executors of `spark` import this driver's `estimator` and `store` (once per session)."""
    if not needs_shipping(spark):
        check_local_python(spark)
        return
    path = package_zip()
    if _add_once(spark, path, pyfile=True):
        log.info("Sent this driver's estimator and store packages to the executors (%s)", os.path.basename(path))


def ship_file(spark: Any, path: str) -> str:
    """Make the file at `path` readable by the executors' Python as `SparkFiles.get(name)` (once per session and
    name; name it by its content). Returns the name. Local masters too: their workers read SparkFiles alike."""
    _add_once(spark, path, pyfile=False)
    return os.path.basename(path)


def _add_once(spark: Any, path: str, pyfile: bool) -> bool:
    """Add `path` to the session's Python files (pyfile) or files, unless this session has it; True if added."""
    session = f"connect:{spark.session_id}" if is_connect(spark) else f"classic:{conf(spark, 'spark.app.id')}"
    key = f"{session}:{'pyfile' if pyfile else 'file'}:{os.path.basename(path)}"
    with _lock:
        if key in _shipped:
            return False
        _shipped.add(key)
    try:
        if is_connect(spark) or int(pyspark.__version__.split(".")[0]) >= 4:
            spark.addArtifacts(path, pyfile=pyfile, file=not pyfile)
        elif pyfile:  # pyspark 3.5's classic sessions have artifacts only on Spark Connect
            spark.sparkContext.addPyFile(path)
        else:
            spark.sparkContext.addFile(path)
    except Exception:
        with _lock:
            _shipped.discard(key)
        raise
    return True
