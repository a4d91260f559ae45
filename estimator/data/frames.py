"""The batch as numpy arrays <-> the pandas DataFrame a transformation_fn sees. numpy and pandas only: a
decoding process (reader_pool_type='process') imports this module and the user's function, not torch (whose
import took 3 s per spawned process on the benchmark machine).
"""
from __future__ import annotations

from typing import Any, Dict

import numpy as np

Arrays = Dict[str, np.ndarray]


def torch_dtype_array(values: np.ndarray) -> np.ndarray:
    """float64 -> float32 (models are float32), bools -> float32, ints -> int64; bytes stay as they are."""
    if values.dtype == np.float64 or values.dtype == np.bool_:
        return values.astype(np.float32)
    if np.issubdtype(values.dtype, np.integer) and values.dtype != np.int64:
        return values.astype(np.int64)
    return values


def transform_batch(fn: Any, batch: Arrays) -> Arrays:
    """Apply the user's transformation_fn to a batch as a pandas DataFrame (one row per sample;
    array columns hold one numpy array per row, as petastorm gives them; binary columns hold bytes)."""
    import pandas as pd

    frame = pd.DataFrame({k: list(v) if v.ndim > 1 else v for k, v in batch.items()})
    frame = fn(frame)
    out = {}
    for k in batch:
        column = frame[k].to_numpy()
        values = np.stack(column) if column.dtype == object else column
        out[k] = np.require(torch_dtype_array(values), requirements=["C", "W"])
    return out


def prepare_batch(fn: Any, tokenize: Any, batch: Arrays) -> Arrays:
    """transformation_fn (a pandas function), then the tokenization of string columns (estimator.data.text)."""
    if fn is not None:
        batch = transform_batch(fn, batch)
    return tokenize(batch) if tokenize is not None else batch


_LOADED: Any = (None, None)  # a decoding process's transformation_fn and tokenization


def load_transformation(payload: bytes) -> None:
    """A decoding process's initializer: the cloudpickled transformation_fn and tokenization, once. A forked process has the
    rank's torch already: one intra-op thread, as torch's DataLoader workers do (no oversubscription, and no
    OpenMP pool of the parent's to inherit)."""
    import pickle
    import sys

    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)
    global _LOADED
    _LOADED = pickle.loads(payload)


def run_loaded(batch: Arrays) -> Arrays:
    return prepare_batch(*_LOADED, batch)


def cloudpickle_module() -> Any:
    """The cloudpickle package where it is installed, else pyspark's own copy (in the pyspark.zip of every Python
    worker): a decoding process's function is pickled and loaded on one executor, by either."""
    try:
        import cloudpickle
    except ImportError:
        from pyspark import cloudpickle  # type: ignore[no-redef]
    return cloudpickle
