"""The direct mode's rank side without Spark: a stream of Arrow batches spilled to local disk in bounded memory,
split by the tag, counted for the row checks, and read back by the readers with every rank drawing as many rows
as the largest shard holds."""
import dataclasses

import numpy as np
import pyarrow as pa
import pytest
import torch

from estimator.data.shards import open_shards
from estimator.data.cached import CachedShard
from estimator.data.row_checks import BadRows, batch_counts, merged
from estimator.data.spill import ROW_GROUP_BYTES, SPLIT_COLUMN, local_data, rank_data, spill
from estimator.data.streaming import StreamingShard
from helpers import MLP, make_spec

WIDTH = 64


def _batches(n_batches, rows, val_every=5, start=0):
    """Rows numbered from `start`: features [i, i, ...], label i, every `val_every`-th row tagged validation."""
    for b in range(n_batches):
        ids = np.arange(start + b * rows, start + (b + 1) * rows)
        features = pa.FixedSizeListArray.from_arrays(pa.array(np.repeat(ids, WIDTH).astype(np.float32)), WIDTH)
        features = features.cast(pa.list_(pa.float32()))  # as Spark sends array<float>
        yield pa.RecordBatch.from_arrays([features, pa.array(ids), pa.array(ids % val_every == 0)],
                                         names=["features", "label", SPLIT_COLUMN])


def test_counts_name_rows_with_nulls_and_array_lengths():
    features = pa.array([[1.0, 2.0], None, [1.0, None], [3.0]], pa.list_(pa.float32()))
    batch = pa.RecordBatch.from_arrays([features, pa.array([1, None, 3, 4])], names=["f", "y"])
    counts = batch_counts(batch, ["f", "y"])
    assert counts == {"rows": 4, "nulls:f": 2, "min:f": 1, "max:f": 2, "nulls:y": 1}
    assert merged([counts, {"rows": 2, "nulls:f": 0, "min:f": 3, "max:f": 3, "nulls:y": 0}]) == {
        "rows": 6, "nulls:f": 2, "min:f": 1, "max:f": 3, "nulls:y": 1}


def test_a_stream_larger_than_memory_is_spilled_in_bounded_memory(tmp_path):
    pool = pa.default_memory_pool()
    batch_bytes = 10_000 * WIDTH * 4
    stream = _batches(150, 10_000)  # 1.5M rows, ~384 MB of features
    before = pool.max_memory()
    spilled = spill(stream, str(tmp_path / "rank0"), ["features", "label"])
    peak = pool.max_memory() - before
    assert spilled.counts["train_rows"] == 1_200_000 and spilled.counts["val_rows"] == 300_000
    assert spilled.counts["rows"] == 1_500_000 and spilled.counts["min:features"] == WIDTH
    # a row group per split being filled, the one being encoded, the batches in hand: not the 384 MB stream
    assert peak < 3 * ROW_GROUP_BYTES + 4 * batch_bytes, peak
    assert 150 * batch_bytes > 3 * peak


def _rank_spec(store, digits, tmp_path, rank, counts_of_ranks, spilled, **reader):
    model = MLP()
    spec = make_spec(store, digits, model, torch.optim.SGD(model.parameters(), lr=0.1), train_rows=100, val_rows=20)
    spec = dataclasses.replace(spec, batch_size=100, reader=dataclasses.replace(spec.reader, **reader))
    return dataclasses.replace(spec, data=rank_data(local_data(spec.data, spilled), counts_of_ranks))


@pytest.mark.parametrize("cache", [True, False])
def test_each_rank_draws_as_many_rows_as_the_largest_shard(store, digits, tmp_path, cache):
    small = spill(_batches(3, 1000, start=0), str(tmp_path / "r0"), ["features", "label"])  # 2,400 train rows
    large = spill(_batches(4, 1000, start=10**6), str(tmp_path / "r1"), ["features", "label"])  # 3,200
    counts = [small.counts, large.counts]
    spec = _rank_spec(store, digits, tmp_path, 0, counts, small, inmemory_cache_all=cache)
    train, val = open_shards(spec, 0, 2)
    assert isinstance(train, CachedShard if cache else StreamingShard)
    assert train.rows == 2400 and val.rows == 600
    plan = train.plan()
    assert plan.items == 3200 and plan.steps == 32  # the same steps on both ranks
    seen = np.concatenate([b["label"] for b in train.epoch(0)])
    assert len(seen) == 3200
    assert sorted(set(seen.tolist())) == [i for i in range(3000) if i % 5]  # every own train row, no val row
    counts_seen = np.bincount(seen)
    assert counts_seen.max() == 2  # the short shard starts over for the last 800 draws
    assert sorted(np.concatenate([b["label"] for b in val.epoch(0)]).tolist()) == list(range(0, 3000, 5))


def test_the_checks_run_over_every_ranks_rows(store, digits, tmp_path):
    ok = spill(_batches(1, 100), str(tmp_path / "r0"), ["features", "label"])
    nothing = spill(iter(()), str(tmp_path / "r1"), ["features", "label"])
    with pytest.raises(BadRows, match=r"rank\(s\) \[1\] received no training rows of the DataFrame \(80 training "
                                      r"rows over 2 ranks\)"):
        _rank_spec(store, digits, tmp_path, 0, [ok.counts, nothing.counts], ok)
    with pytest.raises(BadRows, match=r"Column 'features' has 3 rows with null values \(of 200 rows\)"):
        _rank_spec(store, digits, tmp_path, 0, [ok.counts, dict(ok.counts, **{"nulls:features": 3})], ok)
    with pytest.raises(BadRows, match=r"Column 'features' holds arrays of different lengths \(2 to 64"):
        _rank_spec(store, digits, tmp_path, 0, [ok.counts, dict(ok.counts, **{"min:features": 2})], ok)


def test_a_shard_read_during_the_rendezvous_is_planned_over_every_ranks_rows(store, digits, tmp_path):
    """The direct mode reads its spilled shard while Spark's barrier polls, before it knows the peers' counts;
    the plan then spreads the largest shard's rows, as if the counts had been known from the start."""
    from estimator.data.shards import EarlyRead

    small = spill(_batches(3, 1000), str(tmp_path / "r0"), ["features", "label"])
    large = spill(_batches(4, 1000, start=10**6), str(tmp_path / "r1"), ["features", "label"])
    model = MLP()
    spec = make_spec(store, digits, model, torch.optim.SGD(model.parameters(), lr=0.1), train_rows=100, val_rows=20)
    own = dataclasses.replace(spec, batch_size=100, data=local_data(spec.data, small))
    early = EarlyRead.for_spec(own, 0, 2)
    early.begin()
    early.plan_over(rank_data(own.data, [small.counts, large.counts]).largest_shard * 2)
    train, _ = early.result(0, 2)
    assert (train.plan().items, train.plan().steps) == (3200, 32)
    assert len(np.concatenate([b["label"] for b in train.epoch(0)])) == 3200
