"""How many ranks a retry runs after a lost executor took task slots with it (estimator.fit.attempts.retry_world),
without Spark: the slots are what task_slots would answer."""
import logging

import pytest

from estimator.failures import NotEnoughSlots
from estimator.fit import attempts


def world(monkeypatch, slots, num_proc, min_num_proc, per_task=1, batch_size=32, timeout=0.0):
    answers = iter(slots if isinstance(slots, list) else [slots])
    last = []

    def task_slots(spark):
        last[:] = [next(answers, last[0] if last else None)]
        return last[0]

    monkeypatch.setattr(attempts, "task_slots", task_slots)
    monkeypatch.setattr(attempts.time, "sleep", lambda seconds: None)
    return attempts.retry_world(None, "r", num_proc, min_num_proc, per_task, batch_size, timeout)


def test_all_slots_there_or_unknown_means_num_proc(monkeypatch):
    assert world(monkeypatch, 4, 4, 1) == 4 and world(monkeypatch, 8, 4, 1) == 4
    assert world(monkeypatch, None, 4, 4) == 4  # a Connect session with dynamic allocation cannot tell


def test_fewer_slots_give_the_most_ranks_that_keep_the_global_batch_whole(monkeypatch, caplog):
    with caplog.at_level(logging.WARNING, logger="estimator"):
        assert world(monkeypatch, 3, 4, 1, batch_size=32) == 2  # 128 rows a step: 3 ranks cannot split it
    assert "retrying on 2 rank(s) (min_num_proc=1) with 64 rows per rank's batch, the global batch of 128" in caplog.text
    assert world(monkeypatch, 3, 4, 1, batch_size=3) == 3  # 12 rows: 3 ranks of 4
    assert world(monkeypatch, 3, 8, 2, per_task=2) == 4  # 3 tasks of 2 ranks, but 6 does not divide 256: 2 tasks
    assert world(monkeypatch, 3, 8, 2, per_task=2, batch_size=3) == 6  # 24 rows: 6 ranks of 4, 3 tasks of 2


def test_below_min_num_proc_it_waits_for_the_slots_then_fails_clearly(monkeypatch):
    assert world(monkeypatch, [1, 1, 2], 2, 2, timeout=60) == 2  # the slots came back: num_proc again
    with pytest.raises(NotEnoughSlots, match=r"Run r cannot be retried: 1 task slot\(s\) hold 1 rank\(s\), and it "
                                             r"needs at least 2 \(min_num_proc\) of its 2; 0 s \(rendezvous_timeout\)"):
        world(monkeypatch, 1, 2, 2)
