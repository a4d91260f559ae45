"""output_kind None: the numbers a model's forward returns, one column per output (a double, or an array<float>
for an output wider than one value), and for a classifier or regressor Spark ML's prediction columns beside them
(prediction, rawPrediction, probability: heads.py)."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa
import torch
from torch import nn

from estimator.core.adapters import base_config
from estimator.core.handle import on_meta
from estimator.core.outputs import forward, outputs_of
from estimator.data.arrays import reshape
from estimator.data.text import Tokenize
from estimator.predict.inference import model_inputs, predict_numpy
from estimator.predict.kinds.heads import PROBABILITY_FIELD, RAW_FIELD, head_columns, head_fields, head_of
from estimator.predict.language_checks import effective_max_length
from estimator.predict.predictor import (PREDICTION_FIELD, Added, Predictor, arrow_rows, output_fields,
                                         rows_type)
from estimator.core.lightning_module import for_inference


@dataclass(frozen=True, kw_only=True)
class Values(Predictor):
    outputs: Tuple[str, ...] = ("_0",)  # the struct's field of each output
    output_is_vector: Tuple[bool, ...] = (True,)  # an array per row (else one double)
    head: Optional[str] = None  # what the single output's prediction columns are (heads.py); None: no such columns
    input_shapes: Optional[Tuple[Tuple[int, ...], ...]] = None
    feature_sizes: Optional[Tuple[int, ...]] = None  # values per row the model was trained on; None: not checked

    @classmethod
    def check(cls, p: Dict[str, Any], outputs: List[str]) -> None:
        for_inference(p["model"])  # a LightningModule with neither forward() nor predict_step() is refused here
        if p["label_cols"] and len(outputs) != len(p["label_cols"]):
            raise ValueError(f"The 'output_cols' parameter of TorchModel must list {len(p['label_cols'])} names, "
                             f"one per label column {p['label_cols']}. Got {outputs} instead.")

    @classmethod
    def build(cls, p: Dict[str, Any], outputs: List[str], torch_threads: Optional[int] = None) -> "Values":
        cls.check(p, outputs)
        shapes = p["output_shapes"] if p["output_shapes"] is not None else probe_output_shapes(p)
        if len(shapes) != len(outputs):
            raise ValueError(f"The model returns {len(shapes)} outputs but TorchModel has {len(outputs)} label columns "
                             f"{p['label_cols']}; pass one label column per output.")
        told = config_kind(p["model"]) if not p["loss_kinds"] and len(outputs) == 1 else None
        kinds = p["loss_kinds"] or [told or "unknown"] * len(outputs)
        head = head_of(kinds[0], shapes[0]) if len(outputs) == 1 and (p["label_cols"] or told) else None
        fields = output_fields(len(outputs))
        names = {PREDICTION_FIELD: p["prediction_col"], RAW_FIELD: p["raw_prediction_col"],
                 PROBABILITY_FIELD: p["probability_col"]}
        added = [Added(name, field) for name, field in zip(outputs, fields)]
        added += [Added(names[field], field, vector=field != PREDICTION_FIELD)  # Spark ML's vectors
                  for field in head_fields(head) if names[field]]
        tokenize = Tokenize(p["tokenizer"], (), effective_max_length(p)) if p["tokenizer"] is not None else None
        return cls(
            **cls.shared(p, added, torch_threads, tokenize), outputs=fields,
            output_is_vector=tuple(int(np.prod(s)) > 1 for s in shapes), head=head,
            input_shapes=None if p["input_shapes"] is None else tuple(tuple(s) for s in p["input_shapes"]),
            feature_sizes=None if p["feature_sizes"] is None else tuple(p["feature_sizes"]))

    def arrow_type(self) -> pa.StructType:
        fields = [pa.field(n, rows_type(pa.float32()) if v else pa.float64())
                  for n, v in zip(self.outputs, self.output_is_vector)]
        fields += [pa.field(n, pa.float64() if n == PREDICTION_FIELD else rows_type(pa.float64()))
                   for n in head_fields(self.head)]
        return pa.struct(fields)

    def predict(self, model: Any, columns: Sequence[np.ndarray], device: str) -> List[pa.Array]:
        arrays = model_inputs(columns, self.feature_cols, self.input_shapes, self.feature_sizes)
        outputs = predict_numpy(model, arrays, self.batch_size, device, self.tokenize)
        if not outputs:
            return []
        fields = [arrow_rows(values, pa.float32()) if is_vector else pa.array(values.reshape(-1), pa.float64())
                  for values, is_vector in zip(outputs, self.output_is_vector)]
        derived = head_columns(self.head, outputs[0])
        for name in head_fields(self.head):
            values = derived[name]
            fields.append(pa.array(values) if values.ndim == 1 else arrow_rows(values, pa.float64()))
        return fields


# What a transformers config's problem_type says the output is, as a loss kind (estimator.train.losses)
PROBLEM_KINDS = {"single_label_classification": "class_index", "multi_label_classification": "logits",
                 "regression": "regression"}


def config_kind(model: Any) -> Optional[str]:
    """What a transformers classifier built without a fit says its output is (the loss kind a fit would have
    recorded): its config's problem_type, else, for a ...ForSequenceClassification of several labels, class
    scores (transformers' own rule); None for any other model."""
    config = base_config(model)
    if config is None or not type(getattr(model, "get_base_model", lambda: model)()).__name__.endswith(
            "ForSequenceClassification"):
        return None
    if getattr(config, "problem_type", None) in PROBLEM_KINDS:
        return PROBLEM_KINDS[config.problem_type]
    labels = getattr(config, "num_labels", 0)
    return "class_index" if labels > 1 else "regression" if labels == 1 else None


def probe_output_shapes(p: Dict[str, Any]) -> List[List[int]]:
    """Per-row output shapes by one forward pass on the driver (no Spark job), for a TorchModel built
    without output_shapes: the feature shapes come from input_shapes, else from a first Linear layer; a text
    model's (a tokenizer given), from two short texts tokenized as transform tokenizes them."""
    if on_meta(p["model"]) and config_kind(p["model"]) is not None:  # a classifier held as a handle: its config
        return [[int(base_config(p["model"]).num_labels)]]
    if p["tokenizer"] is not None and p["input_shapes"] is None and len(p["feature_cols"]) == 1:
        model = probed(p)
        texts = np.array(["a probe", "of the output's shape"], dtype=object)
        try:
            encoded = Tokenize(p["tokenizer"], (), effective_max_length(p)).encode(texts)
            with torch.no_grad():
                outputs = outputs_of(forward(model, [{k: torch.from_numpy(v) for k, v in encoded.items()}]))
        except Exception as exc:  # noqa: BLE001 - the user's model and tokenizer
            raise ValueError(f"TorchModel ran the model on two texts tokenized by its tokenizer to find its output "
                             f"columns (no Spark job), and it failed: {type(exc).__name__}: {exc}. Pass output_shapes "
                             "(e.g. [[2]]) or check the tokenizer is the model's.") from None
        return [list(o.shape[1:]) for o in outputs]
    rows, inputs = 2, []
    for i, column in enumerate(p["feature_cols"]):
        shape = p["input_shapes"][i] if p["input_shapes"] else None
        if shape is None:
            first = next((m for m in p["model"].modules() if isinstance(m, nn.Linear)), None)
            if first is None or len(p["feature_cols"]) > 1:
                raise ValueError(f"TorchModel cannot tell the shape of {column!r} to find the model's output "
                                 "columns without a Spark job: pass input_shapes (e.g. [[-1, 64]]) or "
                                 "output_shapes (e.g. [[10]]).")
            shape = [-1, first.in_features]
        inputs.append(reshape(np.zeros((rows, int(np.prod([d for d in shape if d != -1]))), np.float32),
                              shape, column))
    model = probed(p)
    with torch.no_grad():
        outputs = outputs_of(model(*[torch.from_numpy(np.ascontiguousarray(a)) for a in inputs]))
    return [list(o.shape[1:]) for o in outputs]


def probed(p: Dict[str, Any]) -> nn.Module:
    """The module the probe runs: a copy of the model, or, held as a handle (estimator.core.handle), the module it
    builds, dropped after the probe (a classifier's shape comes from its config instead; output_shapes skips it)."""
    handle = p.get("model_handle")
    if handle is not None and on_meta(p["model"]):
        return handle.build()
    return copy.deepcopy(p["model"]).cpu().eval()

