"""The streaming reader and the feed, without Spark: real Parquet files in a local store."""
import os
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from estimator.core.spec import DataSpec, ReaderSpec, TrainSpec
from estimator.data.arrays import column_to_numpy, to_tensors
from estimator.data.cached import CachedShard
from estimator.data.feed import Decoders, Feed, decoding
from estimator.data.parquet import list_pieces, spans
from estimator.data.shards import EarlyRead, cache_decision, open_shards
from estimator.data.streaming import StreamingShard, shuffled


def _write(store, name, ids, group_rows, width=3):
    """Rows whose label is their global id and whose features are id * [1, 2, 3]."""
    features = np.outer(ids, np.arange(1, width + 1)).astype(np.float32)
    table = pa.table({"features": pa.array(list(features)), "label": pa.array(ids.astype(np.int64))})
    store.makedirs(store.path(name))
    pq.write_table(table, store.path(name, "part.parquet"), row_group_size=group_rows)


def _spec(store, *, rows=1003, group_rows=97, batch=32, seed=5, shuffle=True, cache=False, buffer=None, steps=None,
          val_rows=0):
    _write(store, "train", np.arange(rows), group_rows)
    val = ()
    if val_rows:
        _write(store, "val", np.arange(val_rows), 13)
        val = list_pieces(store, store.path("val"))
    data = DataSpec(store, list_pieces(store, store.path("train")), val, ("features",), ("label",))
    return TrainSpec(data, b"", store.run("r"), batch, 10, 1, train_steps_per_epoch=steps, shuffle=shuffle, seed=seed,
                     reader=ReaderSpec(inmemory_cache_all=cache, shuffle_buffer_size=buffer))


def _labels(shard, epoch, skip=0):
    return [b["label"].tolist() for b in shard.epoch(epoch, skip)]


def test_the_streaming_order_depends_only_on_seed_epoch_and_rank(store):
    spec = _spec(store, buffer=100)
    first = _labels(open_shards(spec, 0, 2)[0], epoch=1)
    assert first == _labels(open_shards(spec, 0, 2)[0], epoch=1)  # a new reader, the same order
    assert first != _labels(open_shards(spec, 0, 2)[0], epoch=2)
    assert first != _labels(open_shards(spec, 1, 2)[0], epoch=1)
    assert isinstance(open_shards(spec, 0, 2)[0], StreamingShard)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_row_exactly_once_per_epoch_across_ranks_with_equal_steps(store, world):
    spec = _spec(store, rows=1003, group_rows=97, batch=32, buffer=200)  # uneven row groups and shards
    seen, sizes = [], []
    for rank in range(world):
        shard = open_shards(spec, rank, world)[0]
        batches = _labels(shard, epoch=0)
        sizes.append([len(b) for b in batches])
        rows = [r for b in batches for r in b]
        assert len(rows) == shard.plan().items  # a rank with one row fewer draws one row twice
        seen.extend(sorted(set(rows)))
    assert sorted(seen) == list(range(1003))
    assert all(s == sizes[0] for s in sizes) and all(n == 32 for n in sizes[0][:-1])


def test_without_shuffle_streaming_gives_exactly_the_cached_batches(store):
    for steps in (None, 40):  # one pass; more batches than rows: the shard is cycled the same way
        spec = _spec(store, shuffle=False, steps=steps)
        for rank in (0, 1):
            streaming = open_shards(spec, rank, 2)[0]
            cached = CachedShard(spec, spec.data.train, *_range(spec, rank), rank, 2, True)
            got, want = list(streaming.epoch(0)), list(cached.epoch(0))
            assert len(got) == len(want) == cached.plan().steps
            for a, b in zip(got, want):
                np.testing.assert_array_equal(a["features"], b["features"])
                np.testing.assert_array_equal(a["label"], b["label"])
                assert a["features"].dtype == np.float32 and a["label"].dtype == np.int64


def _range(spec, rank):
    from estimator.data.parquet import shard_range

    return shard_range(spec.data.train_rows, rank, 2)


@pytest.mark.parametrize("cache", [False, True])
def test_an_epoch_resumed_at_a_batch_continues_with_the_same_batches(store, cache):
    spec = _spec(store, cache=cache, buffer=150)
    shard = open_shards(spec, 1, 2)[0]
    assert isinstance(shard, CachedShard if cache else StreamingShard)
    whole = _labels(shard, epoch=3)
    assert _labels(shard, epoch=3, skip=7) == whole[7:]


