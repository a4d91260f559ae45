"""TensorBoard event files read back with tensorboard's own reader; MLflow runs in a local tracking store."""
import importlib.util
import json
import os
import re
import threading
import time

import numpy as np
import pytest
import torch
from torch import nn

from estimator import TorchEstimator
from estimator.core.faults import ENV
from helpers import MLP, seeded
from spark_helpers import digits_frame

pytestmark = pytest.mark.spark


def _estimator(store, **kw):
    model = seeded(MLP)
    params = dict(num_proc=2, store=store, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                  loss=nn.CrossEntropyLoss(), metrics=["accuracy"], feature_cols=["features"], label_cols=["label"],
                  batch_size=64, epochs=3, validation="is_val", random_seed=3)
    params.update(kw)
    return TorchEstimator(**params)


@pytest.mark.connect
def test_tensorboard_event_files_hold_every_epoch_key_and_the_step_loss(spark, store, digits):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    fitted = _estimator(store, log_every_n_steps=5).fit(digits_frame(spark, digits))
    logs = store.run(fitted.getRunId()).logs  # a local store: its path is a folder here
    assert store.get_logs_path(fitted.getRunId()).endswith(logs)
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(logs))
    events = event_accumulator.EventAccumulator(logs)
    events.Reload()
    history = fitted.getHistory()
    for key in ("loss", "accuracy", "val_loss", "val_accuracy", "data_wait"):
        points = events.Scalars(f"epoch/{key}")
        assert [p.step for p in points] == [1, 2, 3], key
        assert [p.value for p in points] == pytest.approx([row[key] for row in history], rel=1e-6), key
    assert [p.value for p in events.Scalars("epoch/lr")] == pytest.approx([0.1] * 3)
    assert all(p.value > 0 for p in events.Scalars("epoch/rows_per_second"))
    steps = [p.step for p in events.Scalars("step/loss")]
    assert steps and all(s % 5 == 0 for s in steps) and steps == sorted(set(steps))


def test_mlflow_run_holds_params_metric_histories_best_epoch_and_the_model(spark, store, digits, tmp_path,
                                                                          monkeypatch, mlflow_file_store):
    import mlflow.pytorch  # mlflow_file_store: a local file store; no server
    from mlflow.tracking import MlflowClient

    df = digits_frame(spark, digits)
    client = MlflowClient()
    # every epoch of rank 0 takes a second longer: the epochs reach MLflow while the fit runs
    monkeypatch.setenv(ENV, json.dumps([{"point": "epoch", "rank": 0, "action": "sleep", "seconds": 1.0}]))
    with mlflow.start_run() as run:
        seen, done = [], threading.Event()

        def watch():
            while not done.wait(0.1):
                seen.append(len(client.get_metric_history(run.info.run_id, "loss")))

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        fitted = _estimator(store).fit(df)
        done.set()
        watcher.join()
    assert any(0 < n < 3 for n in seen), seen  # logged live, epoch by epoch, not all at the end
    history = fitted.getHistory()
    for key in ("loss", "val_loss", "val_accuracy"):
        logged = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        assert logged == [(i + 1, pytest.approx(row[key])) for i, row in enumerate(history)], key
    data = client.get_run(run.info.run_id).data
    assert data.params["batch_size"] == "64" and data.params["epochs"] == "3"
    assert data.params["model_class"] == "MLP" and data.params["optimizer_class"] == "SGD"
    assert data.params["optimizer_lr"] == "0.1" and data.params["loss_class"] == "CrossEntropyLoss"
    assert data.params["ranks"] == "2" and int(data.params["train_rows"]) > 1000
    assert data.params["model_parameters"] == str(sum(t.numel() for t in fitted.getModel().parameters()))
    assert data.metrics["best_epoch"] == fitted.getBestEpoch()
    loaded = mlflow.pytorch.load_model(f"runs:/{run.info.run_id}/model")
    x = torch.tensor(np.asarray(digits[0][:8]), dtype=torch.float32)
    assert torch.equal(loaded(x), fitted.getModel()(x))
    with mlflow.start_run() as quiet:
        _estimator(store, mlflow=False, epochs=1).fit(df)
    assert client.get_run(quiet.info.run_id).data.metrics == {}
    # no active run and mlflow=None: nothing is logged, nothing is started
    runs_before = len(client.search_runs([run.info.experiment_id]))
    _estimator(store, epochs=1).fit(df)
    assert len(client.search_runs([run.info.experiment_id])) == runs_before


@pytest.mark.connect
def test_a_tracking_store_that_cannot_be_used_is_named_before_training(spark, store, tmp_path, monkeypatch):
    """MLflow's defaults with mlflow-skinny (a sqlite URI it cannot open), a file store refused without its
    variable, and a server that is down: each refused before any Spark job, with the setting and the fix."""
    mlflow = pytest.importorskip("mlflow")
    from estimator.cluster import free_port

    df = spark.createDataFrame([([0.0] * 64, 0)], ["features", "label"])
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    uris = [f"file://{tmp_path / 'mlruns'}", f"http://127.0.0.1:{free_port()}"]
    if importlib.util.find_spec("sqlalchemy") is None:  # mlflow-skinny: no database stores
        uris.append(f"sqlite:///{tmp_path / 'mlflow.db'}")
    for uri in uris:
        mlflow.set_tracking_uri(uri)
        started = time.monotonic()
        with pytest.raises(ValueError, match=rf"mlflow=True: MLflow's tracking store '{re.escape(uri)}' cannot be "
                                             r"used .* Point MLFLOW_TRACKING_URI .* MLFLOW_ALLOW_FILE_STORE=true; or set "
                                             r"mlflow=False."):
            _estimator(store, mlflow=True).fit(df)
        assert time.monotonic() - started < 30, uri
    assert not store.exists(store.path("runs")) and not store.exists(store.path("data"))  # no job wrote anything
    mlflow.set_tracking_uri(None)


@pytest.mark.connect
def test_a_tracking_failure_after_training_warns_and_returns_the_model(spark, store, digits, monkeypatch,
                                                                      mlflow_file_store):
    import mlflow.pytorch

    def refuse(*args, **kwargs):
        raise ConnectionError("the tracking server went away")

    monkeypatch.setattr(mlflow.pytorch, "log_model", refuse)
    with pytest.warns(RuntimeWarning, match=r"Logging the model to MLflow failed \(ConnectionError: the tracking "
                                            r"server went away\); the fit goes on and returns its model"):
        fitted = _estimator(store, mlflow=True, epochs=1).fit(digits_frame(spark, digits))
    assert len(fitted.getHistory()) == 1
    assert mlflow.active_run() is None  # the run this fit started is ended all the same
    mlflow.set_tracking_uri(None)
