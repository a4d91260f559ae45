"""A real Spark standalone cluster on loopback, from the pip-installed pyspark: one master and two
workers (1 core each, their own SPARK_WORKER_DIR), started and stopped by process id. The README
example's --cluster flag does it (estimator.cluster.LocalStandaloneCluster); a barrier stage of 2 tasks
on 1-core executors must put one rank on each executor."""
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


def test_example_fits_and_transforms_across_two_executors(tmp_path):
    base = tmp_path / "cluster"
    result = subprocess.run([sys.executable, os.path.join(ROOT, "notebooks", "digits_example.py"), "--cluster",
                             "--cluster-dir", str(base), "--store", str(tmp_path / "store"), "--epochs", "5"],
                            capture_output=True, text=True, timeout=600, cwd=str(tmp_path),
                            env=dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "executors registered: 2" in result.stdout
    assert "ranks: 2" in result.stdout  # num_proc defaulted to the cluster's two task slots
    assert float(re.search(r"Test accuracy: ([\d.]+)", result.stdout).group(1)) > 0.85
    # each executor (one per worker) ran one rank of the barrier stage
    executor_dirs = [p for i in range(2) for p in (base / f"worker{i}").glob("app-*/*")]
    assert len(executor_dirs) == 2
    assert not _java_pids(str(base))  # the workers (their command lines name their dirs) were stopped

