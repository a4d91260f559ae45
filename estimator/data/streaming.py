"""The streaming reader: a rank's rows read from the store chunk by chunk, every epoch, in bounded memory.

Shuffling without holding the shard: each epoch the rank's spans (its parts of row groups) are visited in a
seeded order, up to `INTERLEAVE` of them open at once, opened at staggered times, with each chunk drawn from a
randomly chosen open span; the rows pass through a shuffle buffer of `shuffle_buffer_size` rows that hands out
random rows. Data written in label order (one label per row group, or every file sorted by label) is therefore
mixed across row groups and positions, not served a label at a time. One row group sorted by label can only be
mixed by the buffer: write more files (partitions_per_process) for such data.
Memory: the buffer, one chunk per open span, pyarrow's read buffers - not the shard.
With shuffle=False the rows come in storage order, exactly as the cached reader gives them.
"""
from __future__ import annotations

from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np

from estimator.data.arrays import Arrays, prepare_arrays
from estimator.data.parquet import Span, read_span, span_windows
from estimator.data.plan import EpochPlan, epoch_seed, plan_epoch
from estimator.data.repeats import leaves_out, marked

CHUNK_BYTES = 1 << 20  # decoded at a time from one span: 4,096 rows of 64 floats, 32 rows of 32 KB images
CHUNK_ROWS = (32, 4096)  # ...within these bounds (more, smaller reads cost more per row; 1,024: +20%)
PIECE_ROWS = 128  # rows the interleave takes from one span at a time: many small pieces mix in the buffer
INTERLEAVE = 16  # spans open at once while shuffling
ROW_ID = "__row_id__"  # the one column of a replayed epoch: global row ids


class StreamingShard:
    """Rows `parts` of the training or validation rows, the first at global row `first`; with `keep` (sorted
    global row ids, an id twice for a row drawn twice), only those of them (the rest of an interrupted epoch,
    estimator.data.remainder)."""

    def __init__(self, spec, parts: Sequence[Span], total: int, rank: int, world_size: int, training: bool,
                 buffer_rows: int, reason: str = "", first: int = 0, keep: Optional[np.ndarray] = None):
        self.spec, self.parts, self.total = spec, list(parts), total
        self.rank, self.world_size, self.training = rank, world_size, training
        self.starts = np.cumsum([first] + [s.rows for s in self.parts])[:-1]  # each part's first global row
        self.keep = None if keep is None else kept_times(keep)
        self.rows = sum(s.rows for s in self.parts) if keep is None else len(keep)
        self.buffer_rows, self.reason = buffer_rows, reason

    def plan(self) -> EpochPlan:
        return plan_epoch(self.spec, self.total, self.rows, self.world_size, self.training)

    def epoch(self, epoch: int, skip: int = 0) -> Iterator[Arrays]:
        """The epoch's batches from batch `skip` on (a resumed epoch reads and drops the batches before it,
        so that it continues with the rows and the order an uninterrupted epoch had)."""
        plan = self.plan()
        passes = self.training and leaves_out(self.spec)
        real = self.rows if passes and plan.items > self.rows else None
        for step, batch in enumerate(self.batches(plan.items, plan.batch_size, plan.shuffle, self._rng(epoch),
                                                  real=real)):
            if step >= skip:
                yield prepare_arrays(self.spec.data, batch)

    def drawn(self, epoch: int, steps: Optional[int] = None) -> Iterator[np.ndarray]:
        """The global row ids of this rank's first `steps` batches of `epoch` (None: all), batch by batch, without
        reading a row: the same draws as `epoch`'s, over the row ids in the chunks the reads yield
        (parquet.span_windows)."""
        plan = self.plan()
        batches = self.batches(plan.items, plan.batch_size, plan.shuffle, self._rng(epoch), ids=True)
        for _, batch in zip(range(plan.steps if steps is None else steps), batches):
            yield batch[ROW_ID]

    def batches(self, items: int, batch_size: int, shuffle: bool, rng: Optional[np.random.Generator],
                ids: bool = False, real: Optional[int] = None) -> Iterator[Arrays]:
        """`items` rows in batches of `batch_size`, undecoded (with `ids`, only their global row ids); with `real`,
        the draws past the first `real` marked as repeats (estimator.data.repeats) before the shuffle buffer."""
        chunks = self._chunks(items, shuffle, rng, ids, real)
        return shuffled(chunks, batch_size, self.buffer_rows, rng) if shuffle else in_order(chunks, batch_size)

    def _rng(self, epoch: int) -> Optional[np.random.Generator]:
        return np.random.default_rng(epoch_seed(self.spec.seed, epoch, self.rank)) if self.training else None

    def _chunks(self, items: int, shuffle: bool, rng: Optional[np.random.Generator], ids: bool,
                real: Optional[int] = None) -> Iterator[Arrays]:
        """Exactly `items` rows, in chunks: passes over the spans (a new order each pass) until enough."""
        left = items
        while left > 0 and self.rows > 0:
            before = left
            order = rng.permutation(len(self.parts)) if shuffle else range(len(self.parts))
            streams = [self._span(i, shuffle, ids) for i in order]
            width = INTERLEAVE if shuffle else 1
            stagger = self.rows // len(self.parts) // min(width, len(self.parts))  # a span's rows / spans open
            for chunk in interleave(streams, width, rng, stagger):
                n = rows_in(chunk)
                if n > left:
                    chunk, n = {k: v[:left] for k, v in chunk.items()}, left
                yield marked(chunk, items - left, real)
                left -= n
                if left == 0:
                    return
            if left == before:  # `keep` named no row of the parts: nothing to pass over again
                return

    def _span(self, i: int, shuffle: bool, ids: bool) -> Iterator[Arrays]:
        span = self.parts[i]
        size = chunk_rows(span)
        windows = span_windows(span, size)
        offset = int(self.starts[i]) - span.lo  # the global id of the row group's first row
        chunks = (({ROW_ID: np.arange(lo + offset, hi + offset, dtype=np.int64)} for lo, hi in windows) if ids
                  else read_span(self.spec.data.source, span, self.spec.data.columns, size))
        if self.keep is not None:
            chunks = kept(chunks, windows, offset, self.keep)
        return pieces(chunks, PIECE_ROWS) if shuffle else chunks

    def describe(self) -> str:
        shuffle = f", shuffle buffer {self.buffer_rows} rows" if self.training and self.spec.shuffle else ""
        return f"arrow streaming ({self.reason}{shuffle})" if self.reason else f"arrow streaming{shuffle}"

    def close(self) -> None:
        pass


