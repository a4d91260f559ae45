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

from estimator.data.spill import SPLIT_COLUMN  # the written tag, a partition folder of each copy: __is_val=true/false

FORMAT_VERSION = 2  # 2: the split by row hash, content fingerprints
ROW_HASH = "__row_hash"  # computed while writing, never written
_SPLIT_BUCKETS = 1 << 30


def tagged(df: DataFrame, columns: Sequence[str], validation: Union[None, float, str], seed: int) -> DataFrame:
    """`columns` (as `df` has them), the split tag (SPLIT_COLUMN: true for validation rows) and a 64-bit hash of
    each row's values (ROW_HASH, never written), computed once per row: a seeded fraction's tag is a function
    of it, and the fingerprint aggregates it. A validation column's values are hashed too."""
    hashed = list(columns) + ([validation] if isinstance(validation, str) and validation not in columns else [])
    salt = int(seed) if isinstance(validation, float) else 0  # the seed matters only to a fraction's split
    hashed_df = df.select(*hashed, F.xxhash64(F.lit(salt), *[F.col(c) for c in hashed]).alias(ROW_HASH))
    if isinstance(validation, str):
        tag = F.coalesce(F.col(validation).cast("boolean"), F.lit(False))
    elif validation:
        bucket = F.pmod(F.col(ROW_HASH), F.lit(_SPLIT_BUCKETS))
        tag = bucket < F.lit(int(round(float(validation) * _SPLIT_BUCKETS)))
    else:
        tag = F.lit(False)
    return hashed_df.select(*columns, tag.alias(SPLIT_COLUMN), ROW_HASH)


def content_aggregates() -> List[Column]:
    """Order-free aggregates of ROW_HASH: the row count, the exact sums of the hash's high and low 32 bits
    (longs that cannot overflow below 2^31 rows; a decimal sum costs twice as much) and the xor of the hashes.
    Equal for the same rows however they are partitioned."""
    row_hash = F.col(ROW_HASH)
    return [F.count(F.lit(1)).alias("fp:rows"), F.sum(F.shiftrightunsigned(row_hash, 32)).alias("fp:high"),
            F.sum(row_hash.bitwiseAND(F.lit(0xFFFFFFFF))).alias("fp:low"), F.bit_xor(row_hash).alias("fp:xor")]


def fingerprint(metrics: Dict[str, Any]) -> str:
    """The content fingerprint from the aggregates (as `Observation.get` or a collected row gives them)."""
    return _digest([str(int(metrics.get(name) or 0)) for name in ("fp:rows", "fp:high", "fp:low", "fp:xor")], 24)


def shape_key(schema: StructType, validation: Union[None, float, str], seed: int, files: int,
              drop_nulls: bool) -> str:
    """Everything but the rows: the written columns and types, the split, the file count, null handling."""
    return _digest([schema.json(), repr(validation), str(seed if isinstance(validation, float) else None),
                    str(files), str(drop_nulls), str(FORMAT_VERSION)], 16)


def plan_key(df: DataFrame, shape: str) -> str:
    """What produced the data, from what classic and Connect sessions both answer: the plan's semantic hash
    (expression ids left out; it covers inline data) and the input files. The same DataFrame gives the same
    key; an equal one built again from Spark ML transformers does not (its UDFs are new objects)."""
    return _digest([str(df.semanticHash()), json.dumps(sorted(df.inputFiles())), shape], 24)


def reusable_plan(df: DataFrame) -> bool:
    """Whether the same plan may stand for the same rows without computing them: not when Spark says the plan
    is nondeterministic (unseeded or seeded rand, uuid(), UDFs marked so), where a classic session can tell. A
    Spark Connect client cannot see it: there the same DataFrame is taken for the same rows, as Spark's cache
    would take it."""
    jdf = getattr(df, "_jdf", None)
    if jdf is None:
        return True
    return bool(jdf.queryExecution().analyzed().deterministic())


def _digest(parts: Sequence[str], length: int) -> str:
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:length]
