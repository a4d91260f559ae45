"""GPU assignment from Spark's task resources, tested without a GPU the way pyspark's TorchDistributor
tests do: a local-cluster executor whose GPU discovery script reports addresses 3 and 5. Each rank must
see the address Spark gave its task (not its local rank, which would be 0 and 1)."""
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.spark


def test_each_rank_gets_the_gpu_spark_assigned_to_its_task(tmp_path):
    script = tmp_path / "gpus.sh"
    script.write_text('#!/bin/bash\necho \'{"name": "gpu", "addresses": ["3", "5"]}\'\n')
    script.chmod(0o755)
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "seeds", "gpu_assignment_job.py"),
                             str(script), str(tmp_path / "store")], capture_output=True, text=True, timeout=600,
                            cwd=str(tmp_path), env=dict(os.environ, SPARK_LOCAL_IP="127.0.0.1",
                                                        PYSPARK_PYTHON=sys.executable, PYTHONPATH=ROOT))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assigned = dict(re.fullmatch(r"rank (\d) ran on cpu \(Spark assigned GPU (\d) to it\)", line).groups()
                    for line in lines[0]["assigned"])
    assert sorted(assigned) == ["0", "1"] and sorted(assigned.values()) == ["3", "5"]  # which rank gets which: Spark's
    # use_gpu=True on a machine without CUDA: one clear error naming what Spark assigned and what is missing
    error = lines[1]["use_gpu_true"]
    assert re.match(r"rank \d: use_gpu=True but ranks \[0, 1\] see no CUDA device", error), error
    assert "use_gpu=True but ranks [0, 1] see no CUDA device" in error
    assert "Spark assigned GPU addresses ['3', '5'] to ranks 0-1 but torch.cuda sees none" in error
    # a transform's tasks run on the GPU assigned to them (not all on GPU 0); which of the two each gets,
    # and whether two tasks ran at once, is Spark's
    assert lines[2]["inference_gpus"] and set(lines[2]["inference_gpus"]) <= {"3", "5"}
