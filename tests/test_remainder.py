"""The rest of an epoch interrupted under another layout (estimator.data.remainder), without Spark: real Parquet
files whose label is each row's global id, read by the real readers."""
import dataclasses
import math
from collections import Counter

import numpy as np
import pytest

from estimator.data.cached import CachedShard
from estimator.data.remainder import Remainder, left_rows
from estimator.data.repeats import without_repeats
from estimator.data.shards import open_shards
from estimator.data.streaming import StreamingShard
from test_streaming import _spec

ROWS = 1003  # row groups of 97 rows: spans cut inside row groups, shards of unequal sizes


def _reader(spec, cache):
    return dataclasses.replace(spec, reader=dataclasses.replace(spec.reader, inmemory_cache_all=cache))


def _labels(batches):
    return [int(v) for b in batches for v in b["label"]]


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("world, batch, steps, buffer", [(1, 32, 5, 100), (2, 32, 7, None), (3, 16, 20, 40),
                                                          (2, 64, 8, 1000)])
def test_the_rows_a_streaming_epoch_served_are_replayed_without_reading(store, shuffle, world, batch, steps, buffer):
    """`served` draws over row ids what `epoch` draws over rows: the same rows in the same order, for buffers
    smaller and larger than a batch and epochs cut anywhere (8 batches of 64 on 2 ranks: the whole epoch)."""
    spec = _spec(store, rows=ROWS, batch=batch, shuffle=shuffle, buffer=buffer)
    for rank in range(world):
        shard = open_shards(spec, rank, world)[0]
        assert isinstance(shard, StreamingShard)
        read = _labels(b for _, b in zip(range(steps), shard.epoch(4)))
        assert np.concatenate(list(shard.drawn(4, steps))).tolist() == read


@pytest.mark.parametrize("old_cache, new_cache", [(True, True), (False, False), (False, True), (True, False)])
@pytest.mark.parametrize("old_world, old_batch, new_world, new_batch", [(4, 16, 2, 32), (2, 32, 4, 16), (3, 16, 1, 48),
                                                                       (2, 16, 3, 16)])
def test_the_rest_of_an_epoch_on_another_layout_trains_each_row_left_once(store, old_cache, new_cache, old_world,
                                                                         old_batch, new_world, new_batch):
    """Old ranks read 5 batches (by the real reader of their layout); the new ranks' rest of the epoch (by the
    real reader of theirs) holds every other row once, plus, on a rank whose part is one row short, one row
    drawn again, marked as a repeat (left out, each row left is trained once); every new rank takes the same
    steps."""
    steps = 5
    old = _reader(_spec(store, rows=ROWS, batch=old_batch, buffer=60), old_cache)
    done = Counter()
    for rank in range(old_world):
        shard = open_shards(old, rank, old_world)[0]
        assert isinstance(shard, CachedShard if old_cache else StreamingShard)
        done.update(_labels(b for _, b in zip(range(steps), shard.epoch(2))))
    layout = [old_batch, old_world, int(old_cache), 1, 0]
    assert np.flatnonzero(left_rows(old, ROWS, 2, layout, steps) == 0).tolist() == sorted(done)  # replayed, not read
    assert set(done.values()) == {1}

    new = _reader(dataclasses.replace(old, batch_size=new_batch), new_cache)
    rest, counts, trained = Counter(), set(), Counter()
    for rank in range(new_world):
        train = open_shards(new, rank, new_world)[0]
        part = Remainder.plan(new, ROWS, 2, layout, steps, rank, new_world)
        batches = list(part.batches(new, train))
        counts.add(len(batches))
        assert len(batches) == part.steps and all(len(b["label"]) == new_batch for b in batches[:-1])
        labels = _labels(batches)
        assert len(labels) == part.draws
        assert set(labels) == set(part.rows.tolist())
        if new_cache is False and new.shuffle:
            assert labels != sorted(labels)  # streamed through the shuffle
        rest.update(set(labels))
        assert len(labels) - len(set(labels)) <= 1  # a short part draws one row again
        for b in batches:
            kept, void = without_repeats(b, drop=True)
            trained.update([] if void else _labels([kept]))
    left = ROWS - sum(done.values())
    assert counts == {math.ceil(math.ceil(left / new_world) / new_batch)}
    assert not set(rest) & set(done)
    assert sorted(set(rest) | set(done)) == list(range(ROWS)) and set(rest.values()) == {1}
    assert trained == rest  # without the repeats: each row left once


