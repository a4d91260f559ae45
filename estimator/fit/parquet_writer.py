"""Executors write their partitions of materialized data to the store through fsspec with pyarrow: for URLs
the cluster's Hadoop cannot write (s3:// or abfs:// without the connectors)."""
from __future__ import annotations

import uuid
from typing import Any, Callable, Dict, Iterator, List, Tuple

import pyarrow as pa

from pyspark.sql import DataFrame

from estimator.fit.fingerprint import SPLIT_COLUMN as _VAL
from store import Store


def write_with_executors(out: DataFrame, store: Store, root: str) -> Dict[str, List[str]]:
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
