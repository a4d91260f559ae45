"""Batched prediction on executors: Arrow arrays in, an Arrow struct of outputs out. pyspark only to ask
the running task which GPU Spark assigned to it.

The model is unpickled once per Python worker (Spark reuses workers) and kept in a small cache
keyed by the model's content hash, so each Arrow batch costs only the conversion and the forward.
"""
from __future__ import annotations

import pickle
import traceback
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import pyarrow as pa
import torch
from torch import nn

from estimator.core.outputs import forward, outputs_of
from estimator.data.arrays import column_to_numpy, reshape
from estimator.data.frames import torch_dtype_array
from estimator.predict.generation import embeddings, generate_texts
from estimator.train.distributed import assigned_gpu

_CACHE: "OrderedDict[Tuple[str, str], nn.Module]" = OrderedDict()
_CACHE_SIZE = 2
PREDICTION_FIELD, RAW_FIELD, PROBABILITY_FIELD = "_prediction", "_raw", "_probability"

# What transform derives from a model's single output, by what its loss says the output is (Spark ML's columns):
#   softmax      class scores of CrossEntropyLoss/NLLLoss: rawPrediction, probability (softmax), prediction (argmax)
#   scores       class scores of a loss of the user's own: rawPrediction, prediction (argmax)
#   logit        one logit (BCEWithLogitsLoss): rawPrediction [-s, s], probability [1-p, p], prediction (s >= 0)
#   probability  one probability (BCELoss): rawPrediction = probability = [1-p, p], prediction (p >= 0.5)
#   value        one value per row (regression): prediction
WITH_RAW = ("softmax", "scores", "logit", "probability")
WITH_PROBABILITY = ("softmax", "logit", "probability")


@dataclass(frozen=True)
class InferenceLayout:
    feature_cols: Tuple[str, ...]
    input_shapes: Optional[Tuple[Tuple[int, ...], ...]]
    output_names: Tuple[str, ...]
    output_is_vector: Tuple[bool, ...]
    head: Optional[str]  # what the single output's prediction columns are (see WITH_RAW); None: no such columns
    batch_size: int
    use_gpu: Optional[bool]
    torch_threads: Optional[int] = None  # the cores of one Spark task (spark.task.cpus); None: torch's default
    feature_sizes: Optional[Tuple[int, ...]] = None  # values per row the model was trained on; None: not checked
    tokenize: Any = None  # estimator.data.text.Tokenize: string columns tokenized per batch of batch_size rows
    kind: Optional[str] = None  # output_kind: None (forward's outputs), 'generate' or 'embedding' (predict.generation)
    chat: bool = False  # 'generate': the feature column holds chats (rendered with the chat template)
    max_new_tokens: int = 64
    generate_kwargs: Optional[Dict[str, Any]] = None


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
        model = pickle.loads(blob).to(device).eval()
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


def predict_arrow(key: str, blob: Pickled, layout: InferenceLayout, *columns: pa.Array) -> pa.StructArray:
    values = [column_to_numpy(pa.chunked_array([c]), name) for name, c in zip(layout.feature_cols, columns)]
    return to_struct(predict_columns(key, blob, layout, values), layout)


def predict_columns(key: str, blob: Pickled, layout: InferenceLayout, columns: Sequence[np.ndarray]):
    """Model outputs, each (rows, width), for feature columns given as (rows,) or (rows, n) arrays."""
    device = device_for(layout.use_gpu, task_gpu() if layout.use_gpu is not False else None)
    if layout.torch_threads and torch.get_num_threads() != layout.torch_threads:
        torch.set_num_threads(layout.torch_threads)  # every task of an executor runs its own forward passes
    model = cached_model(key, blob, device)
    if layout.kind == "generate":
        return [generate_texts(model, layout.tokenize.tokenizer, columns[0], layout.chat, layout.feature_cols[0],
                               layout.batch_size, device, layout.max_new_tokens, layout.generate_kwargs)]
    arrays = []
    for i, (name, values) in enumerate(zip(layout.feature_cols, columns)):
        found = int(np.prod(values.shape[1:])) if values.ndim > 1 else 1
        if layout.feature_sizes and len(values) and found != layout.feature_sizes[i]:
            raise ValueError(f"Column {name!r} has {found} values per row, but the model was trained on "
                             f"{layout.feature_sizes[i]}: give transform the column as it was at fit.")
        shape = layout.input_shapes[i] if layout.input_shapes else None
        arrays.append(np.require(reshape(torch_dtype_array(values), shape, name), requirements=["C", "W"]))
    return predict_numpy(model, arrays, layout.batch_size, device, layout.tokenize, layout.kind == "embedding")