def kept_times(keep: np.ndarray) -> Tuple[np.ndarray, Optional[np.ndarray]]:
    """Sorted ids with repeats as (distinct ids, times each); None for the times when each comes once."""
    if len(keep) < 2 or bool((keep[1:] != keep[:-1]).all()):
        return keep, None
    return np.unique(keep, return_counts=True)


def kept(chunks: Iterator[Arrays], windows: List[Tuple[int, int]], offset: int,
         keep: Tuple[np.ndarray, Optional[np.ndarray]]) -> Iterator[Arrays]:
    """The rows of `chunks` (one per window, row group offsets + `offset` = global ids) whose ids are in `keep`
    (kept_times), each as many times; chunks left empty are dropped."""
    ids_kept, times = keep
    try:
        for chunk, (lo, hi) in zip(chunks, windows):
            ids = np.arange(lo + offset, hi + offset)
            at = np.minimum(np.searchsorted(ids_kept, ids), max(len(ids_kept) - 1, 0))
            hit = ids_kept[at] == ids if len(ids_kept) else np.zeros(len(ids), dtype=bool)
            repeat = hit if times is None else np.where(hit, times[at], 0)
            if (repeat == 1).all():
                yield chunk
            elif repeat.any():
                yield {k: np.repeat(v, repeat, axis=0) for k, v in chunk.items()}
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()


