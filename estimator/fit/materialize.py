"""DataFrame -> Parquet in the store, once per (rows, columns, split).

One Spark job selects the columns (vectors become arrays), tags each row train or val by a seeded hash of its
values, and writes both splits at once (`partitionBy` on the tag). The same job measures the rows (nulls, array
lengths) and their content fingerprint (estimator.fit.fingerprint). The write goes to a fresh attempt folder; a
commit marker named by the fingerprint is written last, and only committed attempts are ever read.

Reuse: the same DataFrame again (same plan, deterministic) is known in this process without a job; other
DataFrames whose shape matches data already in the store get one pass that computes their fingerprint, and reuse
the copy with the same rows. A DataFrame that gives other rows each time it is computed is found out by that
pass; its copy is used by its fit only and removed when the fit ends.
"""
from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from pyspark.ml.linalg import VectorUDT
from pyspark.sql import DataFrame, Observation
from pyspark.sql import functions as F
from pyspark.sql.types import ArrayType

from estimator.core.spec import Piece, total_rows
from estimator.data.parquet import list_pieces, pieces_of_files
from estimator.data.row_checks import check_observed
from estimator.fit.fingerprint import (FORMAT_VERSION, SPLIT_COLUMN as _VAL, content_aggregates, fingerprint, plan_key,
                                   reusable_plan, shape_key, tagged)
from estimator.fit.parquet_writer import write_with_executors
from estimator.launch.session import job_tag
from estimator.predict.schema import any_null, as_read, null_checks, null_elements
from store import Store
from store.budget import enforce, fingerprints, release, remove, take_lease
from store.layout import DataLayout

log = logging.getLogger("estimator")
SPARK_WRITES = ("file", "local", "hdfs", "viewfs")  # URLs Spark's own Parquet writer handles everywhere
_KNOWN_PLANS: "OrderedDict[Tuple[str, str], str]" = OrderedDict()  # (store, plan key) -> fingerprint, this process
_KNOWN_PLANS_LOCK = threading.Lock()
_KNOWN_PLANS_MAX = 256


@dataclass(frozen=True)
class Materialized:
    key: str  # <shape>/<fingerprint>
    train: Tuple[Piece, ...]
    val: Tuple[Piece, ...]
    reused: bool
    seconds: float
    lease: str = ""  # held while the fit runs: `finish` releases it
    one_off: bool = False  # a DataFrame that computes other rows each time: its copy goes when the fit ends

    @property
    def train_rows(self) -> int:
        return total_rows(self.train)

    @property
    def val_rows(self) -> int:
        return total_rows(self.val)


