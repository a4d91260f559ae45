"""Best epoch, kept checkpoints and early stopping, decided from the history alone (no Spark)."""
import math

import pytest
import torch
from torch import nn

from estimator import TorchEstimator
from estimator.core.stopping import Monitor, default_mode
from estimator.fit.checks import metric_names, monitor_for


def rows(key, values):
    return [{key: v} for v in values]


def test_the_best_epoch_follows_the_mode_and_ties_keep_the_earlier_epoch():
    history = rows("val_loss", [0.9, 0.5, 0.7, 0.5])
    assert Monitor("val_loss", "min").best_epoch(history) == 2
    assert Monitor("val_loss", "max").best_epoch(history) == 1
    assert Monitor("val_loss", "min").top_k(history, 3) == [2, 4, 3]
    assert Monitor("val_loss").best_epoch(rows("val_loss", [math.nan, 0.8])) == 2  # NaN is never best
    assert Monitor("val_loss").best_epoch([]) is None and Monitor("val_loss").top_k(history, 0) == []
    assert default_mode("val_accuracy") == "max" and default_mode("val_loss") == "min"


def test_early_stopping_counts_epochs_without_an_improvement_larger_than_min_delta():
    monitor = Monitor("loss", "min", patience=2)
    assert monitor.stop_reason(rows("loss", [1.0, 0.9, 0.95])) is None  # one epoch without improvement
    reason = monitor.stop_reason(rows("loss", [1.0, 0.9, 0.95, 0.91]))
    assert reason.startswith("loss did not improve by more than min_delta=0 (min) for 2 epochs since epoch 2 (0.9)")
    strict = Monitor("loss", "min", min_delta=0.05, patience=2)
    assert strict.stop_reason(rows("loss", [1.0, 0.97, 0.96])) is not None  # steps of 0.03 and 0.01 are too small
    assert strict.stop_reason(rows("loss", [1.0, 0.97, 0.94])) is None  # 0.94 < 1.0 - 0.05
    rising = Monitor("accuracy", "max", patience=1)
    assert rising.stop_reason(rows("accuracy", [0.5, 0.6, 0.7])) is None
    assert rising.stop_reason(rows("accuracy", [0.5, 0.6, 0.6])) is not None
    assert Monitor("loss").stop_reason(rows("loss", [1.0] * 10)) is None  # no patience: never stops
    assert Monitor("loss", patience=1).stop_reason(rows("loss", [1.0, math.nan])) is not None  # NaN is no better


def _params(**kw):
    model = nn.Linear(4, 3)
    est = TorchEstimator(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss=nn.CrossEntropyLoss(),
                         metrics=["accuracy"], feature_cols=["x"], label_cols=["y"], **kw)
    return est.validated()


def test_the_monitor_must_be_a_key_the_history_will_have():
    losses = metric_names(_params(), [nn.CrossEntropyLoss()])  # the history's names: loss, accuracy
    assert losses == ["loss", "accuracy"]
    assert monitor_for(_params(), losses, has_validation=True) == Monitor("val_loss", "min")
    assert monitor_for(_params(), losses, has_validation=False) == Monitor("loss", "min")
    assert monitor_for(_params(monitor="val_accuracy", early_stopping_patience=3, min_delta=0.01), losses,
                       True) == Monitor("val_accuracy", "max", 0.01, 3)
    with pytest.raises(ValueError, match=r"The 'monitor' parameter of TorchEstimator must be a key of the history "
                                         r"this fit writes: 'loss', 'accuracy', 'data_wait' \(val_ keys need "
                                         r"validation data\). Got 'val_loss' instead"):
        monitor_for(_params(monitor="val_loss"), losses, has_validation=False)
    with pytest.raises(ValueError, match="save_top_k=0, so restore_best=True has nothing to restore"):
        monitor_for(_params(restore_best=True, save_top_k=0), losses, True)
