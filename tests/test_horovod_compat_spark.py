"""Horovod TorchEstimator params on real Spark: each with an assertion on its effect."""
import io
import json
import re
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch import nn

from estimator import TorchEstimator
from estimator.backend import SparkBackend
from estimator.compression import Compression
from helpers import MLP, TwoOutputs, metrics, seeded
from spark_helpers import digits_frame, jobs_run_by
from store import Store

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def df(spark, digits):
    return digits_frame(spark, digits).cache()


def _est(store, model=None, **kw):
    model = model or seeded(MLP)
    params = dict(num_proc=2, store=store, model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
                  loss=nn.CrossEntropyLoss(), metrics=["accuracy"], feature_cols=["features"], label_cols=["label"],
                  batch_size=64, epochs=2, validation=0.1, random_seed=2)
    params.update(kw)
    return TorchEstimator(**params)


def test_backend_sets_processes_and_receives_the_epoch_lines(spark, store, df):
    out = io.StringIO()
    backend = SparkBackend(num_proc=2, stdout=out, prefix_output_with_timestamp=True)
    fitted = _est(store, num_proc=None, backend=backend).fit(df)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert re.match(r"^\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4} run " + fitted.getRunId() + r" epoch 1: loss=", lines[0])
    quiet = io.StringIO()
    _est(store, num_proc=None, backend=SparkBackend(num_proc=2, stdout=quiet), verbose=0, epochs=1).fit(df)
    assert quiet.getvalue() == ""  # verbose=0: no epoch lines
    with pytest.raises(ValueError, match="must be at most the 2 task slots .* Got 3 instead"):
        _est(store, num_proc=None, backend=SparkBackend(num_proc=3)).fit(df)
    with pytest.raises(ValueError, match="takes 'num_proc' or 'backend', not both"):
        _est(store, backend=backend).fit(df)


def test_loss_constructors_build_the_losses_on_each_rank(spark, store, df):
    fitted = _est(store, loss=None, loss_constructors=[lambda: nn.CrossEntropyLoss()], epochs=3).fit(df)
    history = fitted.getHistory()
    assert history[-1]["val_loss"] < history[0]["val_loss"] and history[-1]["val_accuracy"] > 0.8
    with pytest.raises(ValueError, match="takes one of 'loss' and 'loss_constructors', not both"):
        _est(store, loss_constructors=[nn.CrossEntropyLoss]).fit(df)


def test_default_loss_weights_are_one_over_the_number_of_labels(spark, store, df, digits):
    """Like Horovod: with two labels and no loss_weights, the loss is (ce + mse) / 2 (exact, with lr=0)."""
    model = seeded(TwoOutputs)
    history = _est(store, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), metrics=[],
                   label_cols=["label", "big"], loss=[nn.CrossEntropyLoss(), nn.MSELoss()], validation="is_val",
                   epochs=1).fit(df).getHistory()
    X, y = digits
    val = np.arange(len(y)) % 10 == 0
    with torch.no_grad():
        logits, big = model(torch.from_numpy(X[val]))
    ce = nn.CrossEntropyLoss()(logits, torch.from_numpy(y[val])).item()
    mse = nn.MSELoss()(big, torch.from_numpy((y[val] >= 5).astype(np.float32)).reshape(-1, 1)).item()
    assert history[0]["val_loss"] == pytest.approx((ce + mse) / 2, rel=1e-5)


def test_transformation_fn_changes_every_batch(spark, store, df):
    def all_zero(frame):
        frame["label"] = 0
        return frame

    fitted = _est(store, transformation_fn=all_zero, epochs=2).fit(df)
    assert fitted.getHistory()[-1]["val_accuracy"] == 1.0
    assert {r[0] for r in fitted.transform(df).select("prediction").distinct().collect()} == {0.0}


def test_ignored_params_warn(spark, store, df):
    import warnings

    with warnings.catch_warnings(record=True) as caught:  # the streaming reader uses shuffle_buffer_size
        warnings.simplefilter("always")
        _est(store, shuffle_buffer_size=1000, inmemory_cache_all=False, epochs=1).fit(df)
    assert not [w for w in caught if "shuffle_buffer_size" in str(w.message)]
    with pytest.warns(UserWarning, match="ignores mp_start_method='spawn'"):
        _est(store, mp_start_method="spawn", epochs=1).fit(df)
    with pytest.raises(ValueError, match="The 'reader_pool_type' parameter of TorchEstimator must be 'auto', "
                                         "'thread', 'process' or 'dummy'. Got 'threads' instead."):
        _est(store, reader_pool_type="threads").fit(df)


