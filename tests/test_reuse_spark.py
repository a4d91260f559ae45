"""Materialized data is found again by its rows: Spark ML pipeline output transformed again, CrossValidator's
repeated folds, a new process; never for DataFrames whose rows differ. And the store keeps within its budget."""
import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from pyspark.ml import Pipeline
from pyspark.ml.evaluation import MulticlassClassificationEvaluator
from pyspark.ml.feature import StandardScaler, VectorAssembler
from pyspark.ml.functions import vector_to_array
from pyspark.ml.tuning import CrossValidator, ParamGridBuilder
from pyspark.sql import functions as F
from torch import nn

from estimator import TorchEstimator
from estimator.fit.materialize import finish, materialize
from helpers import MLP, seeded
from store import Store

pytestmark = [pytest.mark.spark]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PIXELS = [f"p{i}" for i in range(64)]


@pytest.fixture(scope="module")
def pixels_path(tmp_path_factory, digits):
    """The digits as 64 scalar columns in a Parquet file: what VectorAssembler is for."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    X, y = digits
    path = str(tmp_path_factory.mktemp("pixels") / "digits.parquet")
    pq.write_table(pa.table({**{c: X[:, i].astype(np.float64) for i, c in enumerate(PIXELS)},
                             "label": y.astype(np.int64)}), path, row_group_size=400)
    return path


@pytest.fixture
def pixels(spark, pixels_path):
    return spark.read.parquet(pixels_path)


def _prep():
    return Pipeline(stages=[VectorAssembler(inputCols=PIXELS, outputCol="raw"),
                            StandardScaler(inputCol="raw", outputCol="features", withMean=True)])


def _est(store, **kw):
    model = seeded(MLP, kw.pop("inputs", 64))
    params = dict(num_proc=2, store=store, model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
                  loss=nn.CrossEntropyLoss(), metrics=["accuracy"], feature_cols=["features"], label_cols=["label"],
                  batch_size=64, epochs=1, validation=0.1, random_seed=1, verbose=0)
    params.update(kw)
    return TorchEstimator(**params)


def _learned(model):
    return [{k: v for k, v in row.items() if k != "data_wait"} for row in model.getHistory()]  # not timings


def copies_in(store):
    """(shape folder, fingerprint, marker) of every committed copy, and the attempt folders lying there."""
    markers = sorted(store.find(store.path("data"), suffix="_COMMITTED.json"))
    attempts = [p for root in store.ls(store.path("data")) for p in store.ls(root) if "/attempt-" in p] \
        if store.exists(store.path("data")) else []
    return [json.loads(store.read_bytes(m)) for m in markers], attempts


@pytest.mark.connect
def test_pipeline_output_transformed_and_fitted_twice_is_written_once(spark, store, pixels, caplog):
    prep = _prep().fit(pixels)
    first = _est(store).fit(prep.transform(pixels))
    markers, attempts = copies_in(store)
    assert len(markers) == 1 and len(attempts) == 1
    with caplog.at_level(logging.INFO, logger="estimator"):
        second = _est(store).fit(prep.transform(pixels))  # a new transform: new UDF objects, the same rows
    assert "(the same rows)" in caplog.text
    assert copies_in(store) == (markers, attempts)  # nothing written, the marker untouched
    assert _learned(second) == _learned(first)  # the same rows, the same split: the same run
    assert markers[0]["train_rows"] + markers[0]["val_rows"] == pixels.count()


def test_other_rows_from_the_same_pipeline_are_not_taken_for_the_same_data(spark, store, pixels):
    """Two StandardScaler models fitted on different rows print the same plan (`UDF(raw)`) but scale differently."""
    scaled_by_all = _prep().fit(pixels).transform(pixels)
    scaled_by_some = _prep().fit(pixels.filter("label < 5")).transform(pixels)
    _est(store).fit(scaled_by_all)
    _est(store).fit(scaled_by_some)
    markers, attempts = copies_in(store)
    assert len(markers) == 2 and len(attempts) == 2


def test_cross_validator_writes_one_copy_per_fold(spark, store, pixels):
    est = _est(store, num_proc=1)
    grid = ParamGridBuilder().addGrid(est.epochs, [1, 2]).build()
    cv = CrossValidator(estimator=Pipeline(stages=[*_prep().getStages(), est]), estimatorParamMaps=grid,
                        evaluator=MulticlassClassificationEvaluator(metricName="accuracy"), numFolds=2, seed=3)
    cv.fit(pixels)
    markers, attempts = copies_in(store)
    # 2 folds (each fitted with both param maps, its scaler refitted each time) + the final fit on all rows
    assert len(markers) == 3 and len(attempts) == 3
    assert sorted(m["train_rows"] + m["val_rows"] for m in markers)[-1] == pixels.count()


def test_a_new_process_fitting_the_same_deterministic_data_adds_no_copy(spark, tmp_path, pixels_path, pixels):
    # (the store is not named "store": in the job's folder that name would shadow the editable install's package)
    store = Store.create(str(tmp_path / "runs"))
    _est(store).fit(_prep().fit(pixels).transform(pixels))
    before = copies_in(store)
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "seeds", "reuse_job.py"), pixels_path,
                             str(tmp_path / "runs")], capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr[-4000:]
    assert "Reusing materialized data" in result.stderr and "(the same rows)" in result.stderr, result.stderr[-4000:]
    assert copies_in(store) == before


def test_unseeded_random_data_is_never_reused(spark, store, pixels, caplog):
    base = _prep().fit(pixels).transform(pixels).withColumn("features", vector_to_array("features"))

    def noisy():  # an unseeded rand: each DataFrame built draws its own seed
        return base.withColumn("features", F.concat(F.col("features"), F.array(F.rand().cast("double"))))

    first, second = noisy(), noisy()
    _est(store, inputs=65).fit(first)
    _est(store, inputs=65).fit(second)
    assert len(copies_in(store)[0]) == 2
    _est(store, inputs=65).fit(first)  # the same DataFrame again: the rows it gave are reused
    assert len(copies_in(store)[0]) == 2

    def shake(features):
        import random

        return [float(v) + random.random() for v in features]

    jittered = base.withColumn("features", F.udf(shake, "array<double>").asNondeterministic()("features"))
    _est(store).fit(jittered)  # rows that differ each time they are computed
    assert len(copies_in(store)[0]) == 3
    with caplog.at_level(logging.WARNING, logger="estimator"):  # again: its fingerprint pass and its write differ
        fitted = _est(store).fit(jittered)
    assert "gave other rows when computed again" in caplog.text and len(fitted.getHistory()) == 1
    markers, attempts = copies_in(store)
    assert len(markers) == 3 and len(attempts) == 3  # its copy served that fit and is gone


def test_the_split_follows_the_rows_not_their_partitioning(spark, store, pixels):
    df = _prep().fit(pixels).transform(pixels)
    first = materialize(df.repartition(3), store, ["features", "label"], 0.2, 5, 2)
    again = materialize(df.repartition(1).orderBy(F.rand(1)), store, ["features", "label"], 0.2, 5, 2)
    other_seed = materialize(df, store, ["features", "label"], 0.2, 6, 2)
    for m in (first, again, other_seed):
        finish(store, m)
    assert again.reused and again.key == first.key and not other_seed.reused
    assert 0.15 < first.val_rows / (first.train_rows + first.val_rows) < 0.25


def test_twenty_materializations_leave_the_store_within_its_budget(spark, tmp_path):
    base = spark.range(0, 4000, 1, 2).select(F.array(*[(F.col("id") * k % 97).cast("float") for k in range(1, 9)])
                                             .alias("features"), (F.col("id") % 3).alias("label"))
    probe = Store.create(str(tmp_path / "probe"))
    finish(probe, materialize(base, probe, ["features", "label"], 0.1, 0, 2))
    one_copy = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(tmp_path / "probe") for f in fs)
    budget = int(3.5 * one_copy)
    store = Store.create(str(tmp_path / "budgeted"), max_data_bytes=budget)
    held = materialize(base.filter("id != 0"), store, ["features", "label"], 0.1, 0, 2)  # a fit still running
    for i in range(1, 20):
        finish(store, materialize(base.filter(F.col("id") != i), store, ["features", "label"], 0.1, 0, 2))
        markers, attempts = copies_in(store)
        assert sum(m["bytes"] for m in markers) <= budget and len(attempts) == len(markers)
    keys = [m["attempt"] for m in copies_in(store)[0]]
    assert len(keys) == 3 and json.loads(store.read_bytes(store.data(held.key.split("/")[0]).commit_marker(
        held.key.split("/")[1])))["attempt"] in keys  # the running fit's copy was kept, the oldest others went
    finish(store, held)
