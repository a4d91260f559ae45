"""DataFrame -> Parquet in the store, once per (data, columns, split).

One Spark job selects the columns (vectors become arrays), tags each row train or val with a
seeded split, and writes both splits at once (`partitionBy` on the tag), so the split is
consistent even when upstream row order is not. The write goes to a fresh attempt folder; a
commit marker naming the attempt is written last, and only committed attempts are ever read.
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union

from pyspark.ml.functions import vector_to_array
from pyspark.ml.linalg import VectorUDT
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from estimator.data import list_pieces
from estimator.spec import Piece, total_rows
from store import Store

log = logging.getLogger("estimator")
_VAL = "__is_val"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class Materialized:
    key: str
    train: Tuple[Piece, ...]
    val: Tuple[Piece, ...]
    reused: bool
    seconds: float
    train_dir: str = ""
    val_dir: str = ""

    @property
    def train_rows(self) -> int:
        return total_rows(self.train)

    @property
    def val_rows(self) -> int:
        return total_rows(self.val)


def materialize(df: DataFrame, store: Store, columns: Sequence[str], validation: Union[None, float, str],
                seed: int, num_proc: int, partitions_per_process: Optional[int] = None) -> Materialized:
    """Parquet for (df, columns, split) in the store, written now or reused. Files: exactly
    num_proc * partitions_per_process when that is set, else the DataFrame's partitions, at least num_proc."""
    started = time.perf_counter()
    files = num_proc * partitions_per_process if partitions_per_process else -num_proc  # < 0: "at least"
    key = data_key(df, columns, validation, seed, files)
    layout = store.data(key)
    if store.exists(layout.commit_marker):
        attempt = json.loads(store.read_bytes(layout.commit_marker))["attempt"]
        log.info("Reusing materialized data %s", key)
        return _committed(store, key, attempt, True, started)
    attempt = uuid.uuid4().hex[:12]
    _write(df, store, key, attempt, columns, validation, seed, files)
    result = _committed(store, key, attempt, False, started)
    marker = {"attempt": attempt, "columns": list(columns), "train_rows": result.train_rows,
              "val_rows": result.val_rows, "format": FORMAT_VERSION, "created": time.time()}
    store.write_bytes_atomic(layout.commit_marker, json.dumps(marker).encode())
    log.info("Materialized %d train / %d val rows in %.1fs", result.train_rows, result.val_rows, result.seconds)
    return result


def data_key(df: DataFrame, columns: Sequence[str], validation: Union[None, float, str], seed: int,
             files: int) -> str:
    """What produced the data: the analyzed plan (expression ids removed), its semantic hash (which
    covers inline data), the input files, the columns and the split. Not Python object identity."""
    plan = re.sub(r"#\d+L?", "", df._jdf.queryExecution().analyzed().toString())
    parts = [plan, str(df.semanticHash()), json.dumps(sorted(df.inputFiles())), json.dumps(list(columns)),
             repr(validation), str(seed if isinstance(validation, float) else None), str(FORMAT_VERSION)]
    digest = hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:24]
    return f"{digest}-{abs(files)}"


def _write(df: DataFrame, store: Store, key: str, attempt: str, columns: Sequence[str],
           validation: Union[None, float, str], seed: int, files: int) -> None:
    layout = store.data(key)
    selected = [_as_array(df, c) for c in columns]
    if isinstance(validation, str):
        tag = F.coalesce(F.col(validation).cast("boolean"), F.lit(False))
    elif validation:
        tag = F.rand(seed) < F.lit(float(validation))
    else:
        tag = F.lit(False)
    out = df.select(*selected, tag.alias(_VAL))
    partitions = out.rdd.getNumPartitions()
    if (files > 0 and partitions != files) or partitions < -files:  # at least one file (row group) per rank
        out = out.repartition(abs(files))
    spark = df.sparkSession
    spark.sparkContext.setJobDescription(f"TorchEstimator.fit: materialize {key}")
    try:
        out.write.mode("overwrite").partitionBy(_VAL).parquet(store.url(layout.attempt(attempt)))
    finally:
        spark.sparkContext.setJobDescription(None)


def _committed(store: Store, key: str, attempt: str, reused: bool, started: float) -> Materialized:
    layout = store.data(key)
    root = layout.attempt(attempt)
    train_dir, val_dir = f"{root}/{_VAL}=false", f"{root}/{_VAL}=true"
    return Materialized(key, _pieces(store, train_dir), _pieces(store, val_dir), reused,
                        time.perf_counter() - started, train_dir, val_dir)


def _pieces(store: Store, directory: str) -> Tuple[Piece, ...]:
    return list_pieces(store, directory) if store.exists(directory) else ()


def _as_array(df: DataFrame, name: str):
    if isinstance(df.schema[name].dataType, VectorUDT):
        return vector_to_array(F.col(name), "float32").alias(name)
    return F.col(name)
