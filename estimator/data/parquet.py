"""Parquet row groups in the store: listing them (footers only), a rank's row range, and reading rows.

Every rank owns a contiguous, balanced range of the global row order (ranks differ by at most one row):
the concatenation of the row groups, in the order `list_pieces` gives. A rank's range crosses row groups
in `Span`s, the units both readers work with. pyarrow only, no pyspark.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Tuple

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from estimator.core.spec import Piece
from estimator.data.arrays import Arrays, table_to_arrays
from estimator.failures import FailureKind
from store import Store

READ_BUFFER = 1 << 20  # bytes pyarrow buffers per column while it decodes a row group piece by piece


class ReadFailed(OSError):
    """Reading the training data from the store failed (a missing, unreadable or corrupt file, a lost
    connection). A later launch may succeed: the store may come back."""

    failure_kind = FailureKind.READ


@contextlib.contextmanager
def reading(path: str) -> Iterator[None]:
    try:
        yield
    except (OSError, pa.ArrowException) as exc:
        if isinstance(exc, ReadFailed):
            raise
        raise ReadFailed(f"could not read {path} from the store: {type(exc).__name__}: {exc}") from exc


@dataclass(frozen=True)
class Span:
    """Rows [lo, hi) of one row group (offsets inside the row group)."""

    piece: Piece
    lo: int
    hi: int

    @property
    def rows(self) -> int:
        return self.hi - self.lo


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
        meta = fmt.make_fragment(path, filesystem=fs).metadata
        for i in range(meta.num_row_groups):
            group = meta.row_group(i)
            pieces.append(Piece(path, i, group.num_rows, group.total_byte_size))
    return tuple(p for p in pieces if p.num_rows > 0)


def parquet_columns(store: Store, piece: Piece) -> List[str]:
    return list(parquet_schema(store, piece).names)


def parquet_schema(store: Store, piece: Piece) -> pa.Schema:
    return ds.ParquetFileFormat().make_fragment(piece.path, filesystem=arrow_filesystem(store)).physical_schema


def shard_range(total: int, rank: int, world_size: int) -> Tuple[int, int]:
    """Rows [start, stop) of `rank`: balanced, sizes differ by at most one."""
    base, extra = divmod(total, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def spans(pieces: Sequence[Piece], start: int, stop: int) -> List[Span]:
    """The parts of rows [start, stop) of the concatenation of `pieces`, one per row group they touch."""
    out, offset = [], 0
    for piece in pieces:
        lo, hi = max(start, offset), min(stop, offset + piece.num_rows)
        if lo < hi:
            out.append(Span(piece, lo - offset, hi - offset))
        offset += piece.num_rows
    return out


def estimated_bytes(parts: Sequence[Span]) -> int:
    """Uncompressed bytes of these rows, from the row groups' footers (proportional to the rows taken)."""
    return int(sum(s.piece.nbytes * s.rows / s.piece.num_rows for s in parts))


def read_rows(store: Store, pieces: Sequence[Piece], start: int, stop: int, columns: Sequence[str]) -> Arrays:
    """Rows [start, stop) of the concatenation of `pieces`, as one numpy array per column."""
    fmt, fs = ds.ParquetFileFormat(), arrow_filesystem(store)
    tables = []
    for span in spans(pieces, start, stop):
        with reading(span.piece.path):
            fragment = fmt.make_fragment(span.piece.path, filesystem=fs, row_groups=[span.piece.row_group])
            tables.append(fragment.to_table(columns=list(columns)).slice(span.lo, span.rows))
    return table_to_arrays(pa.concat_tables(tables) if tables else None, columns)


def span_windows(span: Span, chunk_rows: int) -> List[Tuple[int, int]]:
    """The [lo, hi) offsets inside the row group of the chunks `read_span` yields: the row group cut every
    `chunk_rows` rows, clipped to the span. A function of the footers alone, so the rows a streaming epoch
    served can be replayed without reading them (estimator.data.remainder)."""
    first = span.lo - span.lo % chunk_rows
    return [(max(at, span.lo), min(at + chunk_rows, span.hi)) for at in range(first, span.hi, chunk_rows)]


def read_span(store: Store, span: Span, columns: Sequence[str], chunk_rows: int) -> Iterator[Arrays]:
    """A span's rows in the chunks `span_windows` names, decoded piece by piece: memory holds about one
    chunk and a read buffer per column, however large the row group is."""
    windows = iter(span_windows(span, chunk_rows))
    window = next(windows, None)
    with reading(span.piece.path), arrow_filesystem(store).open_input_file(span.piece.path) as handle:
        # pre_buffer=False: pyarrow would otherwise fetch the whole row group's column chunks up front
        batches = pq.ParquetFile(handle, buffer_size=READ_BUFFER, pre_buffer=False).iter_batches(
            batch_size=chunk_rows, row_groups=[span.piece.row_group], columns=list(columns))
        pending: List[pa.RecordBatch] = []  # rows from window[0] on (pyarrow's batches are the windows, as a rule)
        offset = 0
        for batch in batches:
            lo, hi = max(window[0], offset), min(span.hi, offset + batch.num_rows)
            if lo < hi:
                pending.append(batch.slice(lo - offset, hi - lo))
            offset += batch.num_rows
            while window is not None and offset >= window[1]:
                rows = window[1] - window[0]
                if len(pending) == 1 and pending[0].num_rows == rows:  # the rule: no cutting
                    yield table_to_arrays(pa.Table.from_batches(pending), columns)
                    pending = []
                else:
                    table = pa.Table.from_batches(pending)
                    yield table_to_arrays(table.slice(0, rows), columns)
                    pending = table.slice(rows).to_batches()
                window = next(windows, None)
            if window is None:
                return


def read_head(store: Store, pieces: Sequence[Piece], rows: int, columns: Sequence[str]) -> Arrays:
    """The first `rows` rows (at most) of the first piece, decoding only those: reading and decoding a
    whole row group (Spark writes ~128 MB ones) to look at two rows took 0.35 s at 500k rows x 64."""
    if not pieces or rows <= 0:
        return table_to_arrays(None, columns)
    return next(read_span(store, Span(pieces[0], 0, min(rows, pieces[0].num_rows)), columns, rows))


def column_max(store: Store, pieces: Sequence[Piece], column: str) -> Optional[float]:
    """The largest value of a numeric column (see column_range)."""
    found = column_range(store, pieces, column)
    return None if found is None else found[1]


def column_range(store: Store, pieces: Sequence[Piece], column: str) -> Optional[Tuple[float, float]]:
    """The smallest and largest value of a numeric column, or of an array column's elements, from the row groups'
    footer statistics (no data read); None when a row group has no statistics for it."""
    fs, low, high = arrow_filesystem(store), None, None
    by_file: dict = {}
    for piece in pieces:
        by_file.setdefault(piece.path, []).append(piece.row_group)
    for path, groups in by_file.items():
        with fs.open_input_file(path) as handle:
            meta = pq.ParquetFile(handle).metadata
        paths = [meta.schema.column(i).path for i in range(meta.num_columns)]
        leaf = column if column in paths else f"{column}.list.element"  # an array column: its elements' leaf
        if leaf not in paths:
            return None
        index = paths.index(leaf)
        for group in groups:
            stats = meta.row_group(group).column(index).statistics
            if stats is None or not stats.has_min_max:
                return None
            low = stats.min if low is None else min(low, stats.min)
            high = stats.max if high is None else max(high, stats.max)
    return None if low is None else (float(low), float(high))
