"""The seams, used as a developer adds to them: a strategy and an objective are each one class (here, in this test
module, which the executors cannot import) and one registry line, and a fit trains with them. The driver sends the
chosen classes to the ranks in the launch's payload, so nothing else names them."""
import logging

import numpy as np
import pytest
import torch
from torch import nn

from estimator import TorchEstimator
from estimator.train.objectives import registry
from estimator.train.objectives.base import BuiltIn
from estimator.train.strategies import STRATEGIES
from estimator.train.strategies.ddp import DDP
from estimator.train.sums import Sums
from helpers import MLP, seeded
from spark_helpers import digits_frame

pytestmark = pytest.mark.spark


def _est(store, **kw):
    model = seeded(MLP)
    params = dict(num_proc=2, store=store, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                  loss=nn.CrossEntropyLoss(), feature_cols=["features"], label_cols=["label"], batch_size=32,
                  epochs=2, validation=0.2, random_seed=5)
    params.update(kw)
    return TorchEstimator(**params)


class SmallBuckets(DDP):
    """DDP whose gradients travel in buckets of 1 MB (DistributedDataParallel's default is 25 MB)."""

    options = {"bucket_cap_mb": 1}

    def describe(self) -> str:
        return f"{super().describe()} in 1 MB buckets"


def test_a_strategy_added_as_one_class_and_a_registry_line_trains_what_ddp_trains(spark, store, digits, monkeypatch,
                                                                                  caplog):
    """The class reaches the Spark workers (they cannot import this module) and averages the gradients there, as
    the fit's log line says; the numbers are DDP's exactly (a bucket's size changes no sum)."""
    monkeypatch.setitem(STRATEGIES, "ddp-small-buckets", SmallBuckets)
    df = digits_frame(spark, digits)
    with caplog.at_level(logging.INFO, logger="estimator"):
        small = _est(store, strategy="ddp-small-buckets", run_id="small-buckets").fit(df)
    assert "gradients averaged by shared memory in 1 MB buckets" in caplog.text
    plain = _est(store, run_id="plain-ddp").fit(df)
    for a, b in zip(small.getModel().state_dict().values(), plain.getModel().state_dict().values()):
        assert torch.equal(a, b)
    monkeypatch.delitem(STRATEGIES, "ddp-small-buckets")
    with pytest.raises(ValueError, match=r"The 'strategy' parameter of TorchEstimator must be 'ddp', 'fsdp' or "
                                         r"'auto'\. Got 'ddp-small-buckets' instead\."):
        _est(store, strategy="ddp-small-buckets").fit(df)


class AbsoluteError:
    """The loss param's value that picks AbsoluteErrorObjective: the mean absolute error between the output's
    first column and the label (a loss in its own right, which the driver's dry run calls)."""

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (output[:, 0] - target.float()).abs().mean()


class AbsoluteErrorObjective(BuiltIn):
    """A regression of the label by the output's first column, in mean absolute error, reporting the share of rows
    within 1 of their label besides the loss: named sums of its own."""

    layout = Sums.of_loss(["within_1"])

    @classmethod
    def applies(cls, p):
        return isinstance(p["loss"], AbsoluteError)

    @classmethod
    def for_rank(cls, spec, objs, model, trainer):
        return cls()

    def on_batch(self, model, tensors, ctx=None):
        features, labels, _ = tensors
        error = (model(*features)[:, 0] - labels[0].float()).abs()
        rows = float(error.shape[0])
        sums = torch.stack([error.sum().double(), torch.tensor(rows, dtype=torch.float64),
                            torch.tensor(rows, dtype=torch.float64), (error < 1).sum().double()])
        return error.mean(), sums


def test_an_objective_added_as_one_class_and_a_registry_line_trains_with_its_own_named_sums(spark, store, digits,
                                                                                             monkeypatch):
    """The objective is chosen once on the driver (ahead of the built-in ones), trains on the ranks, and its
    sums reach the history by name, exact over the rows: the last epoch's validation numbers are those of the
    trained model over the validation rows."""
    monkeypatch.setattr(registry, "OBJECTIVES", dict(registry.OBJECTIVES))  # this test's own copy
    registry.add_objective("absolute", AbsoluteErrorObjective)  # the registry line: tried first
    assert list(registry.OBJECTIVES)[:2] == ["absolute", "train_step"]
    df = digits_frame(spark, digits)
    fitted = _est(store, loss=AbsoluteError(), epochs=3, run_id="absolute", validation="is_val",
                  optimizer=torch.optim.Adam(seeded(MLP).parameters(), lr=0.01), monitor="val_within_1",
                  monitor_mode="max").fit(df)  # a key of its own: the driver knows it before any job
    history = fitted.getHistory()
    assert set(history[-1]) >= {"loss", "within_1", "val_loss", "val_within_1"}
    assert history[-1]["loss"] < history[0]["loss"]
    X, y = digits
    val = np.arange(len(y)) % 10 == 0  # digits_frame's is_val
    with torch.no_grad():
        error = (fitted.getModel()(torch.from_numpy(X[val]))[:, 0] - torch.from_numpy(y[val]).float()).abs()
    assert history[-1]["val_loss"] == pytest.approx(float(error.mean()), rel=1e-5)
    assert history[-1]["val_within_1"] == pytest.approx(float((error < 1).double().mean()), rel=1e-9)
    assert 0 < np.mean([row["within_1"] for row in history]) < 1
    assert fitted.getBestEpoch() == 1 + int(np.argmax([row["val_within_1"] for row in history]))
