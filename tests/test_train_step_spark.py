"""train_step=fn: your own step inside the estimator's loop. A two-term loss with its own metrics trains digits
on 2 ranks; a step that computes the built-in loss trains exactly the built-in loop's weights (the step path is
the same loop); what a step returns is checked on the driver before the ranks start."""
import pytest
import torch
import torch.nn.functional as F
from pyspark.ml.evaluation import MulticlassClassificationEvaluator
from torch import nn

from estimator import TorchEstimator
from helpers import MLP, metrics, seeded
from spark_helpers import digits_frame

pytestmark = pytest.mark.spark


def _est(store, **kw):
    model = seeded(MLP)
    params = dict(num_proc=2, store=store, model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
                  feature_cols=["features"], label_cols=["label"], batch_size=32, epochs=6, validation=0.2,
                  random_seed=5)
    params.update(kw)
    return TorchEstimator(**params)


def two_terms(model, batch, ctx):
    logits = model(*batch.features)
    ce = F.cross_entropy(logits, batch["label"])
    penalty = logits.pow(2).mean()
    accuracy = (logits.argmax(1) == batch.labels[0]).float().mean()
    return {"loss": ce + 0.001 * penalty, "ce": ce, "penalty": penalty, "accuracy": accuracy}


def test_a_train_step_with_a_two_term_loss_trains_digits_on_two_ranks(spark, store, digits):
    train, test = digits_frame(spark, digits).randomSplit([0.8, 0.2], seed=3)
    fitted = _est(store, train_step=two_terms, loss=nn.CrossEntropyLoss()).fit(train)
    last = fitted.getHistory()[-1]
    assert {"loss", "ce", "penalty", "accuracy", "val_loss", "val_ce", "val_penalty", "val_accuracy"} <= set(last)
    assert last["val_accuracy"] >= 0.90
    assert last["loss"] == pytest.approx(last["ce"] + 0.001 * last["penalty"], rel=1e-6)  # exact means over rows
    # loss, given with train_step, only says what the outputs are: transform adds a class prediction
    accuracy = MulticlassClassificationEvaluator(labelCol="label", metricName="accuracy").evaluate(
        fitted.transform(test))
    assert accuracy >= 0.90


def cross_entropy(model, batch, ctx):
    return F.cross_entropy(model(*batch.features), batch.labels[0])


@pytest.mark.connect
def test_a_step_computing_the_built_in_loss_trains_the_built_in_loops_weights(spark, store, digits):
    df = digits_frame(spark, digits)
    built_in = _est(store, loss=nn.CrossEntropyLoss(), epochs=2, run_id="built-in").fit(df)
    own = _est(store, train_step=cross_entropy, epochs=2, run_id="own-step").fit(df)
    for a, b in zip(own.getModel().state_dict().values(), built_in.getModel().state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), (a - b).abs().max()
    for x, y in zip(own.getHistory(), built_in.getHistory()):
        assert metrics(x) == pytest.approx(metrics(y), rel=1e-6)


def vector_loss(model, batch, ctx):
    return F.cross_entropy(model(*batch.features), batch.labels[0], reduction="none")


def other_keys_in_validation(model, batch, ctx):
    loss = F.cross_entropy(model(*batch.features), batch.labels[0])
    return {"loss": loss, "train_only": loss} if ctx.training else loss


def test_what_a_step_returns_is_checked_before_the_ranks_start(spark, store, digits):
    df = digits_frame(spark, digits)
    with pytest.raises(ValueError, match=r"train_step failed on the driver's dry run \(16 training rows, "
                                         r"training=True\): ValueError: train_step must return the loss as a scalar "
                                         r"tensor .* it returned a tensor of shape \(16,\) as the loss"):
        _est(store, train_step=vector_loss).fit(df)
    with pytest.raises(ValueError, match=r"train_step returned \['train_only'\] in training but \[\] in validation"):
        _est(store, train_step=other_keys_in_validation).fit(df)
    with pytest.raises(ValueError, match=r"with train_step takes no loss_constructors or metrics"):
        _est(store, train_step=cross_entropy, metrics=["accuracy"]).fit(df)
    with pytest.raises(ValueError, match=r"'monitor' parameter of TorchEstimator must be a key of the history this "
                                         r"fit writes: 'loss', 'ce', 'penalty', 'accuracy', 'val_loss'"):
        _est(store, train_step=two_terms, monitor="val_f1").fit(df)


def full_batches(model, batch, ctx):
    loss = F.cross_entropy(model(batch.features[0]), batch.labels[0])
    return {"loss": loss, "full": float(batch.rows == 32) if ctx.training else 1.0}


def test_drop_last_trains_on_full_batches_only(spark, store, digits):
    """train_step sees each batch's rows: with drop_last every training batch on both ranks holds batch_size rows
    (the share of full batches is exactly 1 in every epoch); without, the last one is smaller."""
    df = digits_frame(spark, digits)
    dropped = _est(store, train_step=full_batches, drop_last=True, epochs=2).fit(df).getHistory()
    assert [row["full"] for row in dropped] == [1.0, 1.0]
    kept = _est(store, train_step=full_batches, epochs=1).fit(df).getHistory()
    assert kept[0]["full"] < 1.0
