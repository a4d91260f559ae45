"""What the rows must be (no nulls, arrays of one length, not empty), checked from counts: counts Spark observes
while materializing, or counts each rank takes of the Arrow batches it spills in the direct mode, summed over
ranks. One set of messages for both. pyarrow only, no pyspark."""
from __future__ import annotations

import logging
from typing import Any, Dict, Iterable, Sequence

import pyarrow as pa
import pyarrow.compute as pc

from estimator.failures import FailureKind

log = logging.getLogger("estimator")


class BadRows(ValueError):
    """The DataFrame's rows cannot be trained on (nulls, ragged or empty arrays): the same rows fail every time,
    so another launch cannot help."""

    failure_kind = FailureKind.DATA


def batch_counts(batch: pa.RecordBatch, columns: Sequence[str]) -> Dict[str, int]:
    """The counts `check_observed` reads, of one Arrow batch: rows, rows with nulls (a null value or, in an
    array, a null element) per column, and the least and most values of a row per array column."""
    counts = {"rows": batch.num_rows}
    for name in columns:
        column = batch.column(name)
        bad = column.null_count
        if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
            values = column.flatten()
            if values.null_count:  # rows holding a null element (a null row has no elements)
                parents = pc.list_parent_indices(column).filter(pc.is_null(values))
                bad += len(pc.unique(parents))
            lengths = pc.min_max(pc.list_value_length(column))
            if lengths["min"].is_valid:
                counts[f"min:{name}"], counts[f"max:{name}"] = lengths["min"].as_py(), lengths["max"].as_py()
        counts[f"nulls:{name}"] = bad
    return counts


def merged(parts: Iterable[Dict[str, Any]]) -> Dict[str, int]:
    """Counts of several batches (or ranks) as one: sums, and the least and most array lengths."""
    total: Dict[str, int] = {}
    for part in parts:
        for key, value in part.items():
            if value is None:
                continue
            if key not in total:
                total[key] = value
            elif key.startswith("min:"):
                total[key] = min(total[key], value)
            elif key.startswith("max:"):
                total[key] = max(total[key], value)
            else:
                total[key] += value
    return total


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
                raise BadRows(f"Column {column!r} has {count} rows with null values (of {rows} rows). Fill or drop "
                              "them first (df.fillna / df.dropna), or set drop_nulls=True to skip those rows.")
    for column in columns:
        low, high = metrics.get(f"min:{column}"), metrics.get(f"max:{column}")
        if low is not None and low != high:
            raise BadRows(f"Column {column!r} holds arrays of different lengths ({low} to {high} values per row); "
                          "every row must have the same number of values. Pad or filter them first.")
        if low == 0:
            raise BadRows(f"Column {column!r} holds empty arrays; every row needs at least one value.")
