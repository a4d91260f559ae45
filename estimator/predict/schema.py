"""The Spark types of transform's columns, on the driver: what a feature column holds (a chat) and the Spark
fields of the columns an output kind adds, from its predictor's Arrow types. pyspark's driver API, so never
imported by what runs on the executors (inference, predictor, the kinds)."""
from __future__ import annotations

import functools
from typing import Dict, List, Optional, Sequence, Tuple

import pyarrow as pa
from pyspark.ml.functions import vector_to_array
from pyspark.ml.linalg import VectorUDT
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import from_arrow_type
from pyspark.sql.types import ArrayType, DataType, MapType, StructField, StructType

from estimator.data.lm import CHAT_TYPE  # noqa: F401 - this module's name for the driver's users
from estimator.predict.predictor import Predictor



def as_read(df: DataFrame, name: str) -> Column:
    """Column `name` as the ranks and transform read it: an ml Vector (VectorAssembler's) as array<float>, a
    null vector as a null array, which is then named as any null is (vector_to_array fails on a null: Spark's
    FAILED_EXECUTE_UDF, inside the job); any other column as it is."""
    column = F.col(name)
    if not isinstance(df.schema[name].dataType, VectorUDT):
        return column
    return F.when(column.isNull(), F.lit(None)).otherwise(vector_to_array(column, "float32"))


def null_checks(plain: DataFrame, columns: Sequence[str]) -> Dict[str, Column]:
    """Per column: the value is null, or holds a null element. Elements are looked at only where the type allows
    null elements (not vector_to_array's or F.array's of non-null values): a lambda over every element costs 15%
    of the write (1M rows x 32 floats). What the data's write counts and drop_nulls drops (estimator.fit), and
    what transform's handle_invalid='skip' leaves out."""
    return {c: F.col(c).isNull() | F.exists(F.col(c), lambda x: x.isNull()) if null_elements(plain, c)
            else F.col(c).isNull() for c in columns}


def any_null(checks: Dict[str, Column]) -> Column:
    return functools.reduce(lambda a, b: a | b, checks.values())


def null_elements(plain: DataFrame, column: str) -> bool:
    kind = plain.schema[column].dataType
    return isinstance(kind, ArrayType) and kind.containsNull


def is_chat(dtype: DataType) -> bool:
    return isinstance(dtype, ArrayType) and isinstance(dtype.elementType, StructType)


def chat_of_maps(column: str, dtype: DataType, source: str = "feature_cols") -> Optional[str]:
    """The refusal of a column of maps where a chat's messages are structs (what createDataFrame makes of a list of
    dicts without a schema), with the line that converts it; None for any other column."""
    if not (isinstance(dtype, ArrayType) and isinstance(dtype.elementType, MapType)):
        return None
    return (f"Column {column!r} (from {source}) is {dtype.simpleString()}, and a chat column's messages are "
            f"structs: {CHAT_TYPE} (a list of dicts given to createDataFrame without a schema becomes maps). "
            f"Convert it first: F.transform(F.col({column!r}), lambda m: F.struct(m['role'].alias('role'), "
            "m['content'].alias('content'))), or give createDataFrame the schema.")


def added_fields(predictor: Predictor) -> List[Tuple[StructField, str]]:
    """Each column the predictor adds, as a Spark field, with the field of the UDF's struct it comes from."""
    types = {field.name: field.type for field in predictor.arrow_type()}
    return [(StructField(a.name, VectorUDT() if a.vector else spark_type(types[a.field]), a.nullable), a.field)
            for a in predictor.added]


def spark_type(t: pa.DataType) -> DataType:
    """Arrow -> Spark, keeping whether list elements may be null (pyspark 3.5's converter drops that)."""
    if pa.types.is_struct(t):
        return StructType([StructField(f.name, spark_type(f.type), True) for f in t])
    if pa.types.is_list(t):
        return ArrayType(spark_type(t.value_type), t.value_field.nullable)
    return from_arrow_type(t)