def test_partitions_per_process_sets_the_parquet_files(spark, store, df):
    _est(store, partitions_per_process=3, epochs=1).fit(df)
    train_files = [p for p in store.find(store.path("data"), suffix=".parquet") if "__is_val=false" in p]
    assert len(train_files) == 6


def test_backward_passes_per_step_and_get_optimizer(spark, store, df):
    # 1797 rows, 10% validation -> ~1620 train rows / 2 ranks / batch 64 = 13 batches; steps every 4 -> 4 per epoch
    fitted = _est(store, backward_passes_per_step=4, validation=0.0, epochs=2).fit(df)
    optimizer = fitted.getOptimizer()
    assert isinstance(optimizer, torch.optim.Adam)
    assert optimizer.param_groups[0]["params"][0] is next(fitted.getModel().parameters())
    steps = {float(s["step"]) for s in optimizer.state.values()}
    assert steps == {2 * 4.0}
    plain = _est(store, validation=0.0, epochs=2).fit(df).getOptimizer()
    assert {float(s["step"]) for s in plain.state.values()} == {2 * 15.0}  # ceil(1797 / 2 / 64) = 15 per epoch


def test_gradient_compression_fp16_trains(spark, store, df):
    fitted = _est(store, gradient_compression=Compression.fp16, epochs=3).fit(df)
    assert fitted.getHistory()[-1]["val_accuracy"] > 0.8
    with pytest.raises(ValueError, match="The 'gradient_compression' parameter of TorchEstimator must be"):
        _est(store, gradient_compression="int8").fit(df)


def test_terminate_on_nan_reaches_the_user(spark, store, df):
    from estimator.failures import RankFailed

    def nan_loss(output, target):
        return nn.functional.cross_entropy(output, target) * float("nan")

    # the driver's dry run does not check values; ranks stop at the first step
    with pytest.raises(RankFailed, match=r"The training loss is nan at epoch 1, step 1 on rank \d; stopping before "
                                         r"this step's gradients are applied or checkpointed, since "
                                         r"terminate_on_nan=True"):
        _est(store, loss=nan_loss, terminate_on_nan=True).fit(df)


class EpochLog:
    """A callback that appends what it sees to a file (local mode: executors share this disk)."""

    def __init__(self, path):
        self.path = path

    def on_train_begin(self, logs):
        self._write({"event": "begin"})

    def on_epoch_end(self, epoch, logs):
        self._write({"event": "epoch", "epoch": epoch, "loss": logs["loss"]})

    def on_train_end(self, logs):
        self._write({"event": "end", "epochs": len(logs["history"])})

    def _write(self, record):
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def test_callbacks_run_on_rank_zero_each_epoch(spark, store, df, tmp_path):
    path = tmp_path / "callback.jsonl"
    fitted = _est(store, callbacks=[EpochLog(str(path))], epochs=3).fit(df)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["event"] for r in records] == ["begin", "epoch", "epoch", "epoch", "end"]  # rank 0 only
    assert [r["loss"] for r in records[1:4]] == pytest.approx([h["loss"] for h in fitted.getHistory()])


def test_store_save_runs_and_checkpoint_filename(spark, tmp_path, df):
    keep = Store.create(str(tmp_path / "keep"), checkpoint_filename="last.pt")
    fitted = _est(keep, epochs=1).fit(df)
    assert keep.exists(keep.path("runs", fitted.getRunId(), "last.pt"))
    assert keep.get_checkpoint_filename() == "last.pt"
    drop = Store.create(str(tmp_path / "drop"), save_runs=False)
    fitted = _est(drop, epochs=1).fit(df)
    assert not drop.exists(drop.run(fitted.getRunId()).root)
    assert fitted.transform(df).count() == df.count()  # the model is complete without the run folder


def test_fit_on_parquet_trains_on_files_already_in_the_store(spark, store, digits):
    X, y = digits
    for name, rows in (("prepared/train", slice(0, 1500)), ("prepared/val", slice(1500, None))):
        store.makedirs(store.path(name))
        pq.write_table(pa.table({"features": pa.array(list(X[rows])), "label": y[rows]}),
                       store.path(name, "part-0.parquet"), row_group_size=400)
    est = _est(store, epochs=3)
    jobs = jobs_run_by(spark, lambda: est.fit_on_parquet("prepared/train", "prepared/val"))
    assert len(jobs) == 1  # training only: nothing to materialize
    fitted = est.fit_on_parquet(store.url(store.path("prepared/train")), "prepared/val")
    assert fitted.getHistory()[-1]["val_accuracy"] > 0.8
    with pytest.raises(ValueError, match=r"Columns \['pixels'\] are not in the Parquet files"):
        _est(store, feature_cols=["pixels"]).fit_on_parquet("prepared/train")


