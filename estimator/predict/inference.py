"""Batched prediction on executors: Arrow arrays in, an Arrow struct of outputs out, for any output kind. pyspark
only to ask the running task which GPU Spark assigned to it.

What is shared by every kind lives here: the feature columns as numpy arrays, the device and torch's threads, the
model unpickled once per Python worker (Spark reuses workers) and kept in a small cache keyed by the model's
content hash (so each Arrow batch costs only the conversion and the forward), forward passes in batches, the
UDF's function (Arrow, or pandas for pyspark 3.5) and its TransformFailed. What a kind computes from the model
and which struct it returns is its Predictor's (estimator.predict.predictor; the kinds in estimator.predict.kinds).
"""
from __future__ import annotations

import pickle
import traceback
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torch import nn

from estimator.core.devices import assigned_gpu
from estimator.core.handle import ModelHandle
from estimator.core.outputs import forward, outputs_of
from estimator.data.arrays import column_to_numpy, is_list, reshape
from estimator.data.frames import torch_dtype_array
from estimator.lm.continuous import release
from estimator.predict.predictor import Predictor

_CACHE: "OrderedDict[Tuple[str, str], nn.Module]" = OrderedDict()
_CACHE_SIZE = 2


@dataclass(frozen=True)
class ModelFile:
    """A pickled model too large to travel inside the UDF (Spark Connect carries a plan in one gRPC message of at
    most 128 MB by default), sent with the session's files: `SparkFiles.get(name)` on the executors."""
    name: str


INLINE_BYTES = 16 * 2 ** 20  # larger pickled models travel as a ModelFile
Pickled = Union[bytes, ModelFile]


def cached_model(key: str, blob: Pickled, device: str) -> nn.Module:
    if (key, device) not in _CACHE:
        if isinstance(blob, ModelFile):
            from pyspark import SparkFiles

            with open(SparkFiles.get(blob.name), "rb") as handle:
                blob = handle.read()
        sent = pickle.loads(blob)
        # a handle (estimator.core.handle): the base built here from its factory, once per worker, with the adapters
        model = (sent.build() if isinstance(sent, ModelHandle) else sent).to(device).eval()
        _CACHE[(key, device)] = model
        while len(_CACHE) > _CACHE_SIZE:
            release(_CACHE.popitem(last=False)[1])  # a kept continuous-batching manager's cache with it
    _CACHE.move_to_end((key, device))
    return _CACHE[(key, device)]


def device_for(use_gpu: Optional[bool], assigned_gpu: Optional[str] = None) -> str:
    """The GPU Spark assigned to this task (spark.task.resource.gpu.amount), else the current CUDA device,
    else the CPU. Without the assignment every task of a multi-GPU executor would run on GPU 0."""
    if use_gpu is False or not torch.cuda.is_available():
        return "cpu"
    return f"cuda:{int(assigned_gpu)}" if assigned_gpu is not None else "cuda"


def task_gpu() -> Optional[str]:
    """The first GPU address Spark assigned to the running task, if any (None outside a Spark task)."""
    try:
        from pyspark import TaskContext

        return assigned_gpu(TaskContext.get())
    except Exception:  # noqa: BLE001 - no Spark here, or no resources: the default device
        return None


def predict_arrow(key: str, blob: Pickled, predictor: Predictor, *columns: pa.Array) -> pa.StructArray:
    for name, column in zip(predictor.input_cols(), columns):
        bad = int(null_rows([column]).sum()) if column.null_count or is_list(column.type) else 0
        if bad:
            raise ValueError(null_values(name, bad, len(column), column.null_count < bad))
    values = [column_to_numpy(pa.chunked_array([c]), name) for name, c in zip(predictor.input_cols(), columns)]
    return predict_columns(key, blob, predictor, values)


def null_values(name: str, count: int, rows: int, inside: bool = False) -> str:
    what = "rows with a null value or an array holding a null" if inside else "null values"
    return (f"Column {name!r} has {count} {what} (in a batch of {rows} rows): fill or drop them first, or set "
            "handle_invalid='keep' (null outputs for such a row) or 'skip' (the row left out of the result).")


def predict_columns(key: str, blob: Pickled, predictor: Predictor, columns: Sequence[np.ndarray]) -> pa.StructArray:
    """The UDF's struct (predictor.arrow_type()) for feature columns given as (rows,) or (rows, n) arrays."""
    device = device_for(predictor.use_gpu, task_gpu() if predictor.use_gpu is not False else None)
    if predictor.torch_threads and torch.get_num_threads() != predictor.torch_threads:
        torch.set_num_threads(predictor.torch_threads)  # every task of an executor runs its own forward passes
    model = cached_model(key, blob, device)
    return to_struct(predictor.predict(model, columns, device), predictor.arrow_type())


