"""The rest of an epoch that was interrupted under another rank count or batch size: a run checkpointed inside
an epoch at num_proc=4 continues at num_proc=2 (or back up) over exactly the rows the old ranks had not yet
trained on in that epoch, each once, dealt anew to the new ranks; the epochs after it are the new world's.

Which rows were done does not need to be stored: the in-memory reader's order is a function of (seed, epoch,
rank) and the old layout (estimator.data.cached.draw_order), so the checkpoint's position (batches done, batch
size, rank count) says which global rows the old ranks served. The rows left are dealt in balanced contiguous
slices of their global order, each rank's slice shuffled by (seed, epoch, rank); ranks whose slices are one row
shorter draw one row again so that every rank takes the same steps (the rule of every epoch). torch only."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np

from estimator.data.arrays import Arrays, prepare_arrays
from estimator.data.cached import draw_order
from estimator.data.parquet import read_rows, shard_range
from estimator.data.plan import epoch_seed, plan_steps


def done_rows(seed: int, epoch: int, total: int, batch_size: int, world_size: int, steps: int,
              shuffle: bool) -> np.ndarray:
    """The global training rows that `world_size` in-memory ranks of `batch_size` served in the first `steps`
    batches of `epoch` (sorted, each once)."""
    items = plan_steps(total, world_size, batch_size, None)[1]
    served = []
    for rank in range(world_size):
        start, stop = shard_range(total, rank, world_size)
        order = draw_order(stop - start, items, shuffle, epoch_seed(seed, epoch, rank).entropy)
        served.append(start + order[:steps * batch_size])
    return np.unique(np.concatenate(served)) if served else np.empty((0,), dtype=np.int64)


@dataclass(frozen=True)
class Remainder:
    """This rank's part of the rest of an interrupted epoch: global row ids, in the order they are trained."""

    rows: np.ndarray
    steps: int  # the same on every rank
    batch_size: int

    @staticmethod
    def plan(spec, total: int, epoch: int, old_batch: int, old_world: int, old_steps: int, rank: int,
             world_size: int) -> "Remainder":
        done = done_rows(spec.seed, epoch, total, old_batch, old_world, old_steps, spec.shuffle)
        left = np.setdiff1d(np.arange(total, dtype=np.int64), done, assume_unique=True)
        start, stop = shard_range(len(left), rank, world_size)
        longest = math.ceil(len(left) / world_size)
        mine = left[start:stop] if stop > start else left[:longest]  # fewer rows left than ranks: some twice
        order = draw_order(len(mine), longest, spec.shuffle, [*epoch_seed(spec.seed, epoch, rank).entropy, world_size])
        return Remainder(mine[order], math.ceil(longest / spec.batch_size), spec.batch_size)

    def batches(self, spec) -> Iterator[Arrays]:
        """The rows read from the store (the span of global rows that holds them), then served in batches."""
        if len(self.rows) == 0:
            return
        lo, hi = int(self.rows.min()), int(self.rows.max()) + 1
        data = spec.data
        arrays = prepare_arrays(data, read_rows(data.source, data.train, lo, hi, data.columns))
        for step in range(self.steps):
            idx = self.rows[step * self.batch_size:(step + 1) * self.batch_size] - lo
            if len(idx):
                yield {k: v[idx] for k, v in arrays.items()}


def replayable(spec, layout: list) -> bool:
    """Whether the rows done under `layout` (a checkpoint's [batch_size, ranks, in memory]) can be known: the
    in-memory arrow reader's epochs of whole passes."""
    return len(layout) == 3 and bool(layout[2]) and spec.train_steps_per_epoch is None and spec.reader.kind == "arrow"


def remainder_for(spec, total: int, epoch: int, layout: list, rank: int, world_size: int,
                  step: int) -> Optional[Remainder]:
    """The rest of `epoch` for this rank when the checkpoint's layout (batch size, rank count, in-memory
    reader) differs from this run's and the done rows can be known; None: the epoch starts over."""
    if not replayable(spec, layout):
        return None
    return Remainder.plan(spec, total, epoch, int(layout[0]), int(layout[1]), step, rank, world_size)
