"""What transform reads of a DataFrame's Spark types, on the driver: whether a feature column holds chats.
pyspark's driver API, so never imported by what runs on the executors."""
from __future__ import annotations

from pyspark.sql.types import ArrayType, DataType, StructType


def is_chat(dtype: DataType) -> bool:
    return isinstance(dtype, ArrayType) and isinstance(dtype.elementType, StructType)
