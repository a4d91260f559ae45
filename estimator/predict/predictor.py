"""What an output kind of transform is: a Predictor. One class per value of TorchModel's `output_kind`, one module
each in estimator.predict.kinds, where the registry PREDICTORS maps the value to the class.

A predictor is plain frozen data: built once on the driver from the model's params (`build`, which also refuses
what the kind cannot run, by name), pickled into the UDF's closure and run on the executors, where
estimator.predict.inference hands it one batch of feature columns and the model that worker cached. It declares:
  - the params it reads: its own fields (only a kind that generates holds max_new_tokens);
  - the columns transform adds (`added`: each column's name and the field of the UDF's struct it is taken from;
    the Spark type follows from that field's Arrow type, or is Spark ML's Vector where `vector` says so);
  - the Arrow struct the UDF returns (`arrow_type`), and the arrays of one batch in that struct's field order
    (`predict`).
Nothing here or in a kind imports pyspark's driver API: the classes are imported where the UDF runs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa

PREDICTION_FIELD = "_prediction"  # the struct's field behind prediction_col, whatever the kind puts there
DEFAULT_ROWS = 1024  # rows per call in transform where inference_batch_size is None


@dataclass(frozen=True)
class Added:
    """A column transform adds: `name` in the DataFrame, taken from `field` of the UDF's struct."""
    name: str
    field: str
    nullable: bool = False  # as Spark's schema of the result says it (a text may be null, a number is not)
    vector: bool = False  # the field's list<double> becomes a Spark ML Vector (VectorUDT), as Spark ML's heads


@dataclass(frozen=True, kw_only=True)
class Predictor:
    """The fields every kind shares: how batches are read and where they run."""
    feature_cols: Tuple[str, ...]
    batch_size: Optional[int]  # rows per forward (or generate) call; None: a kind's own bound (generate's tokens)
    use_gpu: Optional[bool]
    added: Tuple[Added, ...] = ()  # the driver's: which columns of the DataFrame the struct's fields become
    torch_threads: Optional[int] = None  # the cores of one Spark task (spark.task.cpus); None: torch's default
    tokenize: Any = None  # estimator.data.text.Tokenize: string columns tokenized per batch of batch_size rows

    accepts_chat: ClassVar[bool] = False  # a chat column (array<struct<role, content>>) is this kind's input
    reads_text: ClassVar[bool] = False  # its feature column is text (a string column, or a chat where accepted)
    generates: ClassVar[bool] = False  # it generates text (max_new_tokens and generation_batching apply)

    @classmethod
    def build(cls, p: Dict[str, Any], outputs: List[str], torch_threads: Optional[int] = None) -> "Predictor":
        """The predictor of a TorchModel's validated params `p`, whose output columns are `outputs`; raises
        ValueError, naming the param and the fix, for what this kind cannot run."""
        raise NotImplementedError(f"{cls.__name__}.build")

    @staticmethod
    def shared(p: Dict[str, Any], added: Sequence[Added], torch_threads: Optional[int],
               tokenize: Any) -> Dict[str, Any]:
        """The shared fields' values, from the params, for a kind's `build`."""
        rows = p["inference_batch_size"] if p["inference_batch_size"] is not None else DEFAULT_ROWS
        return dict(feature_cols=tuple(p["feature_cols"]), batch_size=rows, use_gpu=p["use_gpu"],
                    added=tuple(added), torch_threads=torch_threads, tokenize=tokenize)

    def bind_chat(self, chat: bool) -> "Predictor":
        """The predictor for a DataFrame whose feature column holds chats (`chat`), or not: only a kind that
        accepts_chat reads them differently."""
        return self

    def input_cols(self) -> Tuple[str, ...]:
        """The DataFrame's columns the UDF is given, in the order `predict` receives them: the feature columns (a
        kind that reads a label column too, as 'score' reads a response, adds it)."""
        return self.feature_cols

    def arrow_type(self) -> pa.StructType:
        raise NotImplementedError(f"{type(self).__name__}.arrow_type")

    def predict(self, model: Any, columns: Sequence[np.ndarray], device: str) -> List[pa.Array]:
        """One array per field of arrow_type(), in its order, each a row per input row (an empty batch may give
        none). `columns`: the feature columns, each (rows,) or (rows, n); `model` is on `device`."""
        raise NotImplementedError(f"{type(self).__name__}.predict")


def output_fields(count: int) -> Tuple[str, ...]:
    """The struct's fields of a model's outputs, one per output column: _0, _1, ..."""
    return tuple(f"_{i}" for i in range(count))


def rows_type(dtype: pa.DataType) -> pa.ListType:
    return pa.list_(pa.field("element", dtype, nullable=False))  # Spark: array<float> without null elements


def arrow_rows(values: np.ndarray, dtype: pa.DataType) -> pa.ListArray:
    """(rows, width) -> a list column of `width` values per row, without Python objects."""
    rows, width = values.shape[0], int(np.prod(values.shape[1:]))
    offsets = pa.array(np.arange(0, (rows + 1) * width, width, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(values.reshape(-1), dtype), type=rows_type(dtype))