def chunk_rows(span: Span) -> int:
    """Rows per read: about CHUNK_BYTES uncompressed (the row group's footer size per row)."""
    row_bytes = span.piece.nbytes / max(span.piece.num_rows, 1)
    low, high = CHUNK_ROWS
    return int(min(high, max(low, CHUNK_BYTES // max(row_bytes, 1))))


def interleave(streams: List[Iterator[Arrays]], width: int, rng: Optional[np.random.Generator],
               stagger: int = 0) -> Iterator[Arrays]:
    """Chunks of `streams`, at most `width` open at a time (opened in list order), each chunk drawn from a
    random open one; width 1 reads the streams one after the other.

    A stream opens only once `stagger` rows have come since the previous one opened, so the open streams
    stand at spread-out positions. Opened together they would advance in lockstep, and files stored in the
    same order (each sorted by label, say) would all serve the same label at the same time.
    """
    waiting, open_ = list(reversed(streams)), []
    since = stagger
    try:
        while waiting or open_:
            if waiting and len(open_) < width and (since >= stagger or not open_):
                open_.append(waiting.pop())
                since = 0
                continue
            pick = int(rng.integers(len(open_))) if rng is not None and len(open_) > 1 else 0
            chunk = next(open_[pick], None)
            if chunk is None:
                open_.pop(pick)
                continue
            since += rows_in(chunk)
            yield chunk
    finally:
        for stream in open_ + waiting:
            close = getattr(stream, "close", None)
            if close is not None:
                close()  # closes the span's file


def pieces(chunks: Iterator[Arrays], rows: int) -> Iterator[Arrays]:
    """Each chunk as views of at most `rows` rows (no copies)."""
    try:
        for chunk in chunks:
            n = rows_in(chunk)
            for lo in range(0, n, rows):
                yield {k: v[lo:lo + rows] for k, v in chunk.items()}
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()


def in_order(chunks: Iterator[Arrays], batch_size: int) -> Iterator[Arrays]:
    """The rows as they come, cut into batches of `batch_size` (the last one may be smaller)."""
    pending: List[Arrays] = []
    have = 0
    for chunk in chunks:
        pending.append(chunk)
        have += rows_in(chunk)
        while have >= batch_size:
            merged = concat(pending)
            yield {k: v[:batch_size] for k, v in merged.items()}
            have -= batch_size
            pending = [{k: v[batch_size:] for k, v in merged.items()}] if have else []
    if have:
        yield concat(pending)


def shuffled(chunks: Iterator[Arrays], batch_size: int, buffer_rows: int, rng: np.random.Generator
             ) -> Iterator[Arrays]:
    """Batches of the rows that leave a shuffle buffer of `buffer_rows` rows: once the buffer is full, the rows
    that come in, a batch at a time, take the places of random rows in it, which leave as that batch."""
    buffer = ShuffleBuffer(max(buffer_rows, 1), rng)

    def overflow() -> Iterator[Arrays]:  # the rows that found the buffer full
        for chunk in chunks:
            at = buffer.fill(chunk)
            if at < rows_in(chunk):
                yield {k: v[at:] for k, v in chunk.items()} if at else chunk

    pending: List[Arrays] = []  # rows waiting for an exchange: whole batches go in, so whole batches come out
    have = 0
    for piece in overflow():
        pending.append(piece)
        have += rows_in(piece)
        while have >= batch_size:
            incoming, pending = split(pending, batch_size)
            have -= batch_size
            yield buffer.exchange(incoming)
    rest = buffer.exchange(pending) if have else {}  # the last, short exchange...
    drained = buffer.drain()
    rest = concat([rest, drained]) if rest else drained  # ...topped up from the buffer, emptied in random order
    for lo in range(0, rows_in(rest), batch_size):
        yield {k: v[lo:lo + batch_size] for k, v in rest.items()}


def split(parts: List[Arrays], rows: int) -> Tuple[List[Arrays], List[Arrays]]:
    """The first `rows` rows of `parts` and the rest, as views."""
    head: List[Arrays] = []
    for i, part in enumerate(parts):
        n = rows_in(part)
        if n >= rows:
            if n == rows:
                return head + [part], parts[i + 1:]
            return (head + [{k: v[:rows] for k, v in part.items()}],
                    [{k: v[rows:] for k, v in part.items()}] + parts[i + 1:])
        head.append(part)
        rows -= n
    return head, []


class ShuffleBuffer:
    """`capacity` rows in preallocated arrays. Rows first fill it; after that every row that comes in takes the
    slot of a row chosen uniformly at random, which leaves: a row stays for a geometric number of exchanges
    (capacity on average, with a long tail), so batches mix rows from far back in the stream. Each row costs one
    copy in and one gather out; the slots of a whole batch are drawn at once (drawing them per 128-row piece
    took 0.23 s of a 500k-row epoch, per batch of 512 0.06 s). Slots drawn in rounds (a permutation of all slots
    at a time) cost less but cap a row's stay at two rounds: label-sorted data trained 7 points worse."""

    def __init__(self, capacity: int, rng: np.random.Generator):
        self.capacity, self.rng = capacity, rng
        self.arrays: Arrays = {}
        self.size = 0

    def fill(self, chunk: Arrays) -> int:
        """Copies the first rows of `chunk` into free slots; returns how many (the rest are for `exchange`)."""
        if self.size == self.capacity:
            return 0
        if not self.arrays:
            self.arrays = {k: np.empty((self.capacity,) + v.shape[1:], dtype=v.dtype) for k, v in chunk.items()}
        n = min(rows_in(chunk), self.capacity - self.size)
        for k, v in chunk.items():
            self.arrays[k][self.size:self.size + n] = v[:n]
        self.size += n
        return n

    def exchange(self, incoming: List[Arrays]) -> Arrays:
        """The rows of `incoming` (the buffer is full) take random slots; returns the rows those slots held, as
        many as came in. Slots are distinct within `capacity` rows: an incoming row leaves at the earliest in
        the next round."""
        n = sum(rows_in(p) for p in incoming)
        if n > self.capacity:  # a buffer smaller than a batch: rounds of `capacity` rows
            whole = concat(incoming)
            return concat([self.exchange([{k: v[lo:lo + self.capacity] for k, v in whole.items()}])
                           for lo in range(0, n, self.capacity)])
        slots = self.rng.choice(self.capacity, n, replace=False)
        out = {}
        for k, v in self.arrays.items():
            out[k] = np.take(v, slots, axis=0, mode="clip")  # clip: no bounds checks (the slots are in range)
            at = 0
            for piece in incoming:  # straight from the pieces: no copy into a batch first
                m = len(piece[k])
                v[slots[at:at + m]] = piece[k]
                at += m
        return out

    def drain(self) -> Arrays:
        """Every row still held, in random order; the buffer is empty afterwards."""
        order = self.rng.permutation(self.size)
        out = {k: v[:self.size][order] for k, v in self.arrays.items()}
        self.size = 0
        return out


def rows_in(arrays: Arrays) -> int:
    for v in arrays.values():
        return len(v)
    return 0


def concat(parts: List[Arrays]) -> Arrays:
    return parts[0] if len(parts) == 1 else {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
