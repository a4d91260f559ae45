"""Bad input fails with a message naming the column/param and the fix, before any Spark job."""
import math
import re

import pytest
import torch
from pyspark.sql import functions as F
from torch import nn

from estimator import TorchEstimator
from helpers import MLP, seeded
from spark_helpers import digits_frame, jobs_run_by

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def df(spark, digits):
    return digits_frame(spark, digits).withColumn("name", F.lit("x"))


def _est(store, **kw):
    model = seeded(MLP)
    params = dict(num_proc=2, store=store, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                  loss=nn.CrossEntropyLoss(), feature_cols=["features"], label_cols=["label"], epochs=1)
    params.update(kw)
    return TorchEstimator(**params)


@pytest.mark.parametrize("kw, message", [
    (dict(feature_cols=["pixels"]), "Column 'pixels' (from feature_cols) is not in the DataFrame. Available columns: "
                                    "features, label, ink"),
    (dict(label_cols=["name"]), "Column 'name' (from label_cols) holds strings: index the labels first (StringIndexer"),
    (dict(label_cols=["name"], loss=nn.MSELoss()), "holds strings, and the loss regresses numbers: cast the column "
                                                   "first (F.col('name').cast('double'))"),
    (dict(sample_weight_col="nope"), "Column 'nope' (from sample_weight_col) is not in the DataFrame"),
    (dict(validation="features"), "Column 'features' (from validation) has type array<float>; it must be boolean "
                                  "(true: a validation row) or a number (non-zero"),
    (dict(validation="name"), "Column 'name' (from validation) has type string; it must be boolean"),
    (dict(input_shapes=[[-1, 64], [-1, 1]]), "The 'input_shapes' parameter of TorchEstimator must be a list of 1 shapes"),
    (dict(loss_weights=[1.0, 2.0]), "The 'loss_weights' parameter of TorchEstimator must be a list of 1 numbers"),
    (dict(batch_size=0), "The 'batch_size' parameter of TorchEstimator must be an int >= 1. Got 0 instead."),
    (dict(feature_cols=["label"]), "appear in both feature_cols and label_cols"),
    (dict(sample_weight_col="weight", loss=lambda o, t: nn.functional.cross_entropy(o, t)),
     "torch.nn losses or functions that accept reduction='none' (such as torch.nn.functional.binary_cross_entropy) "
     "when sample_weight_col is set"),
    (dict(loss=nn.MSELoss(), metrics=["accuracy"]), "metrics=['accuracy'] means nothing for label with the regression loss MSELoss"),
])
@pytest.mark.connect
def test_bad_input_fails_before_any_job(spark, store, df, kw, message):
    errors = []

    def fit():
        with pytest.raises(ValueError) as info:
            _est(store, **kw).fit(df)
        errors.append(str(info.value))

    assert jobs_run_by(spark, fit) == []
    assert message in errors[0]
    assert not store.exists(store.path("data"))  # nothing written


@pytest.mark.connect
def test_forward_that_does_not_fit_the_columns_fails_on_the_driver(spark, store, df):
    with pytest.raises(ValueError, match=r"The model's forward\(\) failed on 16 training rows.*features: \(16, 1, 8, 8\)"):
        _est(store, input_shapes=[[-1, 1, 8, 8]]).fit(df)  # an MLP cannot take images


@pytest.mark.connect
def test_input_shape_that_does_not_fit_the_data(spark, store, df):
    with pytest.raises(ValueError, match=r"Column 'features' has 64 values per row, but its shape \[-1, 1, 28, 28\]"):
        _est(store, input_shapes=[[-1, 1, 28, 28]]).fit(df)


@pytest.mark.connect
def test_unpicklable_loss_is_named(spark, store, df):
    import threading

    lock = threading.Lock()

    def loss(output, target):
        with lock:
            return nn.functional.cross_entropy(output, target)

    with pytest.raises(ValueError, match="cannot be sent to the Spark executors"):
        _est(store, loss=loss).fit(df)


@pytest.mark.connect
def test_a_model_holding_a_lock_is_named_with_the_attribute(spark, store, df):
    import threading

    model = seeded(MLP)
    model.net[0].guard = threading.Lock()
    with pytest.raises(ValueError, match=r"The model cannot be sent to the Spark executors: TypeError: cannot pickle "
                                         r"'_thread.lock' object \(held by model.net.0.guard\)"):
        _est(store, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1)).fit(df)


