"""Shard readers: Parquet row groups -> numpy arrays -> batches. pyarrow only, no pyspark.

Every rank owns a contiguous, balanced range of the global row order (ranks differ by at most one
row), reads only the row groups that overlap it, and keeps its shard in memory as numpy arrays.
Each epoch yields the same number of equally sized batches on every rank, so DistributedDataParallel
never waits on a rank that ran out of data.
"""
from __future__ import annotations

import math
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from estimator.spec import Piece
from store import Store

Arrays = Dict[str, np.ndarray]


def arrow_filesystem(store: Store) -> pafs.FileSystem:
    if store.is_local:
        return pafs.LocalFileSystem()
    return pafs.PyFileSystem(pafs.FSSpecHandler(store.fs))


def list_pieces(store: Store, directory: str) -> Tuple[Piece, ...]:
    """The row groups of every Parquet file under `directory`, in a stable order (footers only)."""
    return pieces_of_files(store, list(store.find(directory, suffix=".parquet")))


def pieces_of_files(store: Store, paths: Sequence[str]) -> Tuple[Piece, ...]:
    """The non-empty row groups of the given Parquet files, in the given order (footers only)."""
    fmt = ds.ParquetFileFormat()
    fs = arrow_filesystem(store)
    pieces = []
    for path in paths:
        fragment = fmt.make_fragment(path, filesystem=fs)
        pieces.extend(Piece(path, i, n) for i, n in _row_groups(fragment))
    return tuple(p for p in pieces if p.num_rows > 0)


def parquet_columns(store: Store, piece: Piece) -> List[str]:
    fragment = ds.ParquetFileFormat().make_fragment(piece.path, filesystem=arrow_filesystem(store))
    return list(fragment.physical_schema.names)


def _row_groups(fragment: ds.ParquetFileFragment) -> List[Tuple[int, int]]:
    meta = fragment.metadata
    return [(i, meta.row_group(i).num_rows) for i in range(meta.num_row_groups)]


