"""DataFrame -> Parquet in the store, once per (data, columns, split).

One Spark job selects the columns (vectors become arrays), tags each row train or val with a
seeded split, and writes both splits at once (`partitionBy` on the tag), so the split is
consistent even when upstream row order is not. The write goes to a fresh attempt folder; a
commit marker naming the attempt is written last, and only committed attempts are ever read.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import pyarrow as pa

from pyspark.ml.functions import vector_to_array
from pyspark.ml.linalg import VectorUDT
from pyspark.sql import Column, DataFrame, Observation
from pyspark.sql import functions as F
from pyspark.sql.types import ArrayType

from estimator.data import list_pieces, pieces_of_files
from estimator.session import job_tag
from estimator.spec import Piece, total_rows
from store import Store

log = logging.getLogger("estimator")
_VAL = "__is_val"
FORMAT_VERSION = 1
SPARK_WRITES = ("file", "local", "hdfs", "viewfs")  # URLs Spark's own Parquet writer handles everywhere


@dataclass(frozen=True)
class Materialized:
    key: str
    train: Tuple[Piece, ...]
    val: Tuple[Piece, ...]
    reused: bool
    seconds: float

    @property
    def train_rows(self) -> int:
        return total_rows(self.train)

    @property
    def val_rows(self) -> int:
        return total_rows(self.val)


def materialize(df: DataFrame, store: Store, columns: Sequence[str], validation: Union[None, float, str],
                seed: int, num_proc: int, partitions_per_process: Optional[int] = None,
                drop_nulls: bool = False) -> Materialized:
    """Parquet for (df, columns, split) in the store, written now or reused. Files: exactly
    num_proc * partitions_per_process when that is set, else the DataFrame's partitions, at least num_proc."""
    started = time.perf_counter()
    files = num_proc * partitions_per_process if partitions_per_process else -num_proc  # < 0: "at least"
    key = data_key(df, columns, validation, seed, files) + ("-dropnulls" if drop_nulls else "")
    layout = store.data(key)
    if store.exists(layout.commit_marker):
        marker = json.loads(store.read_bytes(layout.commit_marker))
        log.info("Reusing materialized data %s", key)
        return _committed(store, key, marker["attempt"], marker.get("files"), True, started)
    attempt = uuid.uuid4().hex[:12]
    observation = Observation(f"checks-{attempt}")
    written = _write(df, store, key, attempt, columns, validation, seed, files if files > 0 else None, observation,
                     drop_nulls)
    try:
        check_observed(observation.get, columns, drop_nulls)
    except ValueError:
        store.rm(layout.attempt(attempt))  # never committed, never reused; nothing of the user's is touched
        raise
    result = _committed(store, key, attempt, written, False, started)
    if files < 0 and len(result.train) < num_proc <= result.train_rows:
        # Fewer row groups than ranks (a DataFrame of few partitions): written once more over num_proc files,
        # so that every rank has its own row group (petastorm needs it; the arrow reader reads less).
        log.info("The DataFrame wrote %d training row groups for %d ranks: writing it again in %d partitions",
                 len(result.train), num_proc, num_proc)
        store.rm(layout.attempt(attempt))
        attempt = uuid.uuid4().hex[:12]
        written = _write(df, store, key, attempt, columns, validation, seed, num_proc,
                         Observation(f"checks-{attempt}"), drop_nulls)
        result = _committed(store, key, attempt, written, False, started)
    marker = {"attempt": attempt, "columns": list(columns), "train_rows": result.train_rows,
              "val_rows": result.val_rows, "format": FORMAT_VERSION, "created": time.time(), "files": written}
    store.write_bytes_atomic(layout.commit_marker, json.dumps(marker).encode())
    log.info("Materialized %d train / %d val rows in %.1fs", result.train_rows, result.val_rows, result.seconds)
    return result


def data_key(df: DataFrame, columns: Sequence[str], validation: Union[None, float, str], seed: int,
             files: int) -> str:
    """What produced the data, from what classic and Connect sessions both answer: the plan's semantic hash
    (expression ids left out; it covers inline data), the schema, the input files, the columns and the split.
    Not Python object identity."""
    parts = [str(df.semanticHash()), df.schema.json(), json.dumps(sorted(df.inputFiles())),
             json.dumps(list(columns)), repr(validation), str(seed if isinstance(validation, float) else None),
             str(FORMAT_VERSION)]
    digest = hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:24]
    return f"{digest}-{abs(files)}"


