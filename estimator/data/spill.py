"""The direct mode's rank side: the Arrow batches Spark hands a barrier task (its partition of the DataFrame,
computed as the task runs) written to this host's local disk as it receives them, one Parquet file per split,
then described as a DataSpec that the readers (cached or streaming) take like materialized data. Memory: one
row group per split being filled (ROW_GROUP_BYTES), never the partition.

Every rank also counts its rows (estimator.data.row_checks); the counts travel in the rendezvous, so every rank
makes the same checks over all the rows and plans the same number of steps. pyarrow only, no pyspark.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, replace
from typing import Any, Dict, Iterable, List, Optional, Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from estimator.core.spec import DataSpec
from estimator.data.parquet import pieces_of_files
from estimator.data.row_checks import BadRows, batch_counts, check_observed, merged
from store import LocalStore

SPLIT_COLUMN = "__is_val"  # the split tag the driver adds (true: a validation row); written by materialize too
ROW_GROUP_BYTES = 32 << 20  # rows gathered before a row group is written: the streaming reader's unit
SPLITS = {False: "train.parquet", True: "val.parquet"}


@dataclass(frozen=True)
class Spilled:
    """One rank's partition on its local disk."""

    root: str
    counts: Dict[str, int]  # estimator.data.row_checks counts, with "train_rows" and "val_rows"
    seconds: float


def spill_root(name: str) -> str:
    """A fresh folder under Spark's local directory for the task (SPARK_LOCAL_DIRS, which Spark sets for its
    Python workers: the executor's scratch disks), else the system's temporary folder."""
    base = (os.environ.get("SPARK_LOCAL_DIRS") or "").split(",")[0] or tempfile.gettempdir()
    return os.path.join(base, f"spark-torch-estimator-{name}")


def spill(batches: Iterable[pa.RecordBatch], root: str, columns: Sequence[str]) -> Spilled:
    """Write `columns` of the batches to root/train.parquet and root/val.parquet by SPLIT_COLUMN; count them."""
    started = time.perf_counter()
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    writers = {val: _SplitWriter(os.path.join(root, name)) for val, name in SPLITS.items()}
    counts: List[Dict[str, int]] = []
    try:
        for batch in batches:
            if not batch.num_rows:
                continue
            counts.append(batch_counts(batch, columns))
            data = pa.RecordBatch.from_arrays([batch.column(c) for c in columns], names=list(columns))
            tag = batch.column(SPLIT_COLUMN)
            val_rows = pc.sum(tag.cast(pa.int64())).as_py() or 0
            if val_rows in (0, batch.num_rows):
                writers[bool(val_rows)].add(data)
            else:
                writers[True].add(data.filter(tag))
                writers[False].add(data.filter(pc.invert(tag)))
    finally:
        for writer in writers.values():
            writer.close()
    total = merged(counts)
    total.update(train_rows=writers[False].rows, val_rows=writers[True].rows)
    return Spilled(root, total, time.perf_counter() - started)


def local_data(data: DataSpec, spilled: Spilled) -> DataSpec:
    """This rank's DataSpec over its spilled rows, before it knows the other ranks' counts (`rank_data`): its
    shards can be read while the ranks meet."""
    local = LocalStore(spilled.root)
    pieces = {val: pieces_of_files(local, [os.path.join(spilled.root, name)])
              if os.path.exists(os.path.join(spilled.root, name)) else () for val, name in SPLITS.items()}
    return replace(data, train=pieces[False], val=pieces[True], local=local,
                   largest_shard=spilled.counts["train_rows"])


def rank_data(local: DataSpec, ranks: Sequence[Dict[str, Any]]) -> DataSpec:
    """`local_data`'s DataSpec, given every rank's counts (`ranks`, in rank order): the same checks, with the
    same outcome, on every rank; every rank plans as many draws as the largest shard has."""
    check_observed(merged(ranks), local.columns, drop_nulls=False)
    empty = [rank for rank, c in enumerate(ranks) if not c.get("train_rows")]
    if empty:
        total = sum(c.get("train_rows", 0) for c in ranks)
        raise BadRows(f"data_mode='direct': rank(s) {empty} received no training rows of the DataFrame ({total} "
                      f"training rows over {len(ranks)} ranks): every rank needs at least one. Use more rows, a "
                      "smaller validation, fewer processes, or data_mode='materialize'.")
    return replace(local, largest_shard=max(c["train_rows"] for c in ranks))


class _SplitWriter:
    """One split's Parquet file, written a row group at a time (uncompressed: local disk, read every epoch)."""

    def __init__(self, path: str):
        self.path, self.rows = path, 0
        self._writer: Optional[pq.ParquetWriter] = None
        self._pending: List[pa.RecordBatch] = []
        self._bytes = 0

    def add(self, batch: pa.RecordBatch) -> None:
        self._pending.append(batch)
        self._bytes += batch.nbytes
        self.rows += batch.num_rows
        if self._bytes >= ROW_GROUP_BYTES:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        table = pa.Table.from_batches(self._pending)
        if self._writer is None:
            self._writer = pq.ParquetWriter(self.path, table.schema, compression="none")
        self._writer.write_table(table, row_group_size=table.num_rows)
        self._pending, self._bytes = [], 0

    def close(self) -> None:
        try:
            self._flush()
        finally:
            if self._writer is not None:
                self._writer.close()