@pytest.mark.connect
def test_more_processes_than_training_rows(spark, store):
    tiny = spark.createDataFrame([([0.0] * 64, 1)], "features array<float>, label long")
    with pytest.raises(ValueError, match="The training split has 1 rows, fewer than num_proc=2"):
        _est(store).fit(tiny)


@pytest.mark.connect
def test_more_processes_than_task_slots_fails_fast(spark, store, df):
    errors = []

    def fit():
        with pytest.raises(ValueError) as info:
            _est(store, num_proc=3).fit(df)
        errors.append(str(info.value))

    assert jobs_run_by(spark, fit) == []
    assert errors[0] == ("The 'num_proc' parameter of TorchEstimator must be at most the 2 task slots this Spark "
                         "application has. Got 3 instead. Lower num_proc or add executors/cores.")


def test_a_rank_failing_mid_training_raises_its_error_and_the_next_fit_works(spark, store, df):
    """Rank 1 raises at its 4th step while rank 0 waits in a DDP collective: Spark aborts the
    barrier stage, the user gets rank 1's own Python traceback, and Python workers stay usable."""
    import os

    from estimator.failures import RankFailed

    calls = {"n": 0}

    def flaky(output, target):
        calls["n"] += 1
        if os.environ.get("RANK") == "1" and calls["n"] > 3:
            raise ArithmeticError("rank 1 exploded at step 3")
        return nn.functional.cross_entropy(output, target)

    with pytest.raises(RankFailed) as info:
        _est(store, loss=flaky, batch_size=16).fit(df)
    assert info.value.rank == 1
    message = str(info.value)
    assert message.splitlines()[0] == "rank 1: ArithmeticError: rank 1 exploded at step 3"  # the cause comes first
    assert message.count("Traceback (most recent call last)") == 1 and "in flaky" in message  # its traceback, once
    assert "org.apache.spark" not in message and "\tat " not in message and len(message.splitlines()) < 60
    assert len(_est(store).fit(df).getHistory()) == 1


def _frame(spark, rows, schema="features array<float>, label long"):
    return spark.createDataFrame(rows, schema)


@pytest.mark.connect
def test_null_features_and_labels_are_named_with_their_count(spark, store):
    good = [([0.1] * 64, i % 10) for i in range(40)]
    with pytest.raises(ValueError, match=r"Column 'features' has 2 rows with null values \(of 43 rows\)\. Fill or drop "
                                         r"them first .* or set drop_nulls=True"):
        _est(store).fit(_frame(spark, good + [(None, 1), ([0.1] * 63 + [None], 2), ([0.2] * 64, None)]))
    with pytest.raises(ValueError, match=r"Column 'label' has 1 rows with null values \(of 41 rows\)"):
        _est(store).fit(_frame(spark, good + [([0.2] * 64, None)]))
    assert not list(store.find(store.path("data"), suffix=".parquet"))  # nothing committed or left behind


