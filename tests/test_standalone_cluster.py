"""A real Spark standalone cluster on loopback, from the pip-installed pyspark: one master and two
workers (1 core each, their own SPARK_WORKER_DIR), started and stopped by process id. The README
example's --cluster flag does it (estimator.cluster.LocalStandaloneCluster); a barrier stage of 2 tasks
on 1-core executors must put one rank on each executor. The executors' Python holds only what the README
lists (torch, numpy, pyarrow, pandas), not this project: the driver ships it."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.spark


def _java_pids(marker):
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if marker in line and "java" in line]


def test_a_fit_that_loses_a_worker_goes_on_with_the_slots_left(tmp_path):
    """min_num_proc=1: a worker (its JVM, its executor and their Python processes) killed in epoch 3 of 6; the
    retry finds one task slot, goes on with one rank from the checkpoint of epoch 2, keeping the global batch,
    and the history has each of the 6 epochs once."""
    import json

    result = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "seeds", "lost_worker_job.py"),
                             str(tmp_path)], capture_output=True, text=True, timeout=600,
                            env=dict(os.environ, SPARK_LOCAL_IP="127.0.0.1"))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["killed"]["after_epochs"] == 2 and report["killed"]["processes"] >= 2  # worker and executor
    assert report["slots_after"] == 1
    log = "\n".join(report["log"])
    assert "Run lost-worker failed on attempt 1 of 3; retrying from its last checkpoint" in log
    assert ("Run lost-worker: 1 task slot(s) left of the 2 it needs (an executor was lost): retrying on 1 rank(s) "
            "(min_num_proc=1) with 64 rows per rank's batch, the global batch of 64 kept") in log
    assert "continues from its checkpoint after epoch 2" in log
    assert "on 1 ranks" in report["log"][-1]  # "Trained run lost-worker on 1 ranks ..."
    history = report["history"]
    assert [row["epoch"] for row in history] == [1, 2, 3, 4, 5, 6]
    assert history[-1]["val_accuracy"] >= 0.85 and history[-1]["loss"] < history[1]["loss"]
    assert not _java_pids(str(tmp_path / "cluster"))


@pytest.fixture(scope="module")
def bare_executor_python():
    """A venv holding exactly what README 'On a cluster' says executors need (torch, then pyarrow, numpy, pandas,
    pinned by constraints.txt, with what pip installs for them) and nothing of this project: `.ci/setup bare`
    makes it once in .cache/ (.ci/test makes it beside the main stack's setup, before the suite)."""
    venv = os.path.join(ROOT, ".cache", "bare-executor-venv")
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(os.path.join(venv, "installed")):
        subprocess.run(["bash", os.path.join(ROOT, ".ci", "setup"), "bare"], check=True, timeout=1800)
    for module in ("cloudpickle", "estimator"):  # the premise: only the listed packages are there
        missing = subprocess.run([python, "-c", f"import {module}"], capture_output=True, text=True, cwd="/")
        assert f"No module named '{module}'" in missing.stderr
    return python


def test_the_example_fits_and_transforms_on_executors_with_only_the_listed_packages(tmp_path, bare_executor_python):
    """The README's list is true: its example fits, transforms and evaluates on executors whose Python has only
    the listed packages (this project shipped by the driver), num_proc the cluster's two slots, one rank on each
    one-core executor. A model whose code needs a package they lack fails once (an environment failure is not
    retried), naming the module, the executor and its Python, in a few lines."""
    import json

    base = tmp_path / "cluster"
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "seeds", "bare_executor_job.py"),
                             str(tmp_path)], capture_output=True, text=True, timeout=600,
                            env=dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=bare_executor_python))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["executor_python"] == bare_executor_python
    assert "executors registered: 2" in result.stdout
    assert "ranks: 2" in result.stdout  # num_proc defaulted to the cluster's two task slots
    assert float(re.search(r"Test accuracy: ([\d.]+)", result.stdout).group(1)) > 0.85
    # each executor (one per worker) ran one rank of the example's barrier stage
    assert [len(list((base / f"worker{i}").glob("app-*/*"))) for i in range(2)] == [2, 2]  # the example, the failure
    failure = report["failure"]
    assert failure["kind"] == "environment" and failure["lines"] <= 30, failure
    assert failure["summary"].startswith("ModuleNotFoundError: No module named 'sklearn' (executor ")
    assert f"Python {bare_executor_python} " in failure["summary"] and "PYSPARK_PYTHON" in failure["summary"]
    assert "retrying" not in result.stderr  # one launch: the same module would be missing again
    assert not _java_pids(str(tmp_path / "cluster"))
