import os
import sys

import numpy as np
import pytest

# Spark must not guess network interfaces, and executors must run this interpreter (with torch).
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ["PYSPARK_PYTHON"] = sys.executable
os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable


def pytest_addoption(parser):
    parser.addoption("--spark-session", choices=("classic", "connect"), default="classic",
                     help="the session the `spark` fixture gives: classic (local[2]), or a Spark Connect client of "
                          "a local Connect server started for the run. With connect, only the tests marked "
                          "`connect` run (one Python process cannot hold both kinds of session).")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--spark-session") != "connect":  # the classic pass leaves out what only Connect adds
        left = [item for item in items if item.get_closest_marker("connect_only")]
        if left:
            config.hook.pytest_deselected(items=left)
            items[:] = [item for item in items if not item.get_closest_marker("connect_only")]
        return
    chosen = [item for item in items if item.get_closest_marker("connect")]
    config.hook.pytest_deselected(items=[item for item in items if not item.get_closest_marker("connect")])
    items[:] = chosen


@pytest.fixture(scope="session")
def spark_kind(request):
    return request.config.getoption("--spark-session")


@pytest.fixture(scope="session")
def spark(spark_kind):
    from pyspark.sql import SparkSession

    # a Python worker that crashes shows its Python stack in Spark's error (a test that fails on one says where)
    conf = {"spark.ui.enabled": "false", "spark.sql.shuffle.partitions": "4",
            "spark.python.worker.faulthandler.enabled": "true"}
    if spark_kind == "connect":
        from estimator.cluster import LocalConnectServer, free_port

        ui_port = free_port()  # its REST API counts the server's jobs (spark_helpers.jobs_run_by)
        conf.update({"spark.ui.enabled": "true", "spark.ui.port": str(ui_port)})
        os.environ["SPARK_TEST_CONNECT_UI"] = f"http://127.0.0.1:{ui_port}"
        keep = os.environ.get("STE_CONNECT_LOG_DIR")  # keep the server's log (CI prints it when a test fails)
        base = None
        if keep:
            base = os.path.join(keep, os.environ.get("PYTEST_XDIST_WORKER", "main"))
            os.makedirs(base, exist_ok=True)
        with LocalConnectServer(master="local[2]", conf=conf, base_dir=base) as server:
            session = SparkSession.builder.remote(server.url).getOrCreate()
            yield session
            session.stop()
        return
    builder = SparkSession.builder.master("local[2]").appName("spark-torch-estimator-tests")
    for key, value in conf.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture
def mlflow_file_store(tmp_path, monkeypatch):
    """mlflow, tracking to a local file store of the test's own, in an experiment of its own. What mlflow keeps past
    a test (the tracking URI, the active experiment's id: a module global and MLFLOW_EXPERIMENT_ID) is put back, so
    that a later test in the same worker does not start its run in an experiment of a store that is gone."""
    mlflow = pytest.importorskip("mlflow")
    from mlflow.tracking import fluent

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.delenv("MLFLOW_EXPERIMENT_ID", raising=False)
    mlflow.set_tracking_uri(f"file://{tmp_path / 'mlruns'}")
    mlflow.set_experiment(tmp_path.name)
    yield mlflow
    mlflow.set_tracking_uri(None)
    fluent._active_experiment_id = None


@pytest.fixture
def store(tmp_path):
    from store import Store

    return Store.create(str(tmp_path / "store"))


@pytest.fixture(scope="session")
def digits():
    from sklearn.datasets import load_digits

    data = load_digits()
    return (data.data / 16.0).astype(np.float32), data.target.astype(np.int64)
