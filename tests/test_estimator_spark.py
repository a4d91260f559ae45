"""fit / transform on a real local[2] Spark session with real Parquet in a local store."""
import json

import numpy as np
import pytest
import torch
from pyspark.ml.evaluation import MulticlassClassificationEvaluator
from pyspark.sql import functions as F
from pyspark.sql.types import ArrayType, DoubleType, FloatType
from torch import nn

from estimator import TorchEstimator
from helpers import MLP, DigitsCNN, TwoInputs, TwoOutputs, seeded
from spark_helpers import digits_frame, jobs_run_by, outputs_of

pytestmark = [pytest.mark.spark, pytest.mark.connect]


@pytest.fixture(scope="module")
def frames(spark, digits):
    df = digits_frame(spark, digits)
    train, test = df.randomSplit([0.8, 0.2], seed=7)
    return df, train.cache(), test.cache()


def _estimator(store, model, **kw):
    params = dict(num_proc=2, store=store, model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
                  loss=nn.CrossEntropyLoss(), metrics=["accuracy"], feature_cols=["features"], label_cols=["label"],
                  batch_size=64, epochs=3, validation=0.1, random_seed=1)
    params.update(kw)
    return TorchEstimator(**params)


def test_fit_transform_evaluate(spark, store, frames):
    _, train, test = frames
    model = seeded(DigitsCNN)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    fitted = _estimator(store, model, optimizer=optimizer, input_shapes=[[-1, 1, 8, 8]], epochs=6).fit(train)

    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "fit trained the user's model"
    assert optimizer.state_dict()["state"] == {}, "fit stepped the user's optimizer"
    history = fitted.getHistory()
    assert [h["epoch"] for h in history] == [1, 2, 3, 4, 5, 6]
    assert {"loss", "accuracy", "val_loss", "val_accuracy"} <= set(history[0])
    assert store.exists(store.run(fitted.getRunId()).checkpoint)

    predictions = fitted.transform(test)
    assert predictions.schema["label__output"].dataType == ArrayType(FloatType(), False)
    assert predictions.schema["prediction"].dataType == DoubleType()
    assert predictions.columns[:6] == test.columns
    accuracy = MulticlassClassificationEvaluator(labelCol="label", predictionCol="prediction").setMetricName(
        "accuracy").evaluate(predictions)
    assert accuracy > 0.85
    first = predictions.select("label__output", "prediction").first()
    assert len(first[0]) == 10 and first[1] == float(np.argmax(first[0]))


def test_output_schema_needs_no_spark_job(spark, store, frames):
    _, train, test = frames
    fitted = _estimator(store, seeded(MLP), epochs=1).fit(train)
    schemas = []
    assert jobs_run_by(spark, lambda: schemas.append(fitted.transform(test).schema)) == []
    assert jobs_run_by(spark, lambda: fitted.transform(test).count())  # the probe sees jobs when there are
    assert [f.name for f in schemas[0].fields][-4:] == ["label__output", "prediction", "rawPrediction", "probability"]
    fitted.setOutputCols(["scores"]).setPredictionCol("digit").setProbabilityCol("")
    assert fitted.transform(test).columns[-3:] == ["scores", "digit", "rawPrediction"]


def test_two_feature_columns_map_to_forward_arguments(spark, store, frames):
    _, train, test = frames
    fitted = _estimator(store, seeded(TwoInputs), feature_cols=["features", "ink"], epochs=2).fit(train)
    assert fitted.getHistory()[-1]["val_accuracy"] > 0.6
    assert fitted.transform(test).select("prediction").count() == test.count()


def test_two_labels_two_outputs_two_losses(spark, store, frames):
    _, train, test = frames
    est = _estimator(store, seeded(TwoOutputs), label_cols=["label", "big"], loss=[nn.CrossEntropyLoss(), nn.MSELoss()],
                     loss_weights=[1.0, 0.5], metrics=[], epochs=6)
    fitted = est.fit(train)
    assert fitted.getHistory()[-1]["val_loss"] < fitted.getHistory()[0]["val_loss"]
    out = fitted.transform(test)
    assert out.schema["label__output"].dataType == ArrayType(FloatType(), False)
    assert out.schema["big__output"].dataType == DoubleType()  # one value per row: a plain double
    assert "prediction" not in out.columns  # no single classification output
    big = outputs_of(out, "big__output")
    truth = outputs_of(out, "big")
    assert np.mean((big > 0.5) == (truth > 0.5)) > 0.8


