"""What the user's console shows, counted: a fit whose rank fails, and fits with verbose=0. Local mode with
Spark's default log settings, in a process of its own, as a user's script runs."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.spark


def run_job(mode, tmp_path):
    # (the store is not named "store": in the job's folder that name would shadow the editable install's package)
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "seeds", "console_job.py"), mode,
                             str(tmp_path / "runs")], capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def between(stderr, name):
    """The stderr lines a fit printed (from its `begins` marker to its end marker), without Spark's console
    progress bar (redrawn in place with carriage returns)."""
    text = re.search(rf"=== {re.escape(name)} begins\n(.*?)=== {re.escape(name)} (raised|returned)", stderr, re.S)
    assert text, stderr[-4000:]
    lines = [re.sub(r"\[Stage [^\]]*\]", "", line.split("\r")[-1] if line.endswith("\r") else line)
             for line in text.group(1).split("\n")]
    lines = [re.sub(r"\r\s*", "", line) for line in lines]
    return [line for line in lines if line.strip()], text.group(2)


def test_a_failing_rank_is_told_once_in_a_few_lines(tmp_path):
    """Without the driver-side stop, Spark printed 134 lines here (the traceback and Java frames, twice)."""
    result = run_job("fail", tmp_path)
    lines, end = between(result.stderr, "failing fit")
    assert end == "raised"
    assert len(lines) <= 60, "\n".join(lines)
    assert not [line for line in lines if " ERROR " in line or "\tat " in line], "\n".join(lines)
    assert result.stdout.strip().splitlines()[-1] == "RankFailed: rank 1: ArithmeticError: rank 1 exploded at step 3"
    said = "\n".join(lines)  # max_retries=3, and the same failure twice from the same point ends the fit
    assert "failed on attempt 1 of 4; retrying" in said and "attempt 3" not in said, said
    assert ("failed the same way on attempts 1 and 2, both launched from the start: rank 1: ArithmeticError: rank 1 "
            "exploded at step 3. Another launch would fail again: giving up (2 of max_retries=3 unused)") in said, said


@pytest.fixture(scope="module")
def quiet_job(tmp_path_factory):
    return run_job("quiet", tmp_path_factory.mktemp("quiet"))


def test_verbose_0_prints_nothing_of_its_own_and_a_missing_optional_package_is_no_noise(quiet_job):
    result = quiet_job
    for i in (0, 1):
        lines, end = between(result.stderr, f"fit {i} verbose=0")
        assert end == "returned" and lines == [], "\n".join(lines)
    first, _ = between(result.stderr, "fit 2 verbose=1")
    second, _ = between(result.stderr, "fit 3 verbose=1")
    notice = "TensorBoard logs are off: the tensorboard package is not installed"
    assert not any(notice in line for line in first + second), "\n".join(first)  # optional: logged at DEBUG only
    assert sum(bool(re.match(r"run \S+ epoch [12]: loss=", line)) for line in first) == 2, "\n".join(first)


def test_a_classic_fit_and_transform_import_no_language_model_package(quiet_job):
    """peft imports transformers (and bitsandbytes where installed: 4.5 s, and its warnings in every executor's
    log). The job's model fails its forward where one is imported: on the driver (the dry run), the ranks and the
    executors; the driver's own modules are printed at the end. They are installed here, so this can fail."""
    import importlib.util

    assert all(importlib.util.find_spec(name) for name in ("peft", "transformers"))
    for i in range(4):
        assert between(quiet_job.stderr, f"fit {i} verbose={i // 2}")[1] == "returned", quiet_job.stdout[-2000:]
    assert "transform: 64 rows" in quiet_job.stdout, quiet_job.stdout[-2000:]
    assert "driver imported: []" in quiet_job.stdout, quiet_job.stdout[-2000:]