def test_the_rest_of_an_epoch_keeps_only_its_rows_of_the_row_groups(store):
    """One streaming rank continues an epoch one rank of batch 20 began (30 batches: 600 rows done): it streams
    the 403 rows left, each once (memory: tests/test_streaming.py's probe)."""
    spec = _reader(_spec(store, rows=ROWS, batch=20, buffer=50), False)
    part = Remainder.plan(spec, ROWS, 0, [20, 1, 0, 1, 0], 30, 0, 1)
    assert len(part.rows) == ROWS - 600 and part.steps == 21
    labels = _labels(part.batches(spec, open_shards(spec, 0, 1)[0]))
    assert sorted(labels) == part.rows.tolist()


@pytest.mark.parametrize("old_cache, new_cache", [(True, False), (False, True)])
def test_the_rest_of_an_epoch_of_train_steps_per_epoch_is_the_draws_its_plan_had_left(store, old_cache, new_cache):
    """train_steps_per_epoch=20 of 32 rows on 2 ranks of ~501 rows: each rank's plan draws 640 rows, some twice.
    After 6 batches the rest (read by the old ranks' real readers to the end of their plan) is what 3 new ranks
    train, each draw once, plus at most one draw again per new rank."""
    old = _reader(_spec(store, rows=ROWS, batch=32, buffer=60, steps=20), old_cache)
    rest = Counter()
    for rank in range(2):
        rest.update(_labels(list(open_shards(old, rank, 2)[0].epoch(1))[6:]))
    assert max(rest.values()) == 2  # the premise: rows drawn twice in an epoch
    layout = [32, 2, int(old_cache), 1, 20]
    assert Counter({i: int(n) for i, n in enumerate(left_rows(old, ROWS, 1, layout, 6)) if n}) == rest
    new = _reader(dataclasses.replace(old, batch_size=16, train_steps_per_epoch=None), new_cache)
    trained = Counter()
    for rank in range(3):
        part = Remainder.plan(new, ROWS, 1, layout, 6, rank, 3)
        labels = _labels(part.batches(new, open_shards(new, rank, 3)[0]))
        assert len(labels) == part.draws == math.ceil(sum(rest.values()) / 3)
        mine = Counter(part.rows.tolist())
        assert not mine - Counter(labels) and sum((Counter(labels) - mine).values()) <= 1  # one row again, if short
        trained.update(labels)
    assert not rest - trained and sum((trained - rest).values()) <= 3


def test_a_position_inside_a_balanced_window_is_not_replayed_and_one_at_its_edge_is(store):
    """Packed, shuffled batches are balanced in windows by the rows' lengths (estimator.data.balance), which the
    replay does not read: inside a window the rows done cannot be known (the epoch starts over, said), at a
    window's edge they are the drawn ones; checkpoints written before the window was recorded replay as before."""
    from estimator.data.remainder import replayable

    spec = _spec(store, rows=ROWS, batch=16)
    assert not replayable(spec, [16, 2, 1, 1, 0, 8], 5)
    assert replayable(spec, [16, 2, 1, 1, 0, 8], 8) and replayable(spec, [16, 2, 1, 1, 0, 0], 5)
    assert replayable(spec, [16, 2, 1, 1, 0], 5) and not replayable(spec, [16, 2, 1, 0, 0, 0], 8)
