"""A transform right after a fit reuses the fit's Python workers (torch already imported) instead of
starting new ones: a fresh session in a subprocess, so no idle worker of another test is picked."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.spark


def test_transform_after_fit_runs_in_the_ranks_python_workers(tmp_path):
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "seeds", "worker_reuse_job.py"),
                             str(tmp_path / "store")], capture_output=True, text=True, timeout=600,
                            cwd=str(tmp_path), env=dict(os.environ, SPARK_LOCAL_IP="127.0.0.1",
                                                        PYSPARK_PYTHON=sys.executable, PYTHONPATH=ROOT))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    workers = json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][-1])["workers"]
    # each entry: "<pid> <whether estimator.launch.spark, which only the training ranks import, was loaded>"
    assert len(workers) >= 1 and all(w.endswith(" True") for w in workers), workers
