"""The GPU suite is ready to run: `bash .ci/gpu` skips cleanly where torch sees no CUDA device (one line, exit
0), and its benchmark runs end to end (on the CPU here, small sizes), writing its results file."""
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA: bash .ci/gpu runs the suite itself")
def test_the_gpu_suite_skips_in_one_line_without_cuda(tmp_path):
    result = subprocess.run(["bash", os.path.join(ROOT, ".ci", "gpu"), str(tmp_path / "results")],
                            capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHON=sys.executable))
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout == f"GPU suite skipped: torch sees no CUDA device here ({sys.executable})\n"
    assert not (tmp_path / "results").exists()


# A GPU host has torch but neither pyspark nor Java: the benchmark (and tests/gpu) run there without pyspark.
WITHOUT_PYSPARK = "import runpy, sys; sys.modules['pyspark'] = None; sys.argv = sys.argv[1:]; " \
                  "runpy.run_path(sys.argv[0], run_name='__main__')"


def test_the_gpu_benchmark_runs_on_the_cpu_without_pyspark_and_writes_its_results(tmp_path):
    out = tmp_path / "results_gpu.json"
    result = subprocess.run([sys.executable, "-c", WITHOUT_PYSPARK, os.path.join(ROOT, "benchmarks", "bench_gpu.py"),
                             "--device", "cpu", "--quick", "--json", str(out)], capture_output=True, text=True,
                            timeout=300, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=ROOT))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    results = json.loads(out.read_text())
    for workload, runs in (("w2", ("in memory", "streaming", "device loop")),
                           ("images", ("PNG, default reader", "PNG, 2 decode threads", "PNG, 8 decode threads",
                                       "PNG, 8 decode processes", "pre-decoded", "device loop")),
                           ("bert", [f"{name}, batch 32" for name in (
                               "ddp", "fsdp", "fsdp, shard_alone", "plain", "plain FSDP2")])):
        for run in runs:
            assert results[workload][run]["rows_per_s"] > 0 and results[workload][run]["device"] == "cpu"
            assert 0 <= results[workload][run]["data_wait_fraction"] < 1
    assert "| W2 20,000 x 64 |" in result.stdout
    bert = results["bert"]
    assert bert["ddp, batch 32"]["allreduce"] == bert["fsdp, batch 32"]["allreduce"] == "nothing (one rank)"
    assert "reduce-scatter" in bert["fsdp, shard_alone, batch 32"]["allreduce"]
