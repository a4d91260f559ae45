import numpy as np
import pyarrow as pa
import pytest

from estimator.data.arrays import column_to_numpy, reshape
from estimator.data.cached import ShardBatches
from estimator.data.parquet import list_pieces, read_head, read_rows, shard_range
from estimator.data.plan import plan_steps
from helpers import write_parquet
from store import Store


@pytest.mark.parametrize("total, world", [(10, 3), (7, 2), (2, 2), (100, 4), (5, 1)])
def test_shards_cover_every_row_once_and_differ_by_at_most_one(total, world):
    ranges = [shard_range(total, r, world) for r in range(world)]
    assert ranges[0][0] == 0 and ranges[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    sizes = [b - a for a, b in ranges]
    assert max(sizes) - min(sizes) <= 1


def _dataset(tmp_path, rows=103, groups=(20, 33)):
    store = Store.create(str(tmp_path))
    features = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)
    labels = np.arange(rows, dtype=np.int64)
    store.makedirs(store.path("d"))
    half = rows // 2
    write_parquet(store.path("d", "a.parquet"), features[:half], labels[:half], groups[0])
    write_parquet(store.path("d", "b.parquet"), features[half:], labels[half:], groups[1])
    return store, features, labels


def test_pieces_are_row_groups_in_order(tmp_path):
    store, _, labels = _dataset(tmp_path)
    pieces = list_pieces(store, store.path("d"))
    assert [p.num_rows for p in pieces] == [20, 20, 11, 33, 19]
    assert sum(p.num_rows for p in pieces) == len(labels)


@pytest.mark.parametrize("start, stop", [(0, 103), (5, 6), (18, 45), (50, 103), (40, 40)])
def test_read_rows_is_exactly_the_global_slice(tmp_path, start, stop):
    store, features, labels = _dataset(tmp_path)
    pieces = list_pieces(store, store.path("d"))
    arrays = read_rows(store, pieces, start, stop, ["features", "label"])
    np.testing.assert_array_equal(arrays["label"], labels[start:stop])
    if stop > start:
        np.testing.assert_array_equal(arrays["features"], features[start:stop])


def test_the_head_is_the_first_rows_of_the_first_piece(tmp_path):
    store, features, labels = _dataset(tmp_path)
    pieces = list_pieces(store, store.path("d"))
    for rows in (1, 2, 20):
        head = read_head(store, pieces, rows, ["features", "label"])
        np.testing.assert_array_equal(head["label"], labels[:rows])
        np.testing.assert_array_equal(head["features"], features[:rows])
    for skipped, first in ((1, 20), (3, 51), (4, 84)):  # row groups after the first, a second file
        got = read_head(store, pieces[skipped:], 2, ["label"])["label"]
        np.testing.assert_array_equal(got, labels[first:first + 2])
    assert read_head(store, pieces, 2, ["label"])["label"].dtype == np.int64
    assert len(read_head(store, (), 2, ["label"])["label"]) == 0


def test_ranks_together_read_everything(tmp_path):
    store, _, labels = _dataset(tmp_path)
    pieces = list_pieces(store, store.path("d"))
    seen = np.concatenate([read_rows(store, pieces, *shard_range(103, r, 3), ["label"])["label"] for r in range(3)])
    np.testing.assert_array_equal(seen, labels)


def test_ragged_arrays_and_nulls_are_named():
    ragged = pa.chunked_array([pa.array([[1.0, 2.0], [3.0]])])
    with pytest.raises(ValueError, match="Column 'f' holds arrays of different lengths"):
        column_to_numpy(ragged, "f")
    with pytest.raises(ValueError, match="Column 'y' has 1 null values"):
        column_to_numpy(pa.chunked_array([pa.array([1, None])]), "y")
    fixed = pa.chunked_array([pa.FixedSizeListArray.from_arrays(pa.array([1, 2, 3, 4], pa.float32()), 2)])
    np.testing.assert_array_equal(column_to_numpy(fixed, "f"), [[1, 2], [3, 4]])


