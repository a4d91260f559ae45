"""Outputs as Hugging Face models return them: a ModelOutput (or a dict or a dataclass) with `logits` is read as
its logits by the loss, the metrics, validation, the driver's dry run and transform's forward passes."""
import dataclasses

import numpy as np
import pytest
import torch
from torch import nn
from transformers.modeling_outputs import SequenceClassifierOutput

from estimator.core.outputs import outputs_of
from estimator.fit.dry_run import check_outputs
from estimator.launch.local import LocalLauncher
from estimator.predict.inference import predict_numpy
from helpers import MLP, make_spec, metrics, seeded


@dataclasses.dataclass
class Scores:
    logits: torch.Tensor
    hidden: torch.Tensor = None


class HFStyle(MLP):
    """MLP whose forward returns a SequenceClassifierOutput, as AutoModelForSequenceClassification does."""

    def forward(self, x):
        return SequenceClassifierOutput(logits=super().forward(x))


def test_logits_are_read_from_model_outputs_dicts_and_dataclasses():
    t = torch.ones(2, 3)
    for raw in (SequenceClassifierOutput(logits=t), {"logits": t, "other": 1}, Scores(t, torch.zeros(1))):
        assert outputs_of(raw) == (t,) and check_outputs(raw, ["label"]) == (t,)
    assert outputs_of((t, t)) == (t, t) and outputs_of(t) == (t,)
    with pytest.raises(ValueError, match=r"returned a dict \(keys \['scores'\]\) without 'logits'.*out\['scores'\]"):
        check_outputs({"scores": t}, ["label"])


def test_a_model_returning_a_model_output_trains_and_predicts_as_its_tensor_model(store, digits):
    plain, wrapped = seeded(MLP), seeded(HFStyle)
    runs = []
    for run, model in (("plain", plain), ("wrapped", wrapped)):
        spec = make_spec(store, digits, model, torch.optim.Adam(model.parameters(), lr=0.01), train_rows=600,
                         val_rows=100, run=run, epochs=3)
        runs.append(LocalLauncher().run(spec, 1)[0].history)
    assert [metrics(r) for r in runs[0]] == [metrics(r) for r in runs[1]]
    assert runs[1][-1]["val_accuracy"] > 0.5
    X = digits[0][:10]
    (a,), (b,) = predict_numpy(plain, [X], 4, "cpu"), predict_numpy(wrapped, [X], 4, "cpu")
    np.testing.assert_array_equal(a, b)
