"""The rest of an epoch that was interrupted under another rank count, batch size or reader: a run checkpointed
inside an epoch at num_proc=4 continues at num_proc=2 (or back up) over exactly the rows the old ranks had not
yet trained on in that epoch, each once, dealt anew to the new ranks; the epochs after it are the new world's.

Which rows were done does not need to be stored: both Arrow readers' orders are functions of (seed, epoch, rank),
the old layout and the Parquet footers, so the checkpoint's position (batches done, batch size, rank count,
reader) says which global rows the old ranks served. The in-memory reader's order is estimator.data.cached's
draw_order; the streaming reader's is its own draws replayed over row ids instead of rows (no row is read). The
rows left are dealt in balanced contiguous slices of their global order, each rank's slice shuffled by
(seed, epoch, rank, ranks); ranks whose slices are one row shorter draw one row again so that every rank takes
the same steps (the rule of every epoch). A streaming rank streams its slice (memory stays bounded); an
in-memory one reads it into memory. torch only."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Iterator, List, Optional

import numpy as np

from estimator.data.arrays import Arrays, prepare_arrays
from estimator.data.cached import draw_order
from estimator.data.parquet import read_rows, shard_range, spans
from estimator.data.plan import epoch_seed, plan_steps
from estimator.data.shards import Shard, streaming_train_shard
from estimator.data.streaming import StreamingShard


def done_rows(spec, total: int, epoch: int, layout: List[int], steps: int) -> np.ndarray:
    """Which of the `total` global training rows the ranks of `layout` ([batch_size, ranks, in memory, ...])
    served in the first `steps` batches of `epoch`: a mask (a byte a row; the ids come a rank or a batch at a
    time)."""
    batch_size, world_size, in_memory = (int(v) for v in layout[:3])
    done = np.zeros(total, dtype=bool)
    if in_memory:
        items = plan_steps(total, world_size, batch_size, None)[1]
        for rank in range(world_size):
            start, stop = shard_range(total, rank, world_size)
            order = draw_order(stop - start, items, spec.shuffle, epoch_seed(spec.seed, epoch, rank).entropy)
            done[start + order[:steps * batch_size]] = True
    else:
        old = dataclasses.replace(spec, batch_size=batch_size)
        for rank in range(world_size):
            for ids in streaming_train_shard(old, rank, world_size).served(epoch, steps):
                done[ids] = True
    return done


def left_slice(done: np.ndarray, start: int, stop: int, block: int = 1 << 20) -> np.ndarray:
    """The ids of the rows not done, numbers `start`..`stop` of them in id order (found a block at a time:
    memory for this slice only)."""
    out, seen = [], 0
    for lo in range(0, len(done), block):
        ids = lo + np.flatnonzero(~done[lo:lo + block])
        take = ids[max(start - seen, 0):max(stop - seen, 0)]
        if len(take):
            out.append(take)
        seen += len(ids)
        if seen >= stop:
            break
    return np.concatenate(out) if out else np.empty((0,), dtype=np.int64)


@dataclass(frozen=True)
class Remainder:
    """This rank's part of the rest of an interrupted epoch."""

    rows: np.ndarray  # its global row ids, sorted
    draws: int  # rows every rank trains on: a part one row shorter draws one again
    seed: List[int]  # of the order they are trained in
    batch_size: int

    @property
    def steps(self) -> int:  # the same on every rank
        return math.ceil(self.draws / self.batch_size)

    @staticmethod
    def plan(spec, total: int, epoch: int, layout: List[int], old_steps: int, rank: int,
             world_size: int) -> "Remainder":
        done = done_rows(spec, total, epoch, layout, old_steps)
        left = total - int(done.sum())
        start, stop = shard_range(left, rank, world_size)
        draws = math.ceil(left / world_size)
        mine = left_slice(done, start, stop) if stop > start else left_slice(done, 0, draws)  # fewer left than ranks
        return Remainder(mine, draws, [*epoch_seed(spec.seed, epoch, rank).entropy, world_size], spec.batch_size)

    def batches(self, spec, train: Shard) -> Iterator[Arrays]:
        """Streamed when `train` streams (only these rows kept from the row groups that hold them), else read
        into memory (the span of global rows that holds them)."""
        if len(self.rows) == 0:
            return
        lo, hi = int(self.rows[0]), int(self.rows[-1]) + 1
        data = spec.data
        if isinstance(train, StreamingShard):
            stream = StreamingShard(spec, spans(data.train, lo, hi), train.total, train.rank, train.world_size, True,
                                    train.buffer_rows, first=lo, keep=self.rows)
            rng = np.random.default_rng(self.seed) if spec.shuffle else None
            for batch in stream.batches(self.draws, self.batch_size, spec.shuffle, rng):
                yield prepare_arrays(data, batch)
            return
        arrays = prepare_arrays(data, read_rows(data.source, data.train, lo, hi, data.columns))
        order = self.rows[draw_order(len(self.rows), self.draws, spec.shuffle, self.seed)] - lo
        for step in range(self.steps):
            idx = order[step * self.batch_size:(step + 1) * self.batch_size]
            yield {k: v[idx] for k, v in arrays.items()}


def known_order(spec) -> bool:
    """Whether the rows an epoch of this spec served can be replayed: the Arrow readers' epochs of whole passes
    over materialized data (not petastorm's order, not epochs of train_steps_per_epoch batches, not the direct
    mode's partitions)."""
    return spec.train_steps_per_epoch is None and spec.reader.kind == "arrow" and spec.data.local is None


def replayable(spec, layout: list) -> bool:
    """Whether the rows done under `layout` (a checkpoint's [batch_size, ranks, in memory, order known]) can be
    known, and this run can train the rest."""
    return len(layout) == 4 and bool(layout[3]) and known_order(spec)


def remainder_for(spec, train: Shard, epoch: int, layout: list, rank: int, world_size: int,
                  step: int) -> Optional[Remainder]:
    """The rest of `epoch` for this rank when the checkpoint's layout (batch size, rank count, reader) differs
    from this run's and the done rows can be known; None: the epoch starts over."""
    if not replayable(spec, layout):
        return None
    return Remainder.plan(spec, train.total, epoch, layout, step, rank, world_size)
