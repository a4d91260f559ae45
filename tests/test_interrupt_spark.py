"""Ctrl-C in a real driver process: SIGINT to a script whose fit is training on local Spark. The fit raises
KeyboardInterrupt with one short message, its Spark job is cancelled (no job active, nothing in the store changes
any more), and the fits after it run in their normal time: none waits for slots a background run holds, and the
same run_id continues from the last checkpoint of the interrupted launch, never returning another launch's
model."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.spark

SCRIPT = os.path.join(os.path.dirname(__file__), "interrupted_fit.py")


@pytest.mark.parametrize("kind", ["classic", "connect"])
def test_ctrl_c_cancels_the_training_job_and_the_next_fits_run_normally(tmp_path, kind):
    if kind == "connect":
        pytest.importorskip("grpc")  # pyspark[connect]
    root = str(tmp_path / "store")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(SCRIPT)),
                                                        os.environ.get("PYTHONPATH", "")]),
           "PYTHONUNBUFFERED": "1"}
    err = open(tmp_path / "stderr.txt", "w+")
    proc = subprocess.Popen([sys.executable, SCRIPT, root, kind], stdout=subprocess.PIPE, stderr=err, text=True, env=env,
                            cwd=tmp_path)
    try:
        progress = os.path.join(root, "runs", "long", "progress.json")
        deadline = time.monotonic() + 300
        while not os.path.exists(progress):  # the first epoch trained: the ranks are in the middle of training
            assert proc.poll() is None and time.monotonic() < deadline, open(tmp_path / "stderr.txt").read()[-3000:]
            time.sleep(0.2)
        time.sleep(1.5)
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        stdout, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    err.seek(0)
    text = err.read()
    assert proc.returncode == 0, text[-4000:]
    out = json.loads(stdout.strip().splitlines()[-1])
    assert out["interrupted"] and out["raised_after_s"] > 0
    if kind == "classic":
        assert out["active_jobs"] == [] and out["jobs_active_after_s"] < 30, out
    assert out["changed"] == [], out  # no rank trains on in the background: the store is still
    interrupted = text.split("---after---")[0].split("fitting", 1)[1]
    lines = [line for line in interrupted.splitlines() if line.strip()]
    said = [line for line in lines if line.startswith("Interrupted:")]
    assert len(said) == 1 and "fit again with run_id='long'" in said[0], interrupted[-3000:]
    assert "reentrant call" not in interrupted and "Py4JError" not in interrupted, interrupted[-3000:]
    assert out["new_fit_epochs"] == 2 and out["new_fit_s"] < 60, out  # no background run holds the slots
    # one more epoch than the interrupted launch finished: trained from its checkpoint, nothing more
    assert out["resumed_epochs"] == out["done"] + 1 and out["resumed_fit_s"] < 90, out
    assert time.monotonic() - sent < 400
