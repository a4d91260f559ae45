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

from typing import Iterator, List, Optional, Sequence

import numpy as np

from estimator.data.arrays import Arrays, prepare_arrays
from estimator.data.parquet import Span, read_span
from estimator.data.plan import EpochPlan, epoch_seed, plan_epoch

CHUNK_ROWS = 1024  # rows decoded at a time from one span
PIECE_ROWS = 128  # rows the interleave takes from one span at a time: many small pieces mix in the buffer
INTERLEAVE = 16  # spans open at once while shuffling


class StreamingShard:
    def __init__(self, spec, parts: Sequence[Span], total: int, rank: int, world_size: int, training: bool,
                 buffer_rows: int, reason: str = ""):
        self.spec, self.parts, self.total = spec, list(parts), total
        self.rank, self.world_size, self.training = rank, world_size, training
        self.rows = sum(s.rows for s in self.parts)
        self.buffer_rows, self.reason = buffer_rows, reason

    def plan(self) -> EpochPlan:
        return plan_epoch(self.spec, self.total, self.rows, self.world_size, self.training)

    def epoch(self, epoch: int, skip: int = 0) -> Iterator[Arrays]:
        """The epoch's batches from batch `skip` on (a resumed epoch reads and drops the batches before it,
        so that it continues with the rows and the order an uninterrupted epoch had)."""
        plan = self.plan()
        rng = np.random.default_rng(epoch_seed(self.spec.seed, epoch, self.rank)) if self.training else None
        chunks = self._chunks(plan.items, plan.shuffle, rng)
        if plan.shuffle:
            batches = shuffled(chunks, plan.batch_size, self.buffer_rows, rng)
        else:
            batches = in_order(chunks, plan.batch_size)
        for step, batch in enumerate(batches):
            if step >= skip:
                yield prepare_arrays(self.spec.data, batch)

    def _chunks(self, items: int, shuffle: bool, rng: Optional[np.random.Generator]) -> Iterator[Arrays]:
        """Exactly `items` rows, in chunks: passes over the spans (a new order each pass) until enough."""
        left = items
        while left > 0 and self.rows > 0:
            order = rng.permutation(len(self.parts)) if shuffle else range(len(self.parts))
            streams = [self._span(self.parts[i], shuffle) for i in order]
            width = INTERLEAVE if shuffle else 1
            stagger = self.rows // len(self.parts) // min(width, len(self.parts))  # a span's rows / spans open
            for chunk in interleave(streams, width, rng, stagger):
                n = len(next(iter(chunk.values())))
                if n > left:
                    chunk, n = {k: v[:left] for k, v in chunk.items()}, left
                yield chunk
                left -= n
                if left == 0:
                    return

    def _span(self, span: Span, shuffle: bool) -> Iterator[Arrays]:
        chunks = read_span(self.spec.data.store, span, self.spec.data.columns, CHUNK_ROWS)
        return pieces(chunks, PIECE_ROWS) if shuffle else chunks

    def describe(self) -> str:
        shuffle = f", shuffle buffer {self.buffer_rows} rows" if self.training and self.spec.shuffle else ""
        return f"arrow streaming ({self.reason}{shuffle})" if self.reason else f"arrow streaming{shuffle}"

    def close(self) -> None:
        pass


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
            since += len(next(iter(chunk.values())))
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
            n = len(next(iter(chunk.values())))
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
        have += len(next(iter(chunk.values())))
        while have >= batch_size:
            merged = concat(pending)
            yield {k: v[:batch_size] for k, v in merged.items()}
            have -= batch_size
            pending = [{k: v[batch_size:] for k, v in merged.items()}] if have else []
    if have:
        yield concat(pending)


def shuffled(chunks: Iterator[Arrays], batch_size: int, buffer_rows: int, rng: np.random.Generator
             ) -> Iterator[Arrays]:
    """Batches of rows drawn at random from a buffer that the chunks keep filled to `buffer_rows` rows."""
    buffer = ShuffleBuffer(rng)
    fill = max(buffer_rows, batch_size)
    for chunk in chunks:
        buffer.add(chunk)
        while buffer.size >= fill:
            yield buffer.take(batch_size)
    while buffer.size:
        yield buffer.take(min(batch_size, buffer.size))


class ShuffleBuffer:
    """Rows held in preallocated arrays; `take(n)` removes n rows chosen uniformly at random and fills the
    holes with the last rows, so both operations cost O(rows moved), not O(buffer)."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng
        self.arrays: Arrays = {}
        self.size = 0

    def add(self, chunk: Arrays) -> None:
        n = len(next(iter(chunk.values())))
        if not self.arrays or self.size + n > len(next(iter(self.arrays.values()))):
            self._grow(chunk, self.size + n)
        for k, v in chunk.items():
            self.arrays[k][self.size:self.size + n] = v
        self.size += n

    def _grow(self, like: Arrays, needed: int) -> None:
        capacity = max(needed, 2 * (len(next(iter(self.arrays.values()))) if self.arrays else 0))
        grown = {k: np.empty((capacity,) + v.shape[1:], dtype=v.dtype) for k, v in like.items()}
        for k in self.arrays:
            grown[k][:self.size] = self.arrays[k][:self.size]
        self.arrays = grown

    def take(self, n: int) -> Arrays:
        size = self.size
        picked = self.rng.choice(size, n, replace=False, shuffle=True)
        out = {k: v[picked] for k, v in self.arrays.items()}
        tail = size - n
        holes = picked[picked < tail]
        staying = np.ones(n, dtype=bool)
        staying[picked[picked >= tail] - tail] = False
        movers = tail + np.flatnonzero(staying)
        for v in self.arrays.values():
            v[holes] = v[movers]
        self.size = tail
        return out


def concat(parts: List[Arrays]) -> Arrays:
    return parts[0] if len(parts) == 1 else {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
