"""Batched prediction on executors: Arrow arrays in, an Arrow struct of outputs out. pyspark only to ask
the running task which GPU Spark assigned to it.

The model is unpickled once per Python worker (Spark reuses workers) and kept in a small cache
keyed by the model's content hash, so each Arrow batch costs only the conversion and the forward.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import cloudpickle
import numpy as np
import pyarrow as pa
import torch
from torch import nn

from estimator.data import column_to_numpy, reshape, torch_dtype_array
from estimator.distributed import assigned_gpu

_CACHE: "OrderedDict[Tuple[str, str], nn.Module]" = OrderedDict()
_CACHE_SIZE = 2
PREDICTION_FIELD = "_prediction"


@dataclass(frozen=True)
class InferenceLayout:
    feature_cols: Tuple[str, ...]
    input_shapes: Optional[Tuple[Tuple[int, ...], ...]]
    output_names: Tuple[str, ...]
    output_is_vector: Tuple[bool, ...]
    prediction_of: Optional[int]  # index of the output whose argmax is the prediction column
    batch_size: int
    use_gpu: Optional[bool]
    torch_threads: Optional[int] = None  # the cores of one Spark task (spark.task.cpus); None: torch's default


def cached_model(key: str, blob: bytes, device: str) -> nn.Module:
    if (key, device) not in _CACHE:
        model = cloudpickle.loads(blob).to(device).eval()
        _CACHE[(key, device)] = model
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
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


def predict_arrow(key: str, blob: bytes, layout: InferenceLayout, *columns: pa.Array) -> pa.StructArray:
    values = [column_to_numpy(pa.chunked_array([c]), name) for name, c in zip(layout.feature_cols, columns)]
    return to_struct(predict_columns(key, blob, layout, values), layout)


def predict_columns(key: str, blob: bytes, layout: InferenceLayout, columns: Sequence[np.ndarray]):
    """Model outputs, each (rows, width), for feature columns given as (rows,) or (rows, n) arrays."""
    device = device_for(layout.use_gpu, task_gpu() if layout.use_gpu is not False else None)
    if layout.torch_threads and torch.get_num_threads() != layout.torch_threads:
        torch.set_num_threads(layout.torch_threads)  # every task of an executor runs its own forward passes
    model = cached_model(key, blob, device)
    arrays = []
    for i, (name, values) in enumerate(zip(layout.feature_cols, columns)):
        shape = layout.input_shapes[i] if layout.input_shapes else None
        arrays.append(np.require(reshape(torch_dtype_array(values), shape, name), requirements=["C", "W"]))
    return predict_numpy(model, arrays, layout.batch_size, device)


def predict_numpy(model: nn.Module, arrays: Sequence[np.ndarray], batch_size: int, device: str):
    rows = arrays[0].shape[0] if arrays else 0
    chunks = []
    with torch.inference_mode():
        for start in range(0, rows, batch_size):
            batch = [torch.from_numpy(a[start:start + batch_size]).to(device) for a in arrays]
            out = model(*batch)
            out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
            chunks.append([o.detach().float().reshape(o.shape[0], -1).cpu().numpy() for o in out])
    if not chunks:
        return []
    return [np.concatenate([c[i] for c in chunks]) for i in range(len(chunks[0]))]


def arrow_type(layout: InferenceLayout) -> pa.StructType:
    fields = [pa.field(n, pa.list_(pa.float32()) if v else pa.float64())
              for n, v in zip(layout.output_names, layout.output_is_vector)]
    if layout.prediction_of is not None:
        fields.append(pa.field(PREDICTION_FIELD, pa.float64()))
    return pa.struct(fields)


def to_struct(outputs: Sequence[np.ndarray], layout: InferenceLayout) -> pa.StructArray:
    if not outputs:
        return pa.array([], type=arrow_type(layout))
    rows = outputs[0].shape[0]
    fields = []
    for values, is_vector in zip(outputs, layout.output_is_vector):
        if is_vector:
            width = values.shape[1]
            offsets = pa.array(np.arange(0, (rows + 1) * width, width, dtype=np.int32))
            fields.append(pa.ListArray.from_arrays(offsets, pa.array(values.reshape(-1), pa.float32())))
        else:
            fields.append(pa.array(values.reshape(-1).astype(np.float64)))
    if layout.prediction_of is not None:
        fields.append(pa.array(outputs[layout.prediction_of].argmax(axis=1).astype(np.float64)))
    return pa.StructArray.from_arrays(fields, fields=list(arrow_type(layout)))


def make_predict(key: str, blob: bytes, layout: InferenceLayout):
    """The function an Arrow UDF runs (pyspark >= 4.1): typed, since pyspark reads the type hints."""

    def predict(*columns: pa.Array) -> pa.Array:
        return predict_arrow(key, blob, layout, *columns)

    return predict


def make_predict_pandas(key: str, blob: bytes, layout: InferenceLayout):
    """The same as a pandas UDF, for pyspark 3.5 (no Arrow UDFs): Series in, a DataFrame of outputs out."""
    import pandas as pd

    def predict(*columns: pd.Series) -> pd.DataFrame:
        values = [np.stack(c.to_numpy()) if c.dtype == object else c.to_numpy() for c in columns]
        outputs = predict_columns(key, blob, layout, values)
        frame = pd.DataFrame({name: list(out) if vec else out.reshape(-1).astype(np.float64)
                              for name, vec, out in zip(layout.output_names, layout.output_is_vector, outputs)})
        if layout.prediction_of is not None:
            frame[PREDICTION_FIELD] = outputs[layout.prediction_of].argmax(axis=1).astype(np.float64)
        return frame

    return predict