def test_dense_and_sparse_vector_columns(spark, store, digits):
    from pyspark.ml.linalg import Vectors

    X, y = digits
    rows = [(Vectors.dense(x.tolist()) if i % 2 else Vectors.sparse(64, {j: float(v) for j, v in enumerate(x) if v}),
             int(t)) for i, (x, t) in enumerate(zip(X[:600], y[:600]))]
    df = spark.createDataFrame(rows, ["vec", "label"])
    fitted = _estimator(store, seeded(MLP), feature_cols=["vec"], epochs=4, validation=0.0).fit(df)
    assert "val_loss" not in fitted.getHistory()[0]
    assert fitted.getHistory()[-1]["accuracy"] > 0.7
    assert fitted.transform(df).filter(F.col("prediction") == F.col("label")).count() > 400


def test_validation_by_column_uses_exactly_those_rows(spark, store, frames):
    df, _, _ = frames
    fitted = _estimator(store, seeded(MLP), validation="is_val", epochs=1).fit(df)
    markers = list(store.find(store.path("data"), suffix="_COMMITTED.json"))
    marker = json.loads(store.read_bytes(markers[0]))
    assert marker["val_rows"] == df.filter("is_val").count() and marker["train_rows"] == df.filter("not is_val").count()
    assert "val_loss" in fitted.getHistory()[0]


def test_sample_weights_give_the_exact_weighted_validation_loss(spark, store, frames, digits):
    """With lr=0 the model stays at its initial weights, so the reported val_loss must equal the
    weighted mean of per-row losses over the validation rows, computed here directly."""
    df, _, _ = frames
    model = seeded(MLP)
    est = _estimator(store, model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), sample_weight_col="weight",
                     validation="is_val", epochs=1, metrics=[])
    history = est.fit(df).getHistory()
    X, y = digits
    val = np.arange(len(y)) % 10 == 0
    with torch.no_grad():
        per_row = nn.CrossEntropyLoss(reduction="none")(model(torch.from_numpy(X[val])), torch.from_numpy(y[val]))
    weights = torch.from_numpy(1.0 + (y[val] % 2).astype(np.float32))
    expected = float((per_row * weights).sum() / weights.sum())
    assert history[0]["val_loss"] == pytest.approx(expected, rel=1e-5)


def test_second_fit_on_same_data_reuses_materialized_parquet(spark, store, frames):
    _, train, _ = frames
    _estimator(store, seeded(MLP), epochs=1).fit(train)
    markers = list(store.find(store.path("data"), suffix="_COMMITTED.json"))
    first_marker = store.read_bytes(markers[0])
    jobs = jobs_run_by(spark, lambda: _estimator(store, seeded(MLP), epochs=1).fit(train))
    assert len(list(store.find(store.path("data"), suffix="_COMMITTED.json"))) == 1
    assert store.read_bytes(markers[0]) == first_marker
    assert len(jobs) == 1  # only the training job: nothing was written again
    attempts = [p for p in store.ls(store.path("data", markers[0].split("/")[-2])) if "attempt-" in p]
    assert len(attempts) == 1
    _estimator(store, seeded(MLP), epochs=1, validation=0.2).fit(train)  # another split: new data
    assert len(list(store.find(store.path("data"), suffix="_COMMITTED.json"))) == 2


def test_model_defined_in_a_driver_only_module(spark, store, frames, tmp_path, monkeypatch):
    """Its forward calls a function of a second driver-only file (found through the code, also pickled by
    value: the executors cannot import either file)."""
    (tmp_path / "driver_helpers.py").write_text("def scaled(x):\n    return x * 1.0\n")
    (tmp_path / "only_on_driver.py").write_text(
        "import torch.nn as nn\n"
        "from driver_helpers import scaled\n"
        "class Tiny(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = nn.Linear(64, 10)\n"
        "    def forward(self, x):\n"
        "        return scaled(self.fc(x))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import only_on_driver

    _, train, test = frames
    fitted = _estimator(store, only_on_driver.Tiny(), epochs=2).fit(train)
    assert fitted.transform(test).filter("prediction = label").count() > 0.7 * test.count()
