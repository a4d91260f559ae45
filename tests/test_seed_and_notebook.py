"""Seed 002 with only its imports changed, and the MNIST notebook executed headless."""
import importlib.util
import json
import os
import re
import subprocess
import sys
import urllib.request

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.spark


def _env(master):
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable,
               PYSPARK_SUBMIT_ARGS=f"--master {master} pyspark-shell")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return env


@pytest.mark.parametrize("session", ["classic", "connect"])
def test_seed_002_runs_with_only_its_imports_changed(tmp_path, session):
    """The Synapse notebook's code: 3 processes (as its numExecutors), SparkBackend output with
    timestamps, setOutputCols, an argmax udf over the output vectors, the evaluator. On a classic session, and
    on a Spark Connect session (SPARK_REMOTE makes its `SparkSession.builder.getOrCreate()` a Connect client)."""
    from estimator.cluster import LocalConnectServer, free_port

    script = os.path.join(ROOT, "tests", "seeds", "seed_002_horovod_synapse.py")
    env, server, server_jobs = _env("local[3]"), None, []
    if session == "connect" and not LocalConnectServer.available():
        pytest.skip("this pyspark ships no Spark Connect server (the Spark 3.5 stack)")
    if session == "connect":
        ui = free_port()
        server = LocalConnectServer(master="local[3]", conf={"spark.ui.port": str(ui)}).start()
        env.pop("PYSPARK_SUBMIT_ARGS")
        env["SPARK_REMOTE"] = server.url
    try:
        result = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=900,
                                cwd=str(tmp_path), env=env)
        if server is not None:  # the script's jobs ran on the Connect server, not in a session of its own
            with urllib.request.urlopen(f"http://127.0.0.1:{ui}/api/v1/applications", timeout=30) as response:
                app = json.loads(response.read())[0]["id"]
            with urllib.request.urlopen(f"http://127.0.0.1:{ui}/api/v1/applications/{app}/jobs",
                                        timeout=30) as response:
                server_jobs = json.loads(response.read())
    finally:
        if server is not None:
            server.stop()
    assert result.returncode == 0, result.stderr[-4000:]
    epochs = re.findall(r"^\w{3} \w{3} [ \d]\d [\d:]{8} \d{4} run \S+ epoch (\d): loss=([\d.]+) val_loss=([\d.]+)"
                        r" data_wait=[\d.]+ \([\d.]+ s\)$",  # the line ends with the epoch's seconds
                        result.stdout, re.MULTILINE)
    assert [e[0] for e in epochs] == ["1", "2", "3"], result.stdout[-3000:]
    accuracy = float(re.search(r"^Test accuracy: ([\d.]+)$", result.stdout, re.MULTILINE).group(1))
    assert 0.0 <= accuracy <= 1.0  # learning is the notebook's test: 3 epochs on 4,000 raw-pixel rows is too few
    if session == "connect":
        assert len(server_jobs) >= 3, server_jobs  # materialize, train, evaluate at least


def test_mnist_notebook_executes_and_reaches_85_percent(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("PATH", _env("local[2]")["PATH"])  # the kernel runs this interpreter
    monkeypatch.setenv("PYSPARK_PYTHON", sys.executable)
    notebook = nbformat.read(os.path.join(ROOT, "notebooks", "horovod_mnist.ipynb"), as_version=4)
    nbclient.NotebookClient(notebook, timeout=900, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()  # raises if a cell fails
    text = "".join(o.get("text", "") for c in notebook.cells for o in c.get("outputs", []))
    accuracy = float(re.search(r"Test accuracy: ([\d.]+)", text).group(1))
    assert accuracy >= 0.85
    images = [o for c in notebook.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) == 1  # the training-history plot
    if importlib.util.find_spec("tensorboard") is not None:  # the test extras have it: the run's event files
        read_back = re.search(r"val_loss per epoch, read back from the event files: \[([^\]]*)\]", text)
        assert read_back and len(read_back.group(1).split(",")) == 15, text[-2000:]
