"""The direct mode (data_mode='direct'): no copy of the data in the store. The ranks are the barrier tasks of
the DataFrame's own last stage: the columns and split tag as materialize selects them (estimator.fit.materialize),
spread over num_proc partitions by their row hash (so the same rows go to the same rank every time; the shards
differ by about the square root of their size), each partition sorted by that hash so that a retry receives its
rows in the same order and a resume inside an epoch continues exactly. Each rank spills what it receives to
local disk (estimator.data.spill) and trains on it. A retry computes the DataFrame again.

Round robin (`repartition(n)`) would give shards equal to a row, but Spark sorts every input partition by whole
rows to make it deterministic: 7.5 s instead of 4.9 s to hand 4M rows x 32 floats to 2 ranks (RESULTS.md)."""
from __future__ import annotations

from typing import Sequence, Tuple, Union

import pyarrow as pa
from pyspark.sql import DataFrame

from estimator.data.arrays import Arrays
from estimator.data.arrays import table_to_arrays
from estimator.fit.fingerprint import ROW_HASH, SPLIT_COLUMN
from estimator.fit.materialize import selected
from estimator.predict.schema import any_null, null_checks


def direct_source(df: DataFrame, columns: Sequence[str], validation: Union[None, float, str], seed: int,
                  num_proc: int, drop_nulls: bool) -> Tuple[DataFrame, DataFrame]:
    """(the selected rows without nulls, for the dry run's head; the ranks' input: num_proc partitions, each in
    row-hash order). Rows with nulls reach the ranks unless drop_nulls: the ranks count them, exactly."""
    plain = selected(df, columns, validation, seed)
    clean = plain.filter(~any_null(null_checks(plain, columns)))
    source = (clean if drop_nulls else plain).repartition(num_proc, ROW_HASH).sortWithinPartitions(ROW_HASH)
    return clean, source.select(*columns, SPLIT_COLUMN)


def head(plain: DataFrame, columns: Sequence[str], rows: int) -> Arrays:
    """The first `rows` rows, for the driver's dry run (a small job: Spark computes only what the limit needs)."""
    first = plain.select(*columns).limit(rows)
    if hasattr(first, "toArrow"):  # Spark 4, classic and Connect
        table = first.toArrow()
    else:  # Spark 3.5, classic
        batches = first._collect_as_arrow()
        table = pa.Table.from_batches(batches) if batches else None
    return table_to_arrays(table, columns)