def predict_numpy(model: nn.Module, arrays: Sequence[np.ndarray], batch_size: int, device: str,
                  tokenize: Any = None, embed: bool = False):
    """Outputs batch by batch; a text column (strings, with `tokenize`) becomes forward's keyword inputs. `embed`:
    one vector per row from the hidden states (estimator.predict.generation.embeddings)."""
    rows = arrays[0].shape[0] if arrays else 0
    chunks = []

    def tensors(a: np.ndarray) -> Any:
        if a.dtype == object and tokenize is not None:
            return {k: torch.from_numpy(v).to(device) for k, v in tokenize.encode(a).items()}
        return torch.from_numpy(a).to(device)

    with torch.inference_mode():
        for start in range(0, rows, batch_size):
            batch = [tensors(a[start:start + batch_size]) for a in arrays]
            raw = forward(model, batch)
            masks = [b["attention_mask"] for b in batch if isinstance(b, dict) and "attention_mask" in b]
            out = (embeddings(raw, masks[0] if masks else None),) if embed else outputs_of(raw)
            chunks.append([o.detach().float().reshape(o.shape[0], -1).cpu().numpy() for o in out])
    if not chunks:
        return []
    return [np.concatenate([c[i] for c in chunks]) for i in range(len(chunks[0]))]


def head_of(kind: str, shape: Sequence[int]) -> Optional[str]:
    """The head of a single output with this per-row shape whose loss is of this kind (estimator.train.losses)."""
    if int(np.prod(shape)) <= 1:
        return {"logits": "logit", "probabilities": "probability", "regression": "value", "unknown": "value"}.get(kind)
    if len(shape) != 1:
        return None  # images, sequences: no single prediction
    return {"class_index": "softmax", "unknown": "scores"}.get(kind)  # several logits/values: multi-label


def head_fields(head: Optional[str]) -> List[str]:
    if head is None:
        return []
    return ([PREDICTION_FIELD] + ([RAW_FIELD] if head in WITH_RAW else [])
            + ([PROBABILITY_FIELD] if head in WITH_PROBABILITY else []))


def head_columns(head: Optional[str], output: np.ndarray) -> Dict[str, np.ndarray]:
    """The prediction columns of the single output, (rows, width), by its head: prediction (rows,), raw
    scores and probabilities (rows, classes), float64."""
    if head is None:
        return {}
    out = output.reshape(output.shape[0], -1).astype(np.float64)
    if head == "value":
        return {PREDICTION_FIELD: out[:, 0]}
    if head in ("logit", "probability"):
        s = out[:, 0]
        p = 1.0 / (1.0 + np.exp(-s)) if head == "logit" else s
        raw = np.stack([-s, s], axis=1) if head == "logit" else np.stack([1 - p, p], axis=1)
        return _unknown_where_not_finite({PREDICTION_FIELD: (p >= 0.5).astype(np.float64), RAW_FIELD: raw,
                                          PROBABILITY_FIELD: np.stack([1 - p, p], axis=1)}, out[:, :1])
    columns = {PREDICTION_FIELD: out.argmax(axis=1).astype(np.float64), RAW_FIELD: out}
    if head == "softmax":
        with np.errstate(invalid="ignore", over="ignore"):  # non-finite rows give NaN, and a NaN prediction
            shifted = np.exp(out - out.max(axis=1, keepdims=True))
            columns[PROBABILITY_FIELD] = shifted / shifted.sum(axis=1, keepdims=True)
    return _unknown_where_not_finite(columns, out)


def _unknown_where_not_finite(columns: Dict[str, np.ndarray], out: np.ndarray) -> Dict[str, np.ndarray]:
    """A row whose scores are NaN or infinite has no class: its prediction is NaN (argmax would say 0, and an
    evaluator would count it as a plausible answer)."""
    bad = ~np.isfinite(out).all(axis=1)
    if bad.any():
        columns[PREDICTION_FIELD] = np.where(bad, np.nan, columns[PREDICTION_FIELD])
    return columns


