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


class OwnLoss(MLP):
    """Computes its loss when given labels, as Hugging Face's *ForSequenceClassification models do."""

    def forward(self, x, labels=None):
        logits = super().forward(x)
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return SequenceClassifierOutput(loss=loss, logits=logits)


def test_loss_none_trains_on_the_models_own_loss_as_the_same_loss_given(store, digits):
    """forward(x, labels=y).loss with loss=None: the weights and history of loss=CrossEntropyLoss()."""
    from estimator.train.losses import ModelsOwnLoss

    histories = []
    for run, losses in (("given", [nn.CrossEntropyLoss()]), ("own", [ModelsOwnLoss()])):
        model = seeded(OwnLoss)
        spec = make_spec(store, digits, model, torch.optim.Adam(model.parameters(), lr=0.01), train_rows=600,
                         val_rows=100, run=run, losses=losses, epochs=2)
        histories.append(LocalLauncher().run(spec, 2)[0].history)
    given, own = histories
    assert len(own) == len(given) == 2
    for a, b in zip(own, given):
        assert metrics(a) == pytest.approx(metrics(b), rel=1e-6)
    assert set(own[-1]) >= {"loss", "accuracy", "val_loss", "val_accuracy"} and own[-1]["val_accuracy"] > 0.5


def test_loss_none_is_refused_by_name_unless_the_forward_takes_labels():
    from estimator.fit.checks import check_params
    from estimator.train.objectives.registry import choose_objective

    def check(p):
        check_params(p, choose_objective(p))

    base = dict(estimator_params())
    with pytest.raises(ValueError, match=r"needs 'loss'.*MLP.forward takes no 'labels'"):
        check({**base, "model": MLP()})
    with pytest.raises(ValueError, match=r"one label column and no sample weights.*sample_weight_col='w'"):
        check({**base, "model": OwnLoss(), "sample_weight_col": "w"})
    check({**base, "model": OwnLoss()})


def test_a_train_fn_that_cannot_take_the_context_is_refused_before_any_job():
    """A TorchDistributor function (its own arguments, or none) failed on every rank after the table was written
    (a wheel trial: 35 s, then retried as the user's error)."""
    from estimator.fit.checks import check_params
    from estimator.train.objectives.registry import choose_objective

    def train(learning_rate, use_gpu):
        pass

    base = dict(estimator_params())
    for fn, shown in [(train, r"train\(learning_rate, use_gpu\) cannot take it"), (lambda: None, r"\(\) cannot")]:
        p = {**base, "train_fn": fn}
        with pytest.raises(ValueError, match=r"'train_fn' parameter of TorchEstimator is called train_fn\(ctx\).*"
                                             + shown + r".*functools.partial"):
            check_params(p, choose_objective(p))
    for fn in (lambda ctx: None, lambda ctx, lr=0.1: None, lambda *args: None):
        p = {**base, "train_fn": fn}
        check_params(p, choose_objective(p))


def estimator_params():
    from estimator import TorchEstimator

    est = TorchEstimator(model=MLP(), optimizer=torch.optim.SGD(MLP().parameters(), lr=0.1),
                         feature_cols=["features"], label_cols=["label"])
    return est.validated()