def to_struct(arrays: Sequence[pa.Array], struct: pa.StructType) -> pa.StructArray:
    if not arrays:  # an empty batch
        return pa.array([], type=struct)
    return pa.StructArray.from_arrays(list(arrays), fields=list(struct))


def model_inputs(columns: Sequence[np.ndarray], names: Sequence[str],
                 input_shapes: Optional[Sequence[Sequence[int]]] = None,
                 feature_sizes: Optional[Sequence[int]] = None) -> List[np.ndarray]:
    """The feature columns as the model takes them: checked against the values per row it was trained on
    (`feature_sizes`), reshaped by `input_shapes`, in torch's dtypes, writable and contiguous."""
    arrays = []
    for i, (name, values) in enumerate(zip(names, columns)):
        found = int(np.prod(values.shape[1:])) if values.ndim > 1 else 1
        if feature_sizes and len(values) and found != feature_sizes[i]:
            raise ValueError(f"Column {name!r} has {found} values per row, but the model was trained on "
                             f"{feature_sizes[i]}: give transform the column as it was at fit.")
        shape = input_shapes[i] if input_shapes else None
        arrays.append(np.require(reshape(torch_dtype_array(values), shape, name), requirements=["C", "W"]))
    return arrays


def forward_outputs(raw: Any, batch: Sequence[Any]) -> Sequence[torch.Tensor]:
    """What predict_numpy keeps of a forward by default: its outputs, one per label column (core.outputs)."""
    return outputs_of(raw)


Read = Callable[[Any, Sequence[Any]], Sequence[torch.Tensor]]  # (forward's result, its inputs) -> per-row tensors


def predict_numpy(model: nn.Module, arrays: Sequence[np.ndarray], batch_size: int, device: str,
                  tokenize: Any = None, read: Read = forward_outputs) -> List[np.ndarray]:
    """Outputs batch by batch, each (rows, width) float32; a text column (strings, with `tokenize`) becomes
    forward's keyword inputs. `read` picks what a forward's result gives per row (a kind's own: the embedding
    kind pools hidden states), from the result and the batch it was given."""
    rows = arrays[0].shape[0] if arrays else 0
    chunks = []

    def tensors(a: np.ndarray) -> Any:
        if a.dtype == object and tokenize is not None:
            return {k: torch.from_numpy(v).to(device) for k, v in tokenize.encode(a).items()}
        return torch.from_numpy(a).to(device)

    with torch.inference_mode():
        for start in range(0, rows, batch_size):
            batch = [tensors(a[start:start + batch_size]) for a in arrays]
            out = read(forward(model, batch), batch)
            chunks.append([o.detach().float().reshape(o.shape[0], -1).cpu().numpy() for o in out])
    if not chunks:
        return []
    return [np.concatenate([c[i] for c in chunks]) for i in range(len(chunks[0]))]


def pandas_frame(struct: pa.StructArray) -> Any:
    """The struct as pyspark 3.5's pandas UDF returns it, a pandas DataFrame with one column per field: a list
    field's rows as numpy arrays, a string field's as str, numbers as a numpy column."""
    import pandas as pd

    columns = {}
    for i, field in enumerate(struct.type):
        values = struct.field(i)
        if pa.types.is_list(field.type):
            columns[field.name] = list(values.to_numpy(zero_copy_only=False))
        elif pa.types.is_string(field.type):
            columns[field.name] = values.to_pylist()
        else:
            columns[field.name] = values.to_numpy(zero_copy_only=False)
    return pd.DataFrame(columns)


@dataclass(frozen=True)
class SentPredictor:
    """A predictor pickled on the driver with its driver-only modules by value (estimator.core.pickling.dumps), as a
    model is: an output kind defined in a notebook, or in a file only the driver has, reaches the executors. It is
    unpickled inside the UDF, once per worker, so that a failure there is a TransformFailed too."""

    blob: bytes


_PREDICTORS: "OrderedDict[bytes, Predictor]" = OrderedDict()


def loaded(predictor: Union[Predictor, SentPredictor]) -> Predictor:
    if not isinstance(predictor, SentPredictor):
        return predictor
    if predictor.blob not in _PREDICTORS:
        _PREDICTORS[predictor.blob] = pickle.loads(predictor.blob)
        while len(_PREDICTORS) > 8:
            _PREDICTORS.popitem(last=False)
    return _PREDICTORS[predictor.blob]