def test_random_seed_makes_fits_repeatable_and_run_id_names_the_run(spark, store, df):
    first = _est(store, model=seeded(MLP), random_seed=11, run_id="seeded-a").fit(df)
    again = _est(store, model=seeded(MLP), random_seed=11, run_id="seeded-b").fit(df)
    other = _est(store, model=seeded(MLP), random_seed=12).fit(df)
    same = [metrics(r) for r in first.getHistory()] == [metrics(r) for r in again.getHistory()]
    assert same  # same split, shuffles and dropout
    assert first.getHistory() != other.getHistory()
    assert first.getRunId() == "seeded-a" and store.exists(store.path("runs", "seeded-a", "checkpoint.pt"))


class Stamped(io.StringIO):
    """A stream that remembers when each line arrived."""

    def __init__(self):
        super().__init__()
        self.times = []

    def write(self, text):
        self.times.append(time.monotonic())
        return super().write(text)


class SlowEpochs:
    def on_epoch_end(self, epoch, logs):
        time.sleep(2.0)


def test_epoch_lines_reach_the_driver_while_training_runs(spark, store, df):
    out = Stamped()
    _est(store, num_proc=None, backend=SparkBackend(num_proc=2, stdout=out), callbacks=[SlowEpochs()],
         epochs=3).fit(df)
    finished = time.monotonic()
    lines = out.getvalue().splitlines()
    assert [re.search(r"epoch (\d):", line).group(1) for line in lines] == ["1", "2", "3"]
    assert finished - out.times[0] > 3.0  # epoch 1 was reported while epochs 2 and 3 still ran


def test_fits_without_random_seed_reuse_one_materialized_copy(spark, store, df):
    """The drawn training seed does not pick the validation split: refits write no new copy of the data."""
    fits = [_est(store, epochs=1, random_seed=None) for _ in range(2)]
    first, second = (est.fit(df) for est in fits)
    assert len(store.ls(store.path("data"))) == 1
    assert first.getHistory()[0]["loss"] != second.getHistory()[0]["loss"]  # the shuffles still differ


def test_epoch_lines_are_printed_by_default_and_verbose_0_is_silent(spark, store, df, capsys):
    fitted = _est(store, epochs=2).fit(df)  # no logging configured: a notebook shows stderr
    err = capsys.readouterr().err
    line = re.search(r"^run \S+ epoch 1: loss=[\d.]+ accuracy=[\d.]+ val_loss=.+ \((\d+\.\d\d) s\)$", err, re.M)
    assert line and float(line.group(1)) > 0, err[-2000:]  # the line ends with the epoch's seconds
    assert re.search(r"^run \S+ epoch 2: loss=", err, re.M)
    assert not any("seconds" in key for row in fitted.getHistory() for key in row)  # the line's, not the history's
    _est(store, epochs=2, verbose=0).fit(df)
    assert "epoch 1:" not in capsys.readouterr().err


def test_a_torch_model_built_directly_with_horovods_names_transforms(spark):
    """Horovod's own test builds TorchModel(history=None, model=..., input_shapes=[[2]], feature_columns=...,
    label_columns=..., optimizer=..., run_id=..., _metadata=...) without output shapes, then transforms."""
    from estimator import TorchModel

    rows = [([float(i), float(-i)], float(i % 2)) for i in range(10)]
    frame = spark.createDataFrame(rows, "features array<float>, y double")
    for outputs in (1, 3):
        model = seeded(nn.Linear, 2, outputs)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        torch_model = TorchModel(history=None, model=model, input_shapes=[[2]], feature_columns=["features"],
                                 label_columns=["y"], optimizer=optimizer, run_id="a", _metadata={})
        schemas = []
        assert jobs_run_by(spark, lambda: schemas.append(torch_model.transform(frame).schema)) == []  # one forward
        out = torch_model.transform(frame).toPandas()
        with torch.no_grad():
            expected = model(torch.tensor([r[0] for r in rows])).numpy()
        got = np.stack(out["y__output"]) if outputs > 1 else out["y__output"].to_numpy()[:, None]
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
        assert torch_model.getHistory() == [] and torch_model.getFeatureColumns() == ["features"]