def _write(df: DataFrame, store: Store, key: str, attempt: str, columns: Sequence[str],
           validation: Union[None, float, str], seed: int, partitions: Optional[int], observation: Observation,
           drop_nulls: bool) -> Optional[Dict[str, List[str]]]:
    """Write both splits (in `partitions` partitions when given, else the DataFrame's own); returns the files
    written when executors wrote them (None: Spark's writer). The same job counts rows with nulls and array
    lengths per column (`observation`): no extra pass."""
    layout = store.data(key)
    selected = [_as_array(df, c) for c in columns]
    if isinstance(validation, str):
        tag = F.coalesce(F.col(validation).cast("boolean"), F.lit(False))
    elif validation:
        tag = F.rand(seed) < F.lit(float(validation))
    else:
        tag = F.lit(False)
    plain = df.select(*selected, tag.alias(_VAL))
    arrays = [c for c in columns if isinstance(plain.schema[c].dataType, ArrayType)]
    bad = {c: _has_null(F.col(c), c in arrays) for c in columns}
    checks = [F.count(F.lit(1)).alias("rows")] + [F.sum(bad[c].cast("long")).alias(f"nulls:{c}") for c in columns]
    for c in arrays:
        size = F.when(~bad[c], F.size(F.col(c)))
        checks += [F.min(size).alias(f"min:{c}"), F.max(size).alias(f"max:{c}")]
    out = plain.observe(observation, *checks)
    if drop_nulls:
        out = out.filter(~functools.reduce(lambda a, b: a | b, bad.values()))
    # Rows with null elements never reach training (dropped above, or the whole write is discarded by
    # check_observed), so array_compact changes no value; it tells Parquet the elements are never null, which
    # decodes 20% faster (500k rows x 64 floats: 0.17 s instead of 0.21 s, every epoch of a streaming reader).
    out = out.select(*[F.array_compact(c).alias(c) if c in arrays else c for c in columns], _VAL)
    if partitions:
        out = out.repartition(partitions)
    with job_tag(df.sparkSession, f"TorchEstimator.fit materialize {key}"):
        if store.protocol in SPARK_WRITES:
            out.write.mode("overwrite").partitionBy(_VAL).parquet(store.url(layout.attempt(attempt)))
            return None
        return _write_with_executors(out, store, layout.attempt(attempt))


def _write_with_executors(out: DataFrame, store: Store, root: str) -> Dict[str, List[str]]:
    """Executors write their partitions to the store through fsspec (for URLs the cluster's Hadoop
    cannot write, such as s3:// or abfs:// without the connectors). Only the files of successful task
    attempts come back here and go into the commit marker, so a retried task never duplicates rows."""
    rows = out.mapInArrow(_partition_writer(store, root), "split string, path string").collect()
    files: Dict[str, List[str]] = {"false": [], "true": []}
    for row in rows:
        files[row.split].append(row.path)
    return {split: sorted(paths) for split, paths in files.items()}


def _partition_writer(store: Store, root: str) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    def write(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import pyarrow.compute as pc
        import pyarrow.parquet as pq
        from pyspark import TaskContext

        task = TaskContext.get()
        name = f"part-{task.partitionId():05d}-{task.attemptNumber()}-{uuid.uuid4().hex[:8]}.parquet"
        open_files: Dict[str, Tuple[Any, Any]] = {}
        try:
            for batch in batches:
                table = pa.Table.from_batches([batch])
                for split in ("false", "true"):
                    part = table.filter(pc.equal(table.column(_VAL), split == "true"))
                    part = part.select([c for c in part.column_names if c != _VAL])
                    if part.num_rows == 0:
                        continue
                    if split not in open_files:
                        path = f"{root}/{_VAL}={split}/{name}"
                        store.makedirs(f"{root}/{_VAL}={split}")
                        handle = store.fs.open(path, "wb")
                        open_files[split] = (handle, pq.ParquetWriter(handle, part.schema), path)
                    open_files[split][1].write_table(part)
        finally:
            for handle, writer, _ in open_files.values():
                writer.close()
                handle.close()
        splits = list(open_files)
        yield pa.RecordBatch.from_pydict({"split": splits, "path": [open_files[s][2] for s in splits]})

    return write


def _committed(store: Store, key: str, attempt: str, written: Optional[Dict[str, List[str]]], reused: bool,
               started: float) -> Materialized:
    layout = store.data(key)
    root = layout.attempt(attempt)
    train_dir, val_dir = f"{root}/{_VAL}=false", f"{root}/{_VAL}=true"
    if written is not None:
        train, val = pieces_of_files(store, written["false"]), pieces_of_files(store, written["true"])
    else:
        train, val = _pieces(store, train_dir), _pieces(store, val_dir)
    return Materialized(key, train, val, reused, time.perf_counter() - started)


def _pieces(store: Store, directory: str) -> Tuple[Piece, ...]:
    return list_pieces(store, directory) if store.exists(directory) else ()


def _has_null(column: Column, is_array: bool) -> Column:
    """The value is null, or (for arrays) holds a null element."""
    return column.isNull() | F.exists(column, lambda x: x.isNull()) if is_array else column.isNull()


def check_observed(metrics: Dict[str, Any], columns: Sequence[str], drop_nulls: bool) -> None:
    """Nulls and ragged arrays, measured while writing: an error naming the column, the count and the fix."""
    rows = int(metrics.get("rows") or 0)
    nulls = {c: int(metrics.get(f"nulls:{c}") or 0) for c in columns}
    if drop_nulls:
        dropped = {c: n for c, n in nulls.items() if n}
        if dropped:
            log.warning("drop_nulls=True: skipped the rows with nulls (%s) of %d rows", ", ".join(
                f"{c}: {n}" for c, n in dropped.items()), rows)
    else:
        for column, count in nulls.items():
            if count:
                raise ValueError(f"Column {column!r} has {count} rows with null values (of {rows} rows). Fill or drop "
                                 "them first (df.fillna / df.dropna), or set drop_nulls=True to skip those rows.")
    for column in columns:
        low, high = metrics.get(f"min:{column}"), metrics.get(f"max:{column}")
        if low is not None and low != high:
            raise ValueError(f"Column {column!r} holds arrays of different lengths ({low} to {high} values per row); "
                             "every row must have the same number of values. Pad or filter them first.")
        if low == 0:
            raise ValueError(f"Column {column!r} holds empty arrays; every row needs at least one value.")


def _as_array(df: DataFrame, name: str):
    if isinstance(df.schema[name].dataType, VectorUDT):
        return vector_to_array(F.col(name), "float32").alias(name)
    return F.col(name)
