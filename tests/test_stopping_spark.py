"""Early stopping and the best epoch's checkpoint in real fits (local[2], 2 ranks)."""
import re

import numpy as np
import pytest
import torch
from torch import nn

from estimator import TorchEstimator
from helpers import MLP, seeded
from spark_helpers import digits_frame

pytestmark = [pytest.mark.spark, pytest.mark.connect]


def _estimator(store, sgd_lr=0.1, **kw):
    model = seeded(MLP)
    params = dict(num_proc=2, store=store, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=sgd_lr),
                  loss=nn.CrossEntropyLoss(), metrics=["accuracy"], feature_cols=["features"], label_cols=["label"],
                  batch_size=64, epochs=10, validation="is_val", random_seed=3)
    params.update(kw)
    return TorchEstimator(**params)


def test_a_run_that_plateaus_stops_early_on_every_rank_and_says_why(spark, store, digits, capsys):
    df = digits_frame(spark, digits)
    # lr 0: the loss never moves (sums in another order differ by far less than min_delta)
    fitted = _estimator(store, sgd_lr=0.0, early_stopping_patience=2, min_delta=1e-6).fit(df)
    history = fitted.getHistory()
    assert len(history) == 3  # epoch 1 sets the mark, epochs 2 and 3 do not improve on it
    err = capsys.readouterr().err
    assert re.search(r"run \S+ stopped early after epoch 3 of 10: val_loss did not improve by more than "
                     r"min_delta=1e-06 \(min\) for 2 epochs since epoch 1", err), err[-2000:]
    assert fitted.getBestEpoch() == 1
    # the ranks all stopped: the next fit in this session runs (and, learning, does not stop)
    again = _estimator(store, epochs=3, early_stopping_patience=2).fit(df)
    assert len(again.getHistory()) == 3 and again.getHistory()[-1]["val_loss"] < again.getHistory()[0]["val_loss"]


def test_restore_best_gives_the_best_epochs_weights_and_keeps_the_top_k(spark, store, digits):
    df = digits_frame(spark, digits)
    # the epoch with the highest val_loss is "best" here: a learning run puts it first, not last
    fitted = _estimator(store, epochs=4, monitor="val_loss", monitor_mode="max", restore_best=True,
                        save_top_k=2).fit(df)
    history = fitted.getHistory()
    val_losses = [row["val_loss"] for row in history]
    best = int(np.argmax(val_losses)) + 1
    assert len(history) == 4 and fitted.getBestEpoch() == best and best != 4
    val = fitted.transform(df.filter("is_val")).select("label", "label__output").collect()
    logits = torch.tensor([r["label__output"] for r in val], dtype=torch.float64)
    labels = torch.tensor([r["label"] for r in val])
    recomputed = nn.functional.cross_entropy(logits, labels).item()
    assert recomputed == pytest.approx(val_losses[best - 1], rel=1e-4)  # that epoch's weights, not the last
    assert recomputed != pytest.approx(val_losses[-1], rel=1e-3)
    kept = sorted(p.rsplit("/", 1)[-1] for p in store.ls(store.run(fitted.getRunId()).best_dir))
    top_two = sorted(f"epoch-{e}.pt" for e in np.argsort(val_losses)[::-1][:2] + 1)
    assert kept == top_two
    last = _estimator(store, epochs=4, monitor="val_loss", monitor_mode="max", run_id="last").fit(df)
    assert last.getBestEpoch() == best  # reported without restore_best; the weights stay the last epoch's