def materialize(df: DataFrame, store: Store, columns: Sequence[str], validation: Union[None, float, str],
                seed: int, num_proc: int, partitions_per_process: Optional[int] = None,
                drop_nulls: bool = False) -> Materialized:
    """Parquet for (df, columns, split) in the store, written now or reused; the caller ends with `finish`.
    Files: exactly num_proc * partitions_per_process when that is set, else the DataFrame's partitions, at
    least num_proc."""
    started = time.perf_counter()
    files = num_proc * partitions_per_process if partitions_per_process else -num_proc  # < 0: "at least"
    plain = selected(df, columns, validation, seed)
    shape = shape_key(plain.schema, validation, seed, files, drop_nulls)
    layout = store.data(f"{shape}-{abs(files)}")
    plan = (store.url(store.root), plan_key(df, shape)) if reusable_plan(df) else None
    with _KNOWN_PLANS_LOCK:
        known = _KNOWN_PLANS.get(plan) if plan else None
    if known and store.exists(layout.commit_marker(known)):
        return _reused(store, layout, known, started, "the same DataFrame")
    expected = None
    if fingerprints(store, layout):  # data of this shape is there: are these its rows?
        with job_tag(df.sparkSession, f"TorchEstimator.fit fingerprint {shape}"):
            expected = fingerprint(plain.agg(*content_aggregates()).collect()[0].asDict())
        if store.exists(layout.commit_marker(expected)):
            _remember(plan, expected)
            return _reused(store, layout, expected, started, "the same rows")
    attempt, written, observed = _attempt(plain, store, layout, columns, files if files > 0 else None, drop_nulls)
    try:
        check_observed(observed, columns, drop_nulls)
        if not observed.get("rows"):
            raise ValueError("The DataFrame given to fit has no rows: nothing to train on. Check the filters or "
                             "joins that made it (df.count() says 0).")
    except ValueError:
        store.rm(layout.attempt(attempt))  # never committed, never reused; nothing of the user's is touched
        raise
    found = fingerprint(observed)
    result = _committed(store, layout, found, attempt, written, False, started)
    if files < 0 and len(result.train) < num_proc <= result.train_rows:
        # Fewer row groups than ranks (a DataFrame of few partitions): written once more over num_proc files,
        # so that every rank has its own row group (petastorm needs it; the arrow reader reads less).
        log.info("The DataFrame wrote %d training row groups for %d ranks: writing it again in %d partitions",
                 len(result.train), num_proc, num_proc)
        store.rm(layout.attempt(attempt))
        attempt, written, observed = _attempt(plain, store, layout, columns, num_proc, drop_nulls)
        found = fingerprint(observed)
        result = _committed(store, layout, found, attempt, written, False, started)
    if store.exists(layout.commit_marker(found)):  # the same rows were committed meanwhile (a concurrent fit)
        store.rm(layout.attempt(attempt))
        return _reused(store, layout, found, started, "the same rows, written meanwhile")
    one_off = expected is not None and expected != found
    if one_off:
        log.warning("The DataFrame gave other rows when computed again (a nondeterministic plan: unseeded rand, "
                    "a random UDF, an unordered limit): its copy serves this fit only and is removed when the fit "
                    "ends. Write it to Parquet, or cache or checkpoint it, to reuse one set of rows.")
    marker = {"attempt": attempt, "columns": list(columns), "train_rows": result.train_rows,
              "val_rows": result.val_rows, "format": FORMAT_VERSION, "created": time.time(), "files": written,
              "bytes": _size(store, layout.attempt(attempt)), "one_off": one_off}
    store.write_bytes_atomic(layout.commit_marker(found), json.dumps(marker).encode())
    if not one_off:
        _remember(plan, found)
    lease = take_lease(store, layout, found)
    enforce(store)
    log.info("Materialized %d train / %d val rows in %.1fs", result.train_rows, result.val_rows,
             time.perf_counter() - started)
    return Materialized(result.key, result.train, result.val, False, time.perf_counter() - started, lease, one_off)


def finish(store: Store, m: Materialized) -> None:
    """The fit is over: release its lease on the data; a one-off copy is removed."""
    if m.lease:
        release(store, m.lease)
    if m.one_off:
        folder, fp = m.key.split("/")
        remove(store, store.data(folder), fp)


def _reused(store: Store, layout: DataLayout, fp: str, started: float, why: str) -> Materialized:
    marker = json.loads(store.read_bytes(layout.commit_marker(fp)))
    log.info("Reusing materialized data %s/%s (%s)", layout.root.rsplit("/", 1)[-1], fp, why)
    lease = take_lease(store, layout, fp)
    result = _committed(store, layout, fp, marker["attempt"], marker.get("files"), True, started)
    enforce(store)
    return Materialized(result.key, result.train, result.val, True, result.seconds, lease)


def _remember(plan: Optional[Tuple[str, str]], fp: str) -> None:
    if plan is None:
        return
    with _KNOWN_PLANS_LOCK:
        _KNOWN_PLANS[plan] = fp
        _KNOWN_PLANS.move_to_end(plan)
        while len(_KNOWN_PLANS) > _KNOWN_PLANS_MAX:
            _KNOWN_PLANS.popitem(last=False)


def _size(store: Store, path: str) -> int:
    try:
        return int(store.fs.du(path, total=True))
    except (OSError, NotImplementedError):
        return 0


