"""What identifies materialized data: its shape (columns, types, split, files: known from the plan, no job) and
its content (a fingerprint of the rows, computed by Spark: in the writing job itself, or in a pass of its own
when the store already holds data of that shape). Content, not the plan: two transforms of one fitted
PipelineModel hold different UDF objects and so different plans (`semanticHash`), but give the same rows.

The validation split is a function of each row's values and the seed (a hash), not of its position, so the same
rows split the same way however Spark partitions or orders them, and equal rows never straddle the split."""
from __future__ import annotations

import hashlib
import json
from typing import Any, Dict, List, Sequence, Union

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import StructType

FORMAT_VERSION = 2  # 2: the split by row hash, content fingerprints
SPLIT_COLUMN = "__is_val"  # the written tag, a partition folder of each copy: __is_val=true / false
_SPLIT_BUCKETS = 1 << 30
_ROW_HASH_SALT = "estimator-fingerprint"


def split_tag(columns: Sequence[str], validation: Union[None, float, str], seed: int) -> Column:
    """True for the validation rows: a column of the data, or a seeded hash of the row's values."""
    if isinstance(validation, str):
        return F.coalesce(F.col(validation).cast("boolean"), F.lit(False))
    if validation:
        bucket = F.pmod(F.xxhash64(F.lit(int(seed)), *[F.col(c) for c in columns]), F.lit(_SPLIT_BUCKETS))
        return bucket < F.lit(int(round(float(validation) * _SPLIT_BUCKETS)))
    return F.lit(False)


def content_aggregates(columns: Sequence[str]) -> List[Column]:
    """Order-free aggregates of a 64-bit hash of each row (every column, the split tag included): the row count,
    the exact sum of the hashes and their xor. Equal for the same rows however they are partitioned."""
    row_hash = F.xxhash64(F.lit(_ROW_HASH_SALT), *[F.col(c) for c in columns])
    return [F.count(F.lit(1)).alias("fp:rows"), F.sum(row_hash.cast("decimal(20,0)")).alias("fp:sum"),
            F.bit_xor(row_hash).alias("fp:xor")]


def fingerprint(metrics: Dict[str, Any]) -> str:
    """The content fingerprint from the aggregates (as `Observation.get` or a collected row gives them)."""
    parts = [str(int(metrics.get("fp:rows") or 0)), str(metrics.get("fp:sum") or 0), str(metrics.get("fp:xor") or 0)]
    return hashlib.sha256(":".join(parts).encode()).hexdigest()[:24]


def shape_key(schema: StructType, validation: Union[None, float, str], seed: int, files: int,
              drop_nulls: bool) -> str:
    """Everything but the rows: the written columns and types, the split, the file count, null handling."""
    parts = [schema.json(), repr(validation), str(seed if isinstance(validation, float) else None), str(files),
             str(drop_nulls), str(FORMAT_VERSION)]
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:16]


def plan_key(df: DataFrame, shape: str) -> str:
    """What produced the data, from what classic and Connect sessions both answer: the plan's semantic hash
    (expression ids left out; it covers inline data) and the input files. The same DataFrame gives the same
    key; an equal one built again from Spark ML transformers does not (its UDFs are new objects)."""
    parts = [str(df.semanticHash()), json.dumps(sorted(df.inputFiles())), shape]
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:24]


def reusable_plan(df: DataFrame) -> bool:
    """Whether the same plan may stand for the same rows without computing them: not when Spark says the plan
    is nondeterministic (unseeded or seeded rand, uuid(), UDFs marked so), where a classic session can tell. A
    Spark Connect client cannot see it: there the same DataFrame is taken for the same rows, as Spark's cache
    would take it."""
    jdf = getattr(df, "_jdf", None)
    if jdf is None:
        return True
    return bool(jdf.queryExecution().analyzed().deterministic())