def test_a_null_ml_vector_is_named_as_a_null_and_drop_nulls_skips_its_row(spark, store):
    """A VectorAssembler's column with a null row: named with its count as any null (it failed inside the write as
    Spark's FAILED_EXECUTE_UDF of vector_to_array, with or without drop_nulls); transform names it too."""
    import json

    from pyspark.ml.linalg import Vectors, VectorUDT
    from pyspark.sql.types import LongType, StructField, StructType

    schema = StructType([StructField("features", VectorUDT()), StructField("label", LongType())])
    rows = [(Vectors.dense([0.1 * (i % 7)] * 64), i % 10) for i in range(40)] + [(None, 1)]
    frame = spark.createDataFrame(rows, schema)
    with pytest.raises(ValueError, match=r"Column 'features' has 1 rows with null values \(of 41 rows\)"):
        _est(store).fit(frame)
    fitted = _est(store, drop_nulls=True).fit(frame)
    marker = next(store.find(store.path("data"), suffix="_COMMITTED.json"))
    assert json.loads(store.read_bytes(marker))["train_rows"] == 40
    with pytest.raises(Exception, match=r"Column 'features' has 1 null values .* set handle_invalid='keep'"):
        fitted.transform(frame).collect()
    # handle_invalid: a null output for the null row, in its place, or the row left out; an array holding a null
    # (its elements) is such a row too
    arrays = spark.createDataFrame([([0.1 * (i % 7)] * 64, i) for i in range(6)] + [([0.5] * 63 + [None], 6)],
                                   "features array<float>, label long")
    for source, bad in ((frame, 40), (arrays, 6)):
        kept = fitted.copy({fitted.handle_invalid: "keep"}).transform(source).orderBy("label").collect()
        skipped = fitted.copy({fitted.handle_invalid: "skip"}).transform(source).collect()
        assert len(kept) == source.count() and len(skipped) == source.count() - 1
        nulls = [r for r in kept if r["label__output"] is None]
        assert [r["features"] is None or None in r["features"] for r in nulls] == [True]
        assert nulls[0]["prediction"] is None and nulls[0]["probability"] is None
        good = {tuple(r["features"]): r["prediction"] for r in skipped}
        assert {tuple(r["features"]): r["prediction"] for r in kept if r["label__output"] is not None} == good
        assert all(p is not None for p in good.values())


@pytest.mark.connect
def test_drop_nulls_skips_those_rows(spark, store):
    import json

    import numpy as np
    import pyarrow.parquet as pq

    good = [([0.1 * (i % 7)] * 64, i % 10) for i in range(40)]
    bad = [(None, 1), ([0.2] * 64, None), ([0.3] * 63 + [None], 2)]
    fitted = _est(store, drop_nulls=True, epochs=1).fit(_frame(spark, good + bad))
    assert len(fitted.getHistory()) == 1
    marker = next(store.find(store.path("data"), suffix="_COMMITTED.json"))
    assert json.loads(store.read_bytes(marker))["train_rows"] == 40
    # what was written: the good rows' values exactly, arrays whose elements Parquet knows are never null
    files = list(store.find(store.path("data"), suffix=".parquet"))
    tables = [pq.read_table(store.fs.open(f, "rb")) for f in files]
    assert all(not t.schema.field("features").type.value_field.nullable for t in tables)
    features = np.concatenate([np.stack(t.column("features").to_pylist()) for t in tables if t.num_rows])
    want = np.array([r[0] for r in good], dtype=np.float32)
    np.testing.assert_array_equal(np.sort(features[:, 0]), np.sort(want[:, 0]))


@pytest.mark.connect
def test_arrays_of_different_lengths_are_named(spark, store):
    rows = [([0.1] * 64, i % 10) for i in range(30)] + [([0.1] * 60, 1)]
    with pytest.raises(ValueError, match=r"Column 'features' holds arrays of different lengths \(60 to 64 values per "
                                         r"row\)"):
        _est(store).fit(_frame(spark, rows))


@pytest.mark.connect
def test_empty_dataframe_and_empty_training_split(spark, store):
    with pytest.raises(ValueError, match=r"The DataFrame given to fit has no rows: nothing to train on"):
        _est(store).fit(_frame(spark, []))
    data = store.path("data")
    assert not store.exists(data) or store.fs.find(data) == []  # no uncommitted copy left in the store
    rows = [([0.1] * 64, i % 10, True) for i in range(20)]  # every row is a validation row
    with pytest.raises(ValueError, match="The training split has 0 rows"):
        _est(store, validation="v").fit(_frame(spark, rows, "features array<float>, label long, v boolean"))


@pytest.mark.connect
def test_unknown_store_scheme_is_named(spark, store, df):
    from store import Store

    with pytest.raises(ValueError, match=r"Store cannot open 'nosuch://bucket/x'.*Use a local path or an fsspec URL"):
        _est(Store.create("nosuch://bucket/x")).fit(df)