def arrow_type(layout: InferenceLayout) -> pa.StructType:
    if layout.kind == "generate":  # the generated text, in each output column and the prediction
        return pa.struct([pa.field(n, pa.string()) for n in (*layout.output_names, PREDICTION_FIELD)])
    fields = [pa.field(n, _rows_type(pa.float32()) if v else pa.float64())
              for n, v in zip(layout.output_names, layout.output_is_vector)]
    fields += [pa.field(n, pa.float64() if n == PREDICTION_FIELD else _rows_type(pa.float64()))
               for n in head_fields(layout.head)]
    return pa.struct(fields)


def _rows_type(dtype: pa.DataType) -> pa.ListType:
    return pa.list_(pa.field("element", dtype, nullable=False))  # Spark: array<float> without null elements


def to_struct(outputs: Sequence[np.ndarray], layout: InferenceLayout) -> pa.StructArray:
    if not outputs:
        return pa.array([], type=arrow_type(layout))
    if layout.kind == "generate":
        text = pa.array(list(outputs[0]), pa.string())
        return pa.StructArray.from_arrays([text] * (len(layout.output_names) + 1), fields=list(arrow_type(layout)))
    fields = []
    for values, is_vector in zip(outputs, layout.output_is_vector):
        fields.append(_arrow_rows(values, pa.float32()) if is_vector else pa.array(values.reshape(-1), pa.float64()))
    derived = head_columns(layout.head, outputs[0])
    for name in head_fields(layout.head):
        values = derived[name]
        fields.append(pa.array(values) if values.ndim == 1 else _arrow_rows(values, pa.float64()))
    return pa.StructArray.from_arrays(fields, fields=list(arrow_type(layout)))


def _arrow_rows(values: np.ndarray, dtype: pa.DataType) -> pa.ListArray:
    """(rows, width) -> a list column of `width` values per row, without Python objects."""
    rows, width = values.shape[0], int(np.prod(values.shape[1:]))
    offsets = pa.array(np.arange(0, (rows + 1) * width, width, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(values.reshape(-1), dtype), type=_rows_type(dtype))


def make_predict(key: str, blob: Pickled, layout: InferenceLayout):
    """The function an Arrow UDF runs (pyspark >= 4.1): typed, since pyspark reads the type hints."""

    def predict(*columns: pa.Array) -> pa.Array:
        try:
            return predict_arrow(key, blob, layout, *columns)
        except Exception as exc:  # noqa: BLE001 - its cause first, without the frames below
            raise transform_failed(exc) from None

    return predict


class TransformFailed(RuntimeError):
    """transform's UDF failed on an executor: the cause (the model's, a column's) in the first line of the Python
    traceback Spark reports, not under frames of this package or of torch."""


def transform_failed(exc: Exception) -> TransformFailed:
    where = traceback.extract_tb(exc.__traceback__)[-1]
    return TransformFailed(f"TorchModel.transform: {type(exc).__name__}: {exc} (at {where.name}, "
                           f"{where.filename.rsplit('/', 1)[-1]}:{where.lineno})")


def make_predict_pandas(key: str, blob: Pickled, layout: InferenceLayout):
    """The same as a pandas UDF, for pyspark 3.5 (no Arrow UDFs): Series in, a DataFrame of outputs out."""
    import pandas as pd

    def predict(*columns: pd.Series) -> pd.DataFrame:
        values = [np.stack(c.to_numpy()) if c.dtype == object else c.to_numpy() for c in columns]
        try:
            outputs = predict_columns(key, blob, layout, values)
        except Exception as exc:  # noqa: BLE001 - as in make_predict
            raise transform_failed(exc) from None
        if layout.kind == "generate":
            texts = list(outputs[0]) if outputs else []
            return pd.DataFrame({name: texts for name in (*layout.output_names, PREDICTION_FIELD)})
        frame = pd.DataFrame({name: list(out) if vec else out.reshape(-1).astype(np.float64)
                              for name, vec, out in zip(layout.output_names, layout.output_is_vector, outputs)})
        for name, values in head_columns(layout.head, outputs[0] if outputs else np.empty((0, 1))).items():
            frame[name] = list(values) if values.ndim > 1 else values
        return frame[list(layout.output_names) + head_fields(layout.head)]

    return predict