def test_label_sorted_row_groups_are_mixed_not_served_a_label_at_a_time(store):
    """10 labels, 200 rows each, written in label order in row groups of 100 rows: each batch of a
    streaming epoch holds many labels, although every row group holds one."""
    ids = np.arange(2000)
    _write(store, "train", ids, 100)
    data = DataSpec(store, list_pieces(store, store.path("train")), (), ("features",), ("label",))
    spec = TrainSpec(data, b"", store.run("r"), 64, 64, 1, seed=1, reader=ReaderSpec(inmemory_cache_all=False,
                                                                                     shuffle_buffer_size=500))
    labels_per_batch = [len(np.unique(np.array(b) // 200)) for b in _labels(open_shards(spec, 0, 1)[0], 0)]
    assert np.median(labels_per_batch) >= 6, labels_per_batch


def test_files_each_sorted_by_label_do_not_come_out_in_lockstep(store):
    """8 files, each holding labels 0-9 in label order (what a round-robin repartition of label-sorted data
    writes): opened together, the files would all serve the same label at the same time."""
    store.makedirs(store.path("train"))
    labels = np.repeat(np.arange(10), 3000)  # a label: about 3 chunks of a file
    for f in range(8):
        table = pa.table({"features": pa.array(list(np.zeros((len(labels), 2), np.float32))),
                          "label": pa.array(labels)})
        pq.write_table(table, store.path("train", f"part-{f}.parquet"))
    data = DataSpec(store, list_pieces(store, store.path("train")), (), ("features",), ("label",))
    spec = TrainSpec(data, b"", store.run("r"), 256, 256, 1, seed=1, reader=ReaderSpec(inmemory_cache_all=False,
                                                                                       shuffle_buffer_size=4000))
    batches = [np.array(b) for b in _labels(open_shards(spec, 0, 1)[0], 0)]
    labels_per_batch = [len(np.unique(b)) for b in batches]
    largest_share = [np.bincount(b).max() / len(b) for b in batches]
    # opened together (no stagger) the files give a median of 3 labels, the largest 65% of a batch
    assert np.median(labels_per_batch) >= 5 and np.median(largest_share) < 0.5, (labels_per_batch, largest_share)


@pytest.mark.parametrize("capacity, batch", [(300, 32), (1, 32), (5000, 32), (64, 100)])
def test_the_shuffle_buffer_hands_out_every_row_once(capacity, batch):
    chunks = [{"x": np.arange(s, min(s + 90, 1000)), "y": -np.arange(s, min(s + 90, 1000))} for s in range(0, 1000, 90)]
    out = list(shuffled(iter(chunks), batch, capacity, np.random.default_rng(0)))
    assert [len(b["x"]) for b in out] == [batch] * (1000 // batch) + ([1000 % batch] if 1000 % batch else [])
    taken = np.concatenate([b["x"] for b in out])
    assert sorted(taken) == list(range(1000)) and (capacity == 1 or list(taken) != sorted(taken))
    assert all((b["x"] == -b["y"]).all() for b in out)  # rows stay together


def test_a_row_stays_in_the_shuffle_buffer_for_a_geometric_number_of_exchanges():
    """Row r comes in as batch row r - capacity goes out; it stays `capacity` exchanges on average, some much
    longer (label-sorted data needs that tail)."""
    capacity, n = 300, 30_000
    chunks = [{"x": np.arange(s, s + 100)} for s in range(0, n, 100)]
    taken = np.concatenate([b["x"] for b in shuffled(iter(chunks), 64, capacity, np.random.default_rng(0))])
    position = np.argsort(taken)
    rows = np.arange(capacity, n - 20 * capacity)  # late rows may be drained at the end
    stay = position[rows] - (rows - capacity)
    assert stay.min() >= 1 and 280 < stay.mean() < 320 and stay.max() > 1500, (stay.mean(), stay.max())


MEMORY_PROBE = """
import sys, tracemalloc
import pyarrow as pa
from estimator.core.spec import DataSpec, ReaderSpec, TrainSpec
from estimator.data.cached import CachedShard
from estimator.data.parquet import list_pieces
from estimator.data.remainder import Remainder
from estimator.data.shards import open_shards
from store import Store
store, cache = Store.create(sys.argv[1]), sys.argv[2] == "cached"
data = DataSpec(store, list_pieces(store, store.path("train")), (), ("features",), ("label",))
spec = TrainSpec(data, b"", store.run("r"), 256, 256, 1, seed=1,
                 reader=ReaderSpec(inmemory_cache_all=cache, shuffle_buffer_size=2000))
tracemalloc.start()
shard = open_shards(spec, 0, 1)[0]
if sys.argv[2] == "remainder":  # the rest of an epoch 2 streaming ranks had trained 100 batches of 128 each of
    batches = Remainder.plan(spec, 400_000, 0, [128, 2, 0, 1, 0], 100, 0, 1).batches(spec, shard)
else:
    batches = shard.epoch(0)
for _ in batches:
    pass
print(type(shard).__name__, pa.default_memory_pool().max_memory() + tracemalloc.get_traced_memory()[1])
"""


def test_streaming_holds_a_bounded_amount_of_memory(store):
    """Peak memory (Arrow's pool and numpy) of a fresh process reading one epoch of 400,000 rows x 64 float32
    (102 MB) in 2 row groups: bounded by the buffer, the chunks and the read buffers when streaming (an epoch, or
    the rest of one that 2 ranks began: estimator.data.remainder), not by the shard or the row group; the cached
    reader holds the whole shard."""
    import subprocess
    import sys

    _write(store, "train", np.arange(400_000), 200_000, width=64)
    peaks = {}
    for mode in ("streaming", "cached", "remainder"):
        out = subprocess.run([sys.executable, "-c", MEMORY_PROBE, store.root, mode], capture_output=True, text=True,
                             check=True).stdout.split()
        assert out[0] == ("CachedShard" if mode == "cached" else "StreamingShard")
        peaks[mode] = int(out[1])
    shard_bytes = 400_000 * 64 * 4
    assert peaks["cached"] > shard_bytes
    assert peaks["streaming"] < shard_bytes / 4, peaks
    # the rest of an epoch adds its row ids (8 bytes a row) and the done mask (1 byte), never the rows (256 bytes)
    assert peaks["remainder"] < peaks["streaming"] + 400_000 * 24, peaks


def test_none_keeps_the_shards_in_memory_only_when_they_fit():
    assert cache_decision(None, 100, 1000, "test") == (True, "train + val shards ~0 MB fit the budget 0 MB (test)")
    keep, why = cache_decision(None, 3 * 2**30, 2**30, "spark.executor.pyspark.memory per task")
    assert not keep and "exceed the budget 1,024 MB (spark.executor.pyspark.memory per task)" in why
    assert cache_decision(False, 1, 10**9, "x")[0] is False and cache_decision(True, 10**12, 1, "x")[0] is True


def test_a_small_memory_budget_streams_and_says_why(store):
    import dataclasses

    spec = _spec(store, cache=None, val_rows=50)
    assert isinstance(open_shards(spec, 0, 2)[0], CachedShard)  # a few KB fit any host
    tight = dataclasses.replace(spec, reader=dataclasses.replace(spec.reader, memory_budget_mb=0.001))
    train, val = open_shards(tight, 0, 2)
    assert isinstance(train, StreamingShard)
    assert "exceed the budget" in train.describe() and "spark.executor.pyspark.memory" in train.describe()
    assert val is not None and "budget" not in val.describe()  # one decision, said once: not the val shard's size


def test_the_feed_keeps_a_bounded_queue_ahead_and_stops_early(store):
    spec = _spec(store)
    produced = []

    def source():
        for i in range(100):
            produced.append(i)
            yield {"features": np.zeros((2, 3), np.float32), "label": np.array([i, i])}

    feed = Feed(source(), spec.data, depth=3)
    time.sleep(0.5)  # nobody consumes: the producer stops after filling the queue
    assert 3 <= len(produced) <= 5
    first = next(feed)
    assert first[1][0].tolist() == [0, 0]
    feed.close()
    assert not any(t.name == "feed" and t.is_alive() for t in threading.enumerate())


@pytest.mark.parametrize("pool_type, method", [("thread", None), ("process", None), ("process", "spawn"),
                                               ("dummy", None)])
def test_the_feed_runs_transformation_fn_in_workers_keeps_order_and_raises_its_errors(store, pool_type, method):
    spec = _spec(store)
    factor = 2  # a closure: processes get the function through cloudpickle

    def double(frame):
        time.sleep(0.01 * np.random.rand())  # workers finish out of order
        frame["label"] = frame["label"] * factor
        return frame

    def where(frame):
        import os
        frame["label"] = os.getpid()
        return frame

    batches = [{"features": np.zeros((2, 3), np.float32), "label": np.array([i, i])} for i in range(20)]
    decoders = Decoders(double, 3, pool_type, method)
    for _ in range(2):  # a second epoch reuses the pool
        feed = Feed(iter(batches), spec.data, decoders)
        assert [t[1][0].tolist()[0] for t in feed] == [2 * i for i in range(20)]
        feed.close()
    decoders.close()
    decoders = Decoders(where, 2, pool_type, method)
    ran_in = {decoders.transform(batches[0])["label"][0] for _ in range(6)}
    assert (os.getpid() not in ran_in) == (pool_type == "process"), ran_in
    decoders.close()

    def broken(frame):
        raise KeyError("no such column")

    decoders = Decoders(broken, 2, pool_type, method)
    feed = Feed(iter(batches), spec.data, decoders)
    with pytest.raises(KeyError, match="no such column"):
        next(feed)
    feed.close()
    decoders.close()


def test_auto_decodes_in_processes_on_a_gpu_rank_and_in_threads_elsewhere():
    # (configured, pool_type, transformation_fn, tokenizer, gpu, cores) -> (workers, pool)
    assert decoding(None, "auto", True, False, True, 16) == (15, "process")  # images feeding a GPU
    assert decoding(None, "auto", True, False, True, 2) == (2, "process")
    assert decoding(None, "auto", True, False, False, 16) == (2, "thread")  # a CPU rank trains on its cores
    assert decoding(None, "auto", False, True, True, 16) == (2, "thread")  # a tokenizer: threads (no GIL held)
    assert decoding(None, "auto", False, False, True, 16) == (1, "thread")  # nothing to decode: the feeding thread
    assert decoding(4, "auto", True, False, True, 16) == (4, "process")  # the user's count
    assert decoding(None, "thread", True, False, True, 16) == (2, "thread")  # the user's pool
    assert decoding(None, "process", True, False, False, 16) == (2, "process")


def test_binary_columns_arrive_as_bytes_and_need_a_transformation(store):
    column = pa.chunked_array([pa.array([b"\x89PNG", b"ab", b""], pa.binary())])
    values = column_to_numpy(column, "image")
    assert values.dtype == object and values.shape == (3,) and values[0] == b"\x89PNG"
    data = DataSpec(store, (), (), ("image",), ("label",))
    with pytest.raises(TypeError, match="Column 'image' holds bytes .* set transformation_fn"):
        to_tensors({"image": values, "label": np.arange(3)}, data)


def test_spans_cut_a_rank_range_at_row_group_edges(store):
    spec = _spec(store, rows=300, group_rows=100)
    parts = spans(spec.data.train, 150, 260)
    assert [(s.piece.row_group, s.lo, s.hi) for s in parts] == [(1, 50, 100), (2, 0, 60)]
    assert all(p.nbytes > 0 for p in spec.data.train)


def test_an_early_read_opens_the_same_streaming_shards(store):
    spec = _spec(store, val_rows=55)
    train, val = EarlyRead(spec, 1, 2).result(1, 2)
    direct_train, direct_val = open_shards(spec, 1, 2)
    assert _labels(train, 0) == _labels(direct_train, 0) and _labels(val, 0) == _labels(direct_val, 0)
    assert sorted(r for b in _labels(val, 0) for r in b) == list(range(28, 55))  # validation: its rows, once


@pytest.mark.parametrize("cache", [True, False])
def test_drop_last_gives_full_batches_on_every_rank_every_epoch(store, cache):
    """1003 rows over 2 ranks in batches of 32: 16 batches of 32 each (the 502nd row's partial batch is not
    drawn), on the rank of 502 rows and the rank of 501 alike; other rows are left out each epoch."""
    import dataclasses

    spec = dataclasses.replace(_spec(store, cache=cache), drop_last=True)
    seen = []
    for rank in (0, 1):
        shard, _ = open_shards(spec, rank, 2)
        for epoch in (0, 1):
            sizes = [len(b["label"]) for b in shard.epoch(epoch)]
            assert sizes == [32] * 15, (rank, epoch, sizes)  # ceil(1003 / 2) = 502 rows: 15 full batches
            seen.append(set(np.concatenate(_labels(shard, epoch)).tolist()))
    assert seen[0] != seen[1]  # shuffled: other rows left out in epoch 2
    plain = open_shards(dataclasses.replace(spec, drop_last=False), 0, 2)[0]
    assert [len(b["label"]) for b in plain.epoch(0)][-1] == 502 - 15 * 32  # without: a last batch of 22
    with pytest.raises(ValueError, match=r"drop_last=True: each rank's shard has at most 502 training rows, fewer "
                                         r"than batch_size=600"):
        open_shards(dataclasses.replace(spec, batch_size=600), 0, 2)[0].plan()
