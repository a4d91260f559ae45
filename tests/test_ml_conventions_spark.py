"""Spark ML's column conventions: rawPrediction/probability vectors for classifiers, a prediction column for
regression, so that Spark's evaluators work unchanged; and the built-in accuracy read as the loss reads the
output (exact over rows)."""
import numpy as np
import pytest
import torch
from pyspark.ml.evaluation import BinaryClassificationEvaluator, MulticlassClassificationEvaluator, RegressionEvaluator
from torch import nn

from estimator import TorchEstimator
from helpers import MLP, seeded

pytestmark = pytest.mark.spark


def _frame(spark, X, y, label_type="double"):
    rows = [(x.tolist(), float(t) if label_type == "double" else int(t)) for x, t in zip(X, y)]
    return spark.createDataFrame(rows, f"features array<float>, label {label_type}").repartition(2)


def _fit(store, model, loss, lr, **kw):
    params = dict(num_proc=2, store=store, model=model, loss=loss, feature_cols=["features"], label_cols=["label"],
                  optimizer=torch.optim.SGD(model.parameters(), lr=lr), batch_size=32, epochs=1, random_seed=1,
                  verbose=0)
    params.update(kw)
    return TorchEstimator(**params).fit


@pytest.fixture(scope="module")
def cancer():
    from sklearn.datasets import load_breast_cancer

    X, y = load_breast_cancer(return_X_y=True)
    return ((X - X.mean(0)) / X.std(0)).astype(np.float32), y


def test_binary_logits_get_accuracy_at_zero_and_spark_ml_classifier_columns(spark, store, cancer):
    from sklearn.metrics import roc_auc_score

    X, y = cancer
    X, y = X[:568], y[:568]  # even: 2 ranks of 284 rows (with 569, one rank would draw a row twice)
    df = _frame(spark, X, y)
    model = seeded(nn.Linear, 30, 1, seed=4)
    with torch.no_grad():
        model.bias.fill_(-0.4)  # logits around -0.4: thresholding them at 0.5 instead of 0 is clearly wrong
        logits = model(torch.from_numpy(X)).numpy().reshape(-1)
    fitted = _fit(store, model, nn.BCEWithLogitsLoss(), lr=0.0, metrics=["accuracy"])(df)  # lr 0: weights as given
    right, wrong = ((logits >= 0) == y).mean(), ((logits >= 0.5) == y).mean()
    assert abs(right - wrong) > 0.05
    assert fitted.getHistory()[0]["accuracy"] == pytest.approx(right, abs=1e-9)  # exact over all 568 rows

    out = fitted.transform(df).toPandas()
    assert list(out.columns[-4:]) == ["label__output", "prediction", "rawPrediction", "probability"]
    raw, prob = np.stack(out["rawPrediction"].map(lambda v: v.toArray())), np.stack(out["probability"].map(list))
    scores = out["label__output"].to_numpy()  # one value per row: a double column
    np.testing.assert_allclose(raw, np.stack([-scores, scores], 1), rtol=1e-6)
    np.testing.assert_allclose(prob[:, 1], 1 / (1 + np.exp(-scores)), rtol=1e-6)
    assert (out["prediction"] == (scores >= 0)).all()
    predictions = fitted.transform(df)
    auc = BinaryClassificationEvaluator(labelCol="label").evaluate(predictions)  # rawPrediction by default
    assert auc == pytest.approx(roc_auc_score(out["label"], scores), abs=1e-6)
    log_loss = MulticlassClassificationEvaluator(labelCol="label", metricName="logLoss").evaluate(predictions)
    assert 0 < log_loss < 5


@pytest.mark.connect
def test_class_scores_get_softmax_probabilities_and_evaluators_work(spark, store, digits):
    X, y = digits
    df = _frame(spark, X, y, "long")
    fitted = _fit(store, seeded(MLP), nn.CrossEntropyLoss(), lr=0.1, epochs=3, metrics=["accuracy"])(df)
    predictions = fitted.transform(df)
    out = predictions.select("label", "label__output", "probability", "prediction").toPandas()
    prob = np.stack(out["probability"].map(lambda v: v.toArray()))
    scores = np.stack(out["label__output"])
    np.testing.assert_allclose(prob, np.exp(scores) / np.exp(scores).sum(1, keepdims=True), rtol=1e-5)
    assert (prob.argmax(1) == out["prediction"]).all()
    labels = out["label"].to_numpy()
    accuracy = MulticlassClassificationEvaluator(labelCol="label", metricName="accuracy").evaluate(predictions)
    assert accuracy == pytest.approx((out["prediction"] == labels).mean()) and accuracy > 0.6
    log_loss = MulticlassClassificationEvaluator(labelCol="label", metricName="logLoss").evaluate(predictions)
    assert log_loss == pytest.approx(-np.log(prob[np.arange(len(labels)), labels]).mean(), rel=1e-4)


def test_a_regression_output_gets_a_prediction_column_for_the_default_regression_evaluator(spark, store):
    from sklearn.datasets import load_diabetes

    X, y = load_diabetes(return_X_y=True)
    df = _frame(spark, X.astype(np.float32), (y - y.mean()) / y.std())
    model = seeded(MLP, 10, 16, 1)
    fitted = _fit(store, model, nn.MSELoss(), lr=0.05, epochs=4)(df)
    predictions = fitted.transform(df)
    assert set(predictions.columns) >= {"label__output", "prediction"}
    assert "rawPrediction" not in predictions.columns and "probability" not in predictions.columns
    rmse = RegressionEvaluator().evaluate(predictions)  # labelCol="label", predictionCol="prediction"
    out = predictions.select("label", "label__output").toPandas()
    assert rmse == pytest.approx(np.sqrt(((out["label"] - out["label__output"]) ** 2).mean()), rel=1e-6)
    assert rmse < 1.0  # it learned something (the labels have standard deviation 1)
