"""Several GPUs per Spark task, tested without a GPU the way pyspark's TorchDistributor tests do: a
local-cluster executor whose discovery script reports 4 fake GPU addresses (3, 5, 6, 7). With
spark.task.resource.gpu.amount=2, num_proc=4 runs 2 barrier tasks of 2 ranks each (a spawned process per
GPU); each rank is given its own address. With 0.5, two ranks share one address. Training runs on the CPU."""
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.spark


def run_job(tmp_path, addresses, case):
    script = tmp_path / "gpus.sh"
    script.write_text("#!/bin/bash\necho '" + json.dumps({"name": "gpu", "addresses": addresses}) + "'\n")
    script.chmod(0o755)
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable, PYTHONPATH=ROOT,
               GPUS_PER_TASK_JOB=str(tmp_path))  # marks this job's processes (other tests may run beside it)
    env.pop("SPARK_TORCH_ESTIMATOR_FAULTS", None)
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "seeds", "gpus_per_task_job.py"),
                             str(script), str(tmp_path / "store"), case], capture_output=True, text=True,
                            timeout=600, cwd=str(tmp_path), env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    out = json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][-1])
    assert not _rank_processes(str(tmp_path)), "rank processes outlived the fit"
    return out


@pytest.fixture(scope="module")
def four_gpus(tmp_path_factory):
    """One session (a local-cluster executor with 4 GPU addresses, 2 a task) for three fits: a plain one, one
    whose rank 3 raises, one whose rank 2's process exits and is retried (one local-cluster start, not three)."""
    return run_job(tmp_path_factory.mktemp("four-gpus"), ["3", "5", "6", "7"], "per_task")


def _rank_processes(job):
    """This job's spawned rank processes still alive: their command line names multiprocessing's spawn, and their
    environment carries the job's marker (tests running beside this one spawn ranks of their own)."""
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    found = []
    for line in ps.splitlines():
        if "multiprocessing.spawn" in line and "spawn_main" in line:
            try:
                with open(f"/proc/{line.split()[0]}/environ", "rb") as handle:
                    if f"GPUS_PER_TASK_JOB={job}".encode() in handle.read().split(b"\0"):
                        found.append(line)
            except OSError:  # it ended meanwhile
                pass
    return found


def assigned(out):
    return dict(re.fullmatch(r"rank (\d) ran on cpu \(Spark assigned GPU (\d) to it\)", line).groups()
                for line in out["assigned"])


def test_two_gpus_per_task_run_two_ranks_each_on_their_own_address(four_gpus):
    out = four_gpus["fit"]
    assert out["tasks"] == ["num_proc=4: 2 Spark tasks of 2 ranks each, a rank per GPU "
                            "(spark.task.resource.gpu.amount=2)"]
    ranks = assigned(out)
    assert sorted(ranks) == ["0", "1", "2", "3"] and sorted(ranks.values()) == ["3", "5", "6", "7"]  # all four used
    # the two ranks of one task hold its two addresses (which task holds which pair is Spark's)
    assert {frozenset((ranks["0"], ranks["1"])), frozenset((ranks["2"], ranks["3"]))} in (
        {frozenset(("3", "5")), frozenset(("6", "7"))}, {frozenset(("3", "6")), frozenset(("5", "7"))},
        {frozenset(("3", "7")), frozenset(("5", "6"))})
    assert out["val_accuracy"] >= 0.85
    assert out["refused"] == [
        "The 'num_proc' parameter of TorchEstimator counts training processes, one per GPU: with "
        "spark.task.resource.gpu.amount=2 each Spark task runs 2 of them, so num_proc must be a multiple of 2. "
        "Got 3; use 2 or 4.",
        "data_mode='direct' runs one training process per Spark task; with spark.task.resource.gpu.amount=2 each "
        "task runs 2. Use data_mode='materialize' (the default) on tasks with several GPUs."]
    assert out["transformed"] == 1797 and len(out["transform_said"]) == 1
    assert out["transform_said"][0].startswith("transform runs one copy of the model per Spark task, on the first "
                                               "of the 2 GPUs each task is given")


def test_half_a_gpu_per_task_two_ranks_share_one_address(tmp_path):
    out = run_job(tmp_path, ["3"], "shared")["fit"]
    assert assigned(out) == {"0": "3", "1": "3"} and out["tasks"] == []  # a rank per task, both on GPU 3
    assert out["val_accuracy"] >= 0.85


def test_a_failing_rank_of_a_task_fails_the_fit_with_its_own_rank_number(four_gpus):
    out = four_gpus["failure"]
    assert out["error"] == "rank 3: InjectedFault: injected fault at step on rank 3 (attempt 0, epoch 1, step 5)"


def test_a_killed_rank_of_a_task_is_retried_from_the_checkpoint(four_gpus):
    out = four_gpus["retry"]
    assert "error" not in out, out
    assert len(out["retried"]) == 1 and "rank 2: its process exited (code 17) without a result" in out["retried"][0]
    assert out["val_accuracy"] >= 0.85
