"""Spark ML's prediction columns of a classifier or regressor (prediction, rawPrediction, probability), derived on
the executors from a model's single output by what its loss says that output is. The values kind (values.py) adds
them beside the outputs; numpy only."""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import numpy as np

from estimator.predict.predictor import PREDICTION_FIELD

RAW_FIELD, PROBABILITY_FIELD = "_raw", "_probability"

# What transform derives from a model's single output, by what its loss says the output is (Spark ML's columns):
#   softmax      class scores of CrossEntropyLoss/NLLLoss: rawPrediction, probability (softmax), prediction (argmax)
#   scores       class scores of a loss of the user's own: rawPrediction, prediction (argmax)
#   logit        one logit (BCEWithLogitsLoss): rawPrediction [-s, s], probability [1-p, p], prediction (s >= 0)
#   probability  one probability (BCELoss): rawPrediction = probability = [1-p, p], prediction (p >= 0.5)
#   value        one value per row (regression): prediction
WITH_RAW = ("softmax", "scores", "logit", "probability")
WITH_PROBABILITY = ("softmax", "logit", "probability")


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