def test_a_loss_that_turns_nan_fails_the_fit_and_keeps_the_good_checkpoint(spark, store, df):
    """By default (terminate_on_nan=True). A fit of lr=1e20 diverges (inf, then NaN) and fails with the typed
    failure. Epoch 1 of run 'r' trains well; its refit's epoch 2 has a loss that is NaN: the fit fails, and the
    run's checkpoint still holds epoch 1's finite weights."""
    from estimator.failures import FailureKind, RankFailed
    from estimator.train.checkpoint import load_checkpoint

    with pytest.raises(RankFailed) as info:
        _est(store, epochs=2, lr=1e20).fit(df)
    assert info.value.kind is FailureKind.NAN
    assert re.match(r"NonFiniteLoss: The training loss is (nan|inf) at epoch 1, step \d+ on rank \d; stopping",
                    info.value.summary), info.value.summary

    def nan_loss(output, target):
        return nn.functional.cross_entropy(output, target) * float("nan")

    _est(store, run_id="r", epochs=1).fit(df)
    with pytest.raises(RankFailed, match=r"NonFiniteLoss: The training loss is nan at epoch 2, step 1 on rank"):
        _est(store, run_id="r", epochs=2, loss=nan_loss).fit(df)
    state = load_checkpoint(store, store.run("r").checkpoint)
    assert len(state["history"]) == 1 and all(torch.isfinite(v).all() for v in state["model"].values())


def test_terminate_on_nan_false_trains_on_and_warns_for_each_epoch(spark, store, df):
    with pytest.warns(RuntimeWarning) as caught:
        fitted = _est(store, epochs=2, lr=1e20, terminate_on_nan=False, verbose=0).fit(df)
    said = [str(w.message) for w in caught if "terminate_on_nan=False keeps training" in str(w.message)]
    assert [re.search(r"epoch (\d)", m).group(1) for m in said] == ["1", "2"], said
    assert all(not math.isfinite(row["loss"]) for row in fitted.getHistory())


@pytest.mark.connect
def test_transform_of_rows_unlike_the_training_rows_names_the_column_and_both_lengths(spark, store, df):
    """The model keeps each feature column's values per row from fit; transform checks every batch against them,
    and any failure of its UDF reaches the user with its cause first, not under torch's frames."""
    model = _est(store).fit(df)
    assert model.getFeatureSizes() == [64]
    narrow = _frame(spark, [([0.1] * 60, i % 10) for i in range(20)])
    with pytest.raises(Exception) as info:
        model.transform(narrow).collect()
    text = str(info.value)
    assert ("TransformFailed: TorchModel.transform: ValueError: Column 'features' has 60 values per row, but the "
            "model was trained on 64") in text
    assert len(text.splitlines()) <= 10, text


def test_a_run_id_resumes_only_its_own_fit(spark, store, df, capsys):
    """A refit under a run_id (a wheel trial's): with lr 0.5 it returned the lr 1e-5 run's model, saying nothing;
    a CrossValidator with a run_id scored fold 2 with fold 1's model. Other params are refused before any job,
    other rows after the data's job, both before anything trains; the same fit resumes with more epochs and,
    with nothing left to train, says so."""
    from estimator.failures import RunMismatch

    half = df.limit(600)
    first = _est(store, run_id="same", lr=1e-5, verbose=1).fit(half)
    errors = []

    def refit():
        with pytest.raises(RunMismatch) as info:
            _est(store, run_id="same", lr=0.5).fit(half)
        errors.append(str(info.value))

    assert jobs_run_by(spark, refit) == []
    assert re.search(r"run_id 'same' names a run in the store \(.*runs/same\) that trained something else: lr: "
                     r"1e-05 \(the run\) and 0.5 \(this fit\)\. A run_id resumes its one fit .* Use a new run_id "
                     r"\(or leave run_id unset: each fit a run of its own, as in a CrossValidator", errors[0]), errors[0]
    with pytest.raises(RunMismatch, match=r"the rows: this fit's data is not the data the run trained on"):
        _est(store, run_id="same", lr=1e-5).fit(df)
    capsys.readouterr()
    again = _est(store, run_id="same", lr=1e-5, epochs=2, verbose=1).fit(half)
    assert [row["epoch"] for row in again.getHistory()] == [1, 2]
    assert again.getHistory()[0] == first.getHistory()[0]
    assert "resuming run same at epoch 2 of 2" in capsys.readouterr().err
    _est(store, run_id="same", lr=1e-5, epochs=2, verbose=1, max_retries=3).fit(half)  # how it runs may change
    assert ("run same already has 2 finished epochs (epochs=2): nothing to train; its model is returned"
            in capsys.readouterr().err)
