"""Arrow columns -> numpy arrays -> torch tensors: the conversions every batch goes through, in one place.

Numeric columns become (rows,) or (rows, width) arrays; binary columns (image bytes) become object arrays
of `bytes`, which only a `transformation_fn` can turn into numbers.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence

import numpy as np
import pyarrow as pa
import torch

from estimator.core.spec import DataSpec
from estimator.data.frames import torch_dtype_array, transform_batch  # noqa: F401 - re-exported
from estimator.data.lm import REFERENCE
from estimator.data.repeats import REPEAT
from estimator.data.text import encoded_keys

Arrays = Dict[str, np.ndarray]


class Tensors(NamedTuple):
    """One batch's tensors, the one place their layout is written: `features` in the order of feature_cols (a
    tokenized text column is a dict of tensors, forward's keyword inputs), `labels` in the order of label_cols (a
    causal LM's: its token labels), `weights` (sample_weight_col, or None). A tuple: `features, labels, weights =
    batch` reads it."""

    features: List[Any]
    labels: List[torch.Tensor]
    weights: Optional[torch.Tensor]

    def each(self) -> Iterator[torch.Tensor]:
        """Every tensor of the batch, those of a text column's dict included."""
        for item in [*self.features, *self.labels, self.weights]:
            if isinstance(item, dict):
                yield from item.values()
            elif item is not None:
                yield item

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "Tensors":
        """The same batch with `fn` applied to each tensor (a text column's dict keeps its keys)."""
        def one(item: Any) -> Any:
            return {k: fn(v) for k, v in item.items()} if isinstance(item, dict) else fn(item)

        return type(self)([one(f) for f in self.features], [fn(t) for t in self.labels],
                          fn(self.weights) if self.weights is not None else None)


class Void(Tensors):
    """A batch that stands for no rows: one row a rank drew again (estimator.data.repeats), forwarded so that its
    peers' collectives meet it, and counted as none (its loss scaled by 0, its sums 0)."""

    __slots__ = ()


def table_to_arrays(table: Optional[pa.Table], columns: Sequence[str]) -> Arrays:
    if table is None:
        return {c: np.empty((0,)) for c in columns}
    return {c: column_to_numpy(table.column(c), c) for c in columns}


def column_to_numpy(column: pa.ChunkedArray, name: str) -> np.ndarray:
    """A numeric column as (rows,) or (rows, width): lists must all have the same length."""
    if column.null_count:
        raise ValueError(f"Column {name!r} has {column.null_count} null values; drop or fill them first.")
    arr = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    if pa.types.is_fixed_size_list(arr.type):
        return arr.flatten().to_numpy(zero_copy_only=False).reshape(len(arr), arr.type.list_size)
    if (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)) and pa.types.is_struct(arr.type.value_type):
        out = np.empty(len(arr), dtype=object)  # a chat column: each row a list of {role, content} dicts
        out[:] = arr.to_pylist()
        return out
    if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
        offsets = arr.offsets.to_numpy()
        lengths = np.diff(offsets)
        if len(lengths) and not (lengths == lengths[0]).all():
            raise ValueError(f"Column {name!r} holds arrays of different lengths "
                             f"(from {lengths.min()} to {lengths.max()}); every row must have the same length.")
        values = arr.values
        if values.null_count:
            raise ValueError(f"Column {name!r} has {values.null_count} null elements inside its arrays.")
        width = int(lengths[0]) if len(lengths) else 0
        if is_list(values.type):  # arrays of arrays (array<array<float>>, an image's rows): (rows, width, ...)
            inner = column_to_numpy(pa.chunked_array([values.slice(offsets[0], len(arr) * width)], values.type), name)
            return inner.reshape(len(arr), width, *inner.shape[1:])
        flat = values.to_numpy(zero_copy_only=False)[offsets[0]:offsets[0] + len(arr) * width]
        return flat.reshape(len(arr), width)
    if is_binary(arr.type):
        out = np.empty(len(arr), dtype=object)  # one bytes object per row
        out[:] = arr.to_pylist()
        return out
    return arr.to_numpy(zero_copy_only=False)


def is_list(dtype: pa.DataType) -> bool:
    return pa.types.is_list(dtype) or pa.types.is_large_list(dtype) or pa.types.is_fixed_size_list(dtype)


def is_binary(dtype: pa.DataType) -> bool:
    return pa.types.is_binary(dtype) or pa.types.is_large_binary(dtype) or pa.types.is_fixed_size_binary(dtype)


def reshape(values: np.ndarray, shape: Optional[Sequence[int]], name: str) -> np.ndarray:
    """Reshape a (rows, ...) block to `shape`: with a -1, that is the batch ([-1, 1, 28, 28]); without one, a
    shape holding a row's values is per row, as in Horovod ([1, 28, 28] or [2] -> (rows, 1, 28, 28), (rows, 2));
    otherwise its first dimension stands for the batch ([64, 784] -> (rows, 784))."""
    if shape is None:
        return values
    rows = values.shape[0]
    per_row = int(np.prod(values.shape[1:])) if values.ndim > 1 else 1
    target = [d for d in shape]
    if -1 in target:
        target[target.index(-1)] = rows
        wanted = int(np.prod([d for d in shape if d != -1]))
    elif int(np.prod(shape)) == per_row:
        target, wanted = [rows] + target, per_row
    else:
        wanted = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        target[0] = rows
    if wanted != per_row:
        raise ValueError(f"Column {name!r} has {per_row} values per row, but its shape {list(shape)} "
                         f"needs {wanted}; fix input_shapes/label_shapes or the column.")
    return values.reshape(target)


def prepare_arrays(data: DataSpec, arrays: Arrays) -> Arrays:
    """torch-friendly dtypes, writable and contiguous (Arrow hands out read-only buffers)."""
    out = {c: torch_dtype_array(arrays[c]) for c in data.feature_cols + data.label_cols}
    if data.sample_weight_col:
        out[data.sample_weight_col] = arrays[data.sample_weight_col].astype(np.float32)
    if REPEAT in arrays:
        out[REPEAT] = arrays[REPEAT]
    return {k: np.require(v, requirements=["C", "W"]) for k, v in out.items()}


def to_tensors(batch: Arrays, data: DataSpec, device: torch.device = torch.device("cpu"), pin: bool = False
               ) -> Tensors:
    """The batch's features, labels and weights as tensors on `device` (pinned host memory with `pin`,
    so that a later non_blocking copy to the GPU overlaps the computation)."""
    def encoded(column: str) -> Dict[str, torch.Tensor]:  # a tokenized text column: forward's keyword inputs
        keys = {k: v for k, v in encoded_keys(batch, column).items() if lm is None or v != lm.labels_key}
        if not keys:
            raise TypeError(f"Column {column!r} holds strings and no tokenizer tokenized it: set tokenizer.")
        return {key: t(name, None) for key, name in keys.items()}

    def t(name: str, shape: Optional[Sequence[int]]) -> torch.Tensor:
        values = reshape(batch[name], shape, name)
        if values.dtype == object:
            raise TypeError(f"Column {name!r} holds bytes (a binary column): set transformation_fn to turn them into "
                            "arrays, e.g. decode images with PIL into numpy arrays.")
        tensor = torch.from_numpy(np.ascontiguousarray(values))
        return tensor.pin_memory() if pin else tensor.to(device, non_blocking=True)

    lm = data.lm  # a causal LM's rows: the labels are the token labels (estimator.data.lm)
    features = [encoded(c) if c in data.text_cols or (lm is not None and c == lm.column)
                else t(c, data.input_shapes[i] if data.input_shapes else None) for i, c in enumerate(data.feature_cols)]
    labels = ([t(lm.labels_key, None)] + ([t(REFERENCE, None)] if REFERENCE in batch else []) if lm is not None else
              [t(c, data.label_shapes[i] if data.label_shapes else None) for i, c in enumerate(data.label_cols)])
    weights = t(data.sample_weight_col, None) if data.sample_weight_col else None
    return Tensors(features, labels, weights)


def tensors_to(tensors: Tensors, device: torch.device) -> Tensors:
    """Host tensors onto the device; from pinned memory the copies are asynchronous."""
    if device.type == "cpu":
        return tensors
    return tensors.map(lambda t: t.to(device, non_blocking=True))
