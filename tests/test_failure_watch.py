"""The driver's side of a failed launch, without Spark: when it ends the ranks' tasks, and when it cancels."""
import json
import time

from estimator.launch.failure_watch import FailureWatch, stopped_by_driver


def _record(store, run, rank, kind):
    store.write_bytes_atomic(run.failure("L", rank), json.dumps({"rank": rank, "kind": kind}).encode())


def _watch(store, run, cancelled, num_proc=2):
    return FailureWatch(store, run, "L", num_proc, lambda: cancelled.append(time.monotonic()), interval=0.02,
                        grace=0.3)


def _wait_for(condition, seconds=5.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not condition():
        time.sleep(0.01)
    return condition()


def test_every_rank_failed_the_ranks_end_their_tasks_without_a_cancel(store):
    run, cancelled = store.run("r"), []
    store.makedirs(run.launch("L"))
    with _watch(store, run, cancelled):
        time.sleep(0.1)
        assert not store.exists(run.stop("L"))  # nothing failed: nothing happens
        _record(store, run, 1, "user")
        _record(store, run, 0, "peer")
        assert _wait_for(lambda: store.exists(run.stop("L")))
        time.sleep(0.5)
    assert cancelled == []
    assert stopped_by_driver(store, run.stop("L"), 1.0, interval=0.01)


def test_a_rank_that_does_not_fail_is_stopped_by_a_cancel_after_the_grace(store):
    run, cancelled = store.run("r"), []
    store.makedirs(run.launch("L"))
    with _watch(store, run, cancelled, num_proc=3):
        _record(store, run, 2, "user")
        began = time.monotonic()
        assert _wait_for(lambda: cancelled)
    assert cancelled[0] - began >= 0.3 and store.exists(run.stop("L"))


def test_peers_alone_are_waited_on_for_the_cause_then_stopped(store):
    """A peer's echo comes first (the cause is slower to write, or died without a record): not acted on at
    once, but not waited on forever."""
    run, cancelled = store.run("r"), []
    store.makedirs(run.launch("L"))
    with _watch(store, run, cancelled):
        _record(store, run, 0, "peer")
        began = time.monotonic()
        time.sleep(0.15)
        assert not store.exists(run.stop("L"))
        assert _wait_for(lambda: cancelled)
    assert cancelled[0] - began >= 0.6  # the grace for a cause, then the grace for the missing rank


def test_a_rank_without_a_stop_marker_gives_up_waiting(store):
    began = time.monotonic()
    assert not stopped_by_driver(store, store.path("nothing"), 0.2, interval=0.05)
    assert time.monotonic() - began >= 0.2
