"""The rest of an epoch interrupted under another layout (estimator.data.remainder), without Spark: real Parquet
files whose label is each row's global id, read by the real readers."""
import dataclasses
import math
from collections import Counter

import numpy as np
import pytest

from estimator.data.cached import CachedShard
from estimator.data.remainder import Remainder, done_rows
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
        assert np.concatenate(list(shard.served(4, steps))).tolist() == read


@pytest.mark.parametrize("old_cache, new_cache", [(True, True), (False, False), (False, True), (True, False)])
@pytest.mark.parametrize("old_world, old_batch, new_world, new_batch", [(4, 16, 2, 32), (2, 32, 4, 16), (3, 16, 1, 48),
                                                                       (2, 16, 3, 16)])
def test_the_rest_of_an_epoch_on_another_layout_trains_each_row_left_once(store, old_cache, new_cache, old_world,
                                                                         old_batch, new_world, new_batch):
    """Old ranks read 5 batches (by the real reader of their layout); the new ranks' rest of the epoch (by the
    real reader of theirs) holds every other row once, plus, on a rank whose part is one row short, one row
    drawn again; every new rank takes the same steps."""
    steps = 5
    old = _reader(_spec(store, rows=ROWS, batch=old_batch, buffer=60), old_cache)
    done = Counter()
    for rank in range(old_world):
        shard = open_shards(old, rank, old_world)[0]
        assert isinstance(shard, CachedShard if old_cache else StreamingShard)
        done.update(_labels(b for _, b in zip(range(steps), shard.epoch(2))))
    layout = [old_batch, old_world, int(old_cache), 1]
    assert np.flatnonzero(done_rows(old, ROWS, 2, layout, steps)).tolist() == sorted(done)  # replayed, not read
    assert set(done.values()) == {1}

    new = _reader(dataclasses.replace(old, batch_size=new_batch), new_cache)
    rest, counts = Counter(), set()
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
    left = ROWS - sum(done.values())
    assert counts == {math.ceil(math.ceil(left / new_world) / new_batch)}
    assert not set(rest) & set(done)
    assert sorted(set(rest) | set(done)) == list(range(ROWS)) and set(rest.values()) == {1}


def test_the_rest_of_an_epoch_keeps_only_its_rows_of_the_row_groups(store):
    """One streaming rank continues an epoch one rank of batch 20 began (30 batches: 600 rows done): it streams
    the 403 rows left, each once (memory: tests/test_streaming.py's probe)."""
    spec = _reader(_spec(store, rows=ROWS, batch=20, buffer=50), False)
    part = Remainder.plan(spec, ROWS, 0, [20, 1, 0, 1], 30, 0, 1)
    assert len(part.rows) == ROWS - 600 and part.steps == 21
    labels = _labels(part.batches(spec, open_shards(spec, 0, 1)[0]))
    assert sorted(labels) == part.rows.tolist()
