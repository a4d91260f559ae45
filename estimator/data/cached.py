"""The cached reader: a rank's whole shard in memory as numpy arrays, shuffled whole every epoch."""
from __future__ import annotations

import math
from typing import Iterator, Optional

import numpy as np

from estimator.core.spec import total_rows
from estimator.data.arrays import Arrays, prepare_arrays
from estimator.data.parquet import read_rows
from estimator.data.plan import EpochPlan, epoch_seed, plan_epoch
from estimator.data.repeats import leaves_out, marked


class ShardBatches:
    """Arrays served as epochs of equally many, equally sized batches."""

    def __init__(self, arrays: Arrays, rows: int):
        self.arrays = arrays
        self.rows = rows

    def epoch(self, batch_size: int, steps: int, items: int, shuffle: bool, seed, skip: int = 0,
              passes: bool = False) -> Iterator[Arrays]:
        """Batches `skip`..`steps` of an epoch of `items` row draws; the shard is cycled when items > rows. With
        `passes` (an epoch of passes) the draws past the first pass are marked (estimator.data.repeats)."""
        order = self._order(items, shuffle, seed)
        real = self.rows if passes and items > self.rows else None
        for step in range(skip, steps):
            idx = order[step * batch_size:(step + 1) * batch_size]
            if len(idx) == 0:
                return
            if not shuffle and idx[-1] - idx[0] == len(idx) - 1:  # contiguous: views, no copies
                batch = {k: v[idx[0]:idx[-1] + 1] for k, v in self.arrays.items()}
            else:
                batch = {k: v[idx] for k, v in self.arrays.items()}
            yield marked(batch, step * batch_size, real)

    def _order(self, items: int, shuffle: bool, seed) -> np.ndarray:
        return draw_order(self.rows, items, shuffle, seed)


def draw_order(rows: int, items: int, shuffle: bool, seed) -> np.ndarray:
    """The rows (0..rows-1) an epoch of `items` draws takes, in order: seeded permutations, one after another
    when items > rows. A function of its arguments only (estimator.data.remainder replays it)."""
    if rows == 0:
        return np.empty((0,), dtype=np.int64)
    rng = np.random.default_rng(seed)
    rounds = math.ceil(items / rows)
    parts = [rng.permutation(rows) if shuffle else np.arange(rows) for _ in range(rounds)]
    return np.concatenate(parts)[:items]


class CachedShard:
    """A rank's rows [start, stop), read once with pyarrow.dataset and kept in memory."""

    def __init__(self, spec, pieces, start: int, stop: int, rank: int, world_size: int, training: bool,
                 reason: str = "", total: Optional[int] = None):
        data = spec.data
        self.shard = ShardBatches(prepare_arrays(data, read_rows(data.source, pieces, start, stop, data.columns)),
                                  stop - start)
        self.spec, self.rank, self.world_size, self.training = spec, rank, world_size, training
        self.rows, self.reason = stop - start, reason
        self.total = total_rows(pieces) if total is None else total  # the rows the plan spreads over the ranks

    def plan(self) -> EpochPlan:
        return plan_epoch(self.spec, self.total, self.rows, self.world_size, self.training)

    def epoch(self, epoch: int, skip: int = 0) -> Iterator[Arrays]:
        plan = self.plan()
        seed = epoch_seed(self.spec.seed, epoch, self.rank).entropy if self.training else 0
        return self.shard.epoch(plan.batch_size, plan.steps, plan.items, plan.shuffle, seed, skip,
                                passes=self.training and leaves_out(self.spec))

    def describe(self) -> str:
        return f"arrow in memory ({self.reason})" if self.reason else "arrow in memory"

    def close(self) -> None:
        pass