def test_list_slices_with_offsets_are_correct():
    arr = pa.array([[1, 2], [3, 4], [5, 6]]).slice(1, 2)
    np.testing.assert_array_equal(column_to_numpy(pa.chunked_array([arr]), "f"), [[3, 4], [5, 6]])


def test_arrays_of_arrays_are_blocks_of_their_shape_and_reshape_as_their_values():
    """array<array<float>> (an image's rows, `.tolist()` of an 8x8 array): (rows, 8, 8), every level checked for
    one length; a wheel trial was told its column held bytes."""
    images = np.arange(3 * 8 * 8, dtype=np.float32).reshape(3, 8, 8)
    column = pa.array(images.tolist(), pa.list_(pa.list_(pa.float32())))
    np.testing.assert_array_equal(column_to_numpy(pa.chunked_array([column]), "image"), images)
    np.testing.assert_array_equal(column_to_numpy(pa.chunked_array([column.slice(1, 2)]), "image"), images[1:])
    assert reshape(column_to_numpy(pa.chunked_array([column]), "image"), [-1, 1, 8, 8], "image").shape == (3, 1, 8, 8)
    ragged = pa.chunked_array([pa.array([[[1.0], [2.0, 3.0]]], pa.list_(pa.list_(pa.float32())))])
    with pytest.raises(ValueError, match="Column 'image' holds arrays of different lengths"):
        column_to_numpy(ragged, "image")


def test_reshape_to_input_shapes_and_clear_mismatch():
    values = np.zeros((4, 64), dtype=np.float32)
    assert reshape(values, [-1, 1, 8, 8], "f").shape == (4, 1, 8, 8)
    assert reshape(values, [1, 8, 8, -1], "f").shape == (1, 8, 8, 4)
    with pytest.raises(ValueError, match=r"Column 'f' has 64 values per row, but its shape \[-1, 1, 28, 28\] needs 784"):
        reshape(values, [-1, 1, 28, 28], "f")
    # without -1, a shape holding a row's values is per row, as in Horovod (its tests use [[2]])
    assert reshape(values, [1, 8, 8], "f").shape == (4, 1, 8, 8)
    assert reshape(values, [64], "f").shape == (4, 64)
    assert reshape(np.zeros((3, 2)), [2], "f").shape == (3, 2)
    assert reshape(values, [32, 64], "f").shape == (4, 64)  # otherwise the first dimension is the batch


def test_every_rank_gets_the_same_number_of_equal_batches():
    steps, items = plan_steps(total_rows=101, world_size=2, batch_size=10, steps_per_epoch=None)
    assert (steps, items) == (6, 51)
    sizes = []
    for rows in (51, 50):  # the two shards of 101 rows
        shard = ShardBatches({"x": np.arange(rows)}, rows)
        batches = list(shard.epoch(10, steps, items, shuffle=True, seed=1))
        sizes.append([len(b["x"]) for b in batches])
        assert len(np.unique(np.concatenate([b["x"] for b in batches]))) == rows  # every row seen
    assert sizes[0] == sizes[1] == [10, 10, 10, 10, 10, 1]


def test_fixed_steps_cycle_the_shard():
    shard = ShardBatches({"x": np.arange(5)}, 5)
    batches = list(shard.epoch(4, 3, 12, shuffle=False, seed=0))
    assert [b["x"].tolist() for b in batches] == [[0, 1, 2, 3], [4, 0, 1, 2], [3, 4, 0, 1]]


def test_shuffle_differs_per_seed_and_is_reproducible():
    shard = ShardBatches({"x": np.arange(50)}, 50)
    first = [b["x"].tolist() for b in shard.epoch(50, 1, 50, True, 1)]
    again = [b["x"].tolist() for b in shard.epoch(50, 1, 50, True, 1)]
    other = [b["x"].tolist() for b in shard.epoch(50, 1, 50, True, 2)]
    assert first == again and first != other and sorted(first[0]) == list(range(50))