def make_predict(key: str, blob: Pickled, predictor: Union[Predictor, SentPredictor], keep: bool = False):
    """The function an Arrow UDF runs (pyspark >= 4.1): typed, since pyspark reads the type hints. `keep`
    (handle_invalid='keep'): a row holding a null gets a null struct instead of failing the job."""

    def predict(*columns: pa.Array) -> pa.Array:
        try:
            if keep:
                return kept_nulls(lambda cols: predict_arrow(key, blob, loaded(predictor), *cols), list(columns),
                                  loaded(predictor).arrow_type())
            return predict_arrow(key, blob, loaded(predictor), *columns)
        except Exception as exc:  # noqa: BLE001 - its cause first, without the frames below
            raise transform_failed(exc) from None

    return predict


def null_rows(columns: Sequence[pa.Array]) -> np.ndarray:
    """Which rows hold a null in any column, or an array holding a null (its elements, not deeper)."""
    bad = np.zeros(len(columns[0]) if columns else 0, dtype=bool)
    for column in columns:
        if column.null_count:
            bad |= column.is_null().to_numpy(zero_copy_only=False)
        if pa.types.is_list(column.type) or pa.types.is_large_list(column.type) or \
                pa.types.is_fixed_size_list(column.type):
            values = column.flatten()
            if values.null_count:
                parents = pc.list_parent_indices(column).to_numpy(zero_copy_only=False)
                bad[parents[values.is_null().to_numpy(zero_copy_only=False)]] = True
    return bad


def kept_nulls(predict: Callable[[List[pa.Array]], pa.StructArray], columns: List[pa.Array],
               struct: pa.StructType) -> pa.StructArray:
    """`predict` over the rows without a null (null_rows); the others get a null struct, in their places."""
    bad = null_rows(columns)
    if not bad.any():
        return predict(columns)
    if bad.all():
        return pa.nulls(len(bad), type=struct)
    good = pa.array(~bad)
    out = predict([column.filter(good) for column in columns])
    return out.take(pa.array(np.cumsum(~bad) - 1, mask=bad))


class TransformFailed(RuntimeError):
    """transform's UDF failed on an executor: the cause (the model's, a column's) in the first line of the Python
    traceback Spark reports, not under frames of this package or of torch."""


def transform_failed(exc: Exception) -> TransformFailed:
    where = traceback.extract_tb(exc.__traceback__)[-1]
    return TransformFailed(f"TorchModel.transform: {type(exc).__name__}: {exc} (at {where.name}, "
                           f"{where.filename.rsplit('/', 1)[-1]}:{where.lineno})")


def series_values(column: Any) -> np.ndarray:
    """A pandas UDF's column as the Arrow UDF's (estimator.data.arrays.column_to_numpy): numbers as they are, arrays
    stacked to (rows, n), a text or binary column one object per row (stacked, strings would become a numpy
    unicode array, which no tokenizer path reads), a chat its rows' lists of messages (of any lengths)."""
    if column.dtype != object:
        return column.to_numpy()
    first = next((v for v in column if v is not None), None)
    if isinstance(first, (str, bytes)) or (first is not None and len(first) and isinstance(first[0], dict)):
        out = np.empty(len(column), dtype=object)
        out[:] = [v if isinstance(v, (str, bytes)) else list(v) for v in column]
        return out
    return np.stack(column.to_numpy())


def make_predict_pandas(key: str, blob: Pickled, predictor: Union[Predictor, SentPredictor], keep: bool = False):
    """The same as a pandas UDF, for pyspark 3.5 (no Arrow UDFs): Series in, a DataFrame of outputs out (the
    struct make_predict returns, as pandas_frame gives it; `keep`: as make_predict's, null fields)."""
    import pandas as pd

    def predict(*columns: pd.Series) -> pd.DataFrame:
        try:
            if keep:
                struct = kept_nulls(lambda cols: predict_columns(key, blob, loaded(predictor), [
                    series_values(c.to_pandas()) for c in cols]), [pa.array(c) for c in columns],
                    loaded(predictor).arrow_type())
            else:
                for name, column in zip(loaded(predictor).input_cols(), columns):
                    nulls = int(column.isna().sum())
                    bad = int(null_rows([pa.array(column)]).sum()) if column.dtype == object else nulls
                    if bad:
                        raise ValueError(null_values(name, bad, len(column), nulls < bad))
                struct = predict_columns(key, blob, loaded(predictor), [series_values(c) for c in columns])
        except Exception as exc:  # noqa: BLE001 - as in make_predict
            raise transform_failed(exc) from None
        return pandas_frame(struct)

    return predict