def selected(df: DataFrame, columns: Sequence[str], validation: Union[None, float, str], seed: int) -> DataFrame:
    """The columns as written (vectors as float arrays), the split tag and the row hash (estimator.fit.fingerprint)."""
    extra = [validation] if isinstance(validation, str) and validation not in columns else []
    return tagged(df.select(*[_as_array(df, c) for c in columns], *extra), columns, validation, seed)


def _attempt(plain: DataFrame, store: Store, layout: DataLayout, columns: Sequence[str], partitions: Optional[int],
             drop_nulls: bool) -> Tuple[str, Optional[Dict[str, List[str]]], Dict[str, Any]]:
    """One write into a fresh attempt folder: its id, the files written (None: Spark's writer) and what the
    write job observed (checks and fingerprint)."""
    attempt = uuid.uuid4().hex[:12]
    observation = Observation(f"checks-{attempt}")
    written = _write(plain, store, layout.attempt(attempt), columns, partitions, observation, drop_nulls, layout.root)
    return attempt, written, observation.get


def _write(plain: DataFrame, store: Store, root: str, columns: Sequence[str], partitions: Optional[int],
           observation: Observation, drop_nulls: bool, name: str) -> Optional[Dict[str, List[str]]]:
    """Write both splits (in `partitions` partitions when given, else the DataFrame's own); returns the files
    written when executors wrote them (None: Spark's writer). The same job counts rows with nulls and array
    lengths per column and computes the content fingerprint (`observation`): no extra pass."""
    arrays = [c for c in columns if isinstance(plain.schema[c].dataType, ArrayType)]
    nullable = [c for c in arrays if null_elements(plain, c)]
    bad = null_checks(plain, columns)
    checks = [F.count(F.lit(1)).alias("rows")] + [F.sum(bad[c].cast("long")).alias(f"nulls:{c}") for c in columns]
    for c in arrays:
        size = F.when(~bad[c], F.size(F.col(c)))
        checks += [F.min(size).alias(f"min:{c}"), F.max(size).alias(f"max:{c}")]
    out = plain.observe(observation, *checks, *content_aggregates())
    if drop_nulls:
        out = out.filter(~any_null(bad))
    # Rows with null elements never reach training (dropped above, or the whole write is discarded by
    # check_observed), so array_compact changes no value; it tells Parquet the elements are never null, which
    # decodes 20% faster (500k rows x 64 floats: 0.17 s instead of 0.21 s, every epoch of a streaming reader).
    out = out.select(*[F.array_compact(c).alias(c) if c in nullable else c for c in columns], _VAL)
    if partitions:
        out = out.repartition(partitions)
    with job_tag(plain.sparkSession, f"TorchEstimator.fit materialize {name}"):
        if store.protocol in SPARK_WRITES:
            out.write.mode("overwrite").partitionBy(_VAL).parquet(store.url(root))
            return None
        return write_with_executors(out, store, root)


def _committed(store: Store, layout: DataLayout, fp: str, attempt: str, written: Optional[Dict[str, List[str]]], reused: bool,
               started: float) -> Materialized:
    root = layout.attempt(attempt)
    train_dir, val_dir = f"{root}/{_VAL}=false", f"{root}/{_VAL}=true"
    if written is not None:
        train, val = pieces_of_files(store, written["false"]), pieces_of_files(store, written["true"])
    else:
        train, val = _pieces(store, train_dir), _pieces(store, val_dir)
    key = f"{layout.root.rstrip('/').rsplit('/', 1)[-1]}/{fp}"
    return Materialized(key, train, val, reused, time.perf_counter() - started)


def _pieces(store: Store, directory: str) -> Tuple[Piece, ...]:
    return list_pieces(store, directory) if store.exists(directory) else ()


def _as_array(df: DataFrame, name: str):
    return as_read(df, name).alias(name) if isinstance(df.schema[name].dataType, VectorUDT) else F.col(name)