def shard_range(total: int, rank: int, world_size: int) -> Tuple[int, int]:
    """Rows [start, stop) of `rank`: balanced, sizes differ by at most one."""
    base, extra = divmod(total, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def read_rows(store: Store, pieces: Sequence[Piece], start: int, stop: int,
              columns: Sequence[str]) -> Arrays:
    """Rows [start, stop) of the concatenation of `pieces`, as one numpy array per column."""
    fmt, fs = ds.ParquetFileFormat(), arrow_filesystem(store)
    tables, offset = [], 0
    for piece in pieces:
        lo, hi = max(start, offset), min(stop, offset + piece.num_rows)
        if lo < hi:
            fragment = fmt.make_fragment(piece.path, filesystem=fs, row_groups=[piece.row_group])
            table = fragment.to_table(columns=list(columns))
            tables.append(table.slice(lo - offset, hi - lo))
        offset += piece.num_rows
    if not tables:
        return {c: np.empty((0,)) for c in columns}
    table = pa.concat_tables(tables)
    return {c: column_to_numpy(table.column(c), c) for c in columns}


def read_head(store: Store, pieces: Sequence[Piece], rows: int, columns: Sequence[str]) -> Arrays:
    """The first `rows` rows (at most) of the first piece, decoding only those: reading and decoding a
    whole row group (Spark writes ~128 MB ones) to look at two rows took 0.35 s at 500k rows x 64."""
    if not pieces or rows <= 0:
        return read_rows(store, pieces, 0, 0, columns)
    piece = pieces[0]
    with arrow_filesystem(store).open_input_file(piece.path) as handle:
        batches = pq.ParquetFile(handle).iter_batches(batch_size=rows, row_groups=[piece.row_group],
                                                      columns=list(columns))
        table = pa.Table.from_batches([next(batches)])
    return {c: column_to_numpy(table.column(c), c) for c in columns}


def column_to_numpy(column: pa.ChunkedArray, name: str) -> np.ndarray:
    """A numeric column as (rows,) or (rows, width): lists must all have the same length."""
    if column.null_count:
        raise ValueError(f"Column {name!r} has {column.null_count} null values; drop or fill them first.")
    arr = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    if pa.types.is_fixed_size_list(arr.type):
        return arr.flatten().to_numpy(zero_copy_only=False).reshape(len(arr), arr.type.list_size)
    if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
        offsets = arr.offsets.to_numpy()
        lengths = np.diff(offsets)
        if len(lengths) and not (lengths == lengths[0]).all():
            raise ValueError(f"Column {name!r} holds arrays of different lengths "
                             f"(from {lengths.min()} to {lengths.max()}); every row must have the same length.")
        values = arr.values
        if values.null_count:
            raise ValueError(f"Column {name!r} has {values.null_count} null elements inside its arrays.")
        width = int(lengths[0]) if len(lengths) else 0
        flat = values.to_numpy(zero_copy_only=False)[offsets[0]:offsets[0] + len(arr) * width]
        return flat.reshape(len(arr), width)
    return arr.to_numpy(zero_copy_only=False)


def torch_dtype_array(values: np.ndarray) -> np.ndarray:
    """float64 -> float32 (models are float32), bools -> float32, ints -> int64."""
    if values.dtype == np.float64 or values.dtype == np.bool_:
        return values.astype(np.float32)
    if np.issubdtype(values.dtype, np.integer) and values.dtype != np.int64:
        return values.astype(np.int64)
    return values


def reshape(values: np.ndarray, shape: Optional[Sequence[int]], name: str) -> np.ndarray:
    """Reshape a (rows, ...) block to `shape` ([-1, 1, 28, 28]: -1 is the batch)."""
    if shape is None:
        return values
    rows = values.shape[0]
    per_row = int(np.prod(values.shape[1:])) if values.ndim > 1 else 1
    target = [d for d in shape]
    if -1 in target:
        target[target.index(-1)] = rows
        wanted = int(np.prod([d for d in shape if d != -1]))
    else:
        wanted = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        target[0] = rows
    if wanted != per_row:
        raise ValueError(f"Column {name!r} has {per_row} values per row, but its shape {list(shape)} "
                         f"needs {wanted}; fix input_shapes/label_shapes or the column.")
    return values.reshape(target)


class ShardBatches:
    """One rank's shard in memory, served as epochs of equally many, equally sized batches."""

    def __init__(self, arrays: Arrays, rows: int):
        self.arrays = arrays
        self.rows = rows

    def epoch(self, batch_size: int, steps: int, items: int, shuffle: bool,
              seed: int) -> Iterator[Arrays]:
        """`steps` batches covering `items` row draws; the shard is cycled when items > rows."""
        order = self._order(items, shuffle, seed)
        for step in range(steps):
            idx = order[step * batch_size:(step + 1) * batch_size]
            if len(idx) == 0:
                return
            if idx[-1] - idx[0] == len(idx) - 1 and not shuffle:  # contiguous: views, no copies
                yield {k: v[idx[0]:idx[-1] + 1] for k, v in self.arrays.items()}
            else:
                yield {k: v[idx] for k, v in self.arrays.items()}

    def _order(self, items: int, shuffle: bool, seed: int) -> np.ndarray:
        if self.rows == 0:
            return np.empty((0,), dtype=np.int64)
        rng = np.random.default_rng(seed)
        rounds = math.ceil(items / self.rows)
        parts = [rng.permutation(self.rows) if shuffle else np.arange(self.rows) for _ in range(rounds)]
        return np.concatenate(parts)[:items]


def plan_steps(total_rows: int, world_size: int, batch_size: int,
               steps_per_epoch: Optional[int]) -> Tuple[int, int]:
    """(steps, row draws per rank) so that every rank takes the same number of equal batches."""
    largest = math.ceil(total_rows / world_size)
    if steps_per_epoch is not None:
        return steps_per_epoch, steps_per_epoch * batch_size
    return math.ceil(largest / batch_size), largest
