"""The Spark types of transform's columns, on the driver: what a feature column holds (a chat) and the Spark
fields of the columns an output kind adds, from its predictor's Arrow types. pyspark's driver API, so never
imported by what runs on the executors (inference, predictor, the kinds)."""
from __future__ import annotations

from typing import List, Tuple

import pyarrow as pa
from pyspark.ml.linalg import VectorUDT
from pyspark.sql.pandas.types import from_arrow_type
from pyspark.sql.types import ArrayType, DataType, StructField, StructType

from estimator.predict.predictor import Predictor


def is_chat(dtype: DataType) -> bool:
    return isinstance(dtype, ArrayType) and isinstance(dtype.elementType, StructType)


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
