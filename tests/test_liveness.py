"""A launch's heartbeat and its watch (estimator.launch.liveness), on a real store, with short intervals (no Spark)."""
import threading
import time

import pytest

from estimator.failures import RunInUse
from estimator.launch.liveness import LaunchWatch, read_beat, wait_for_other_launch


def _launch(store, run, launch_id):
    store.write_bytes_atomic(run.launch_spec(launch_id), b"spec")


def test_a_task_ends_its_process_once_the_driver_removed_the_launch(store):
    run, ended = store.run("r"), []
    _launch(store, run, "a")
    with LaunchWatch(store, run, "a", beats=True, interval=0.05, end=ended.append):
        time.sleep(0.3)
        first = read_beat(store, run)
        assert first["launch"] == "a" and first["beat"] >= 3 and ended == []  # beating, not ended
        store.rm(run.launch("a"))  # the driver stopped waiting (interrupted, failed)
        deadline = time.monotonic() + 5
        while not ended and time.monotonic() < deadline:
            time.sleep(0.02)
    assert ended == [1] and read_beat(store, run) is None  # ended, and its beat removed


def test_a_beating_launch_is_waited_for_then_refused_by_name(store):
    run, said = store.run("r"), []
    _launch(store, run, "a")
    with LaunchWatch(store, run, "a", beats=True, interval=0.05, end=lambda code: None):
        started = time.monotonic()
        with pytest.raises(RunInUse, match=r"Run 'r' is still being trained by another launch \(launch a, rank 0 "
                                           r"on host .*\) after 1 s.*cancel its Spark job \(tagged "
                                           r"'TorchEstimator.fit r a'\), or fit under another run_id"):
            wait_for_other_launch(store, run, "r", 1.0, said.append, interval=0.05)
        assert time.monotonic() - started >= 1.0
    assert len(said) == 1 and "waiting up to 1 s" in said[0]


def test_the_wait_ends_when_the_launch_ends_or_stops_beating(store):
    run = store.run("r")
    wait_for_other_launch(store, run, "r", 10.0, pytest.fail)  # no launch: no wait, nothing said
    _launch(store, run, "a")
    watch = LaunchWatch(store, run, "a", beats=True, interval=0.05, end=lambda code: None).__enter__()
    threading.Timer(0.3, watch.__exit__).start()  # the launch ends and removes its beat
    started = time.monotonic()
    wait_for_other_launch(store, run, "r", 10.0, lambda line: None, interval=0.05)
    assert 0.2 < time.monotonic() - started < 5
    # a launch killed without removing its beat: a file that stops changing is stale, and removed
    store.write_bytes_atomic(run.alive, b'{"launch": "dead", "beat": 7}')
    wait_for_other_launch(store, run, "r", 10.0, lambda line: None, interval=0.05)
    assert read_beat(store, run) is None
