"""How many batches of how many rows each rank reads in an epoch: the same count on every rank."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np


@dataclass(frozen=True)
class EpochPlan:
    batch_size: int
    steps: int  # batches this epoch (the last may be smaller)
    items: int  # row draws this epoch: a rank with fewer rows than `items` starts over on its shard
    shuffle: bool


def plan_steps(total_rows: int, world_size: int, batch_size: int, steps_per_epoch: Optional[int],
               drop_last: bool = False) -> Tuple[int, int]:
    """(steps, row draws per rank) so that every rank takes the same number of equal batches; with `drop_last`
    every batch is full (the largest shard's last partial batch is not drawn)."""
    largest = math.ceil(total_rows / world_size)
    if steps_per_epoch is not None:
        return steps_per_epoch, steps_per_epoch * batch_size
    if drop_last:
        if largest < batch_size:
            raise ValueError(f"drop_last=True: each rank's shard has at most {largest} training rows, fewer than "
                             f"batch_size={batch_size}, so no batch would be full. Lower batch_size or num_proc, or "
                             "set drop_last=False.")
        steps = largest // batch_size
        return steps, steps * batch_size
    return math.ceil(largest / batch_size), largest


def optimizer_steps(total_rows: int, world_size: int, batch_size: int, steps_per_epoch: Optional[int],
                    drop_last: bool, every: int, epochs: int) -> int:
    """The run's optimizer steps (Lightning's estimated_stepping_batches, OneCycleLR's total_steps): each epoch's
    batches over `every` (backward_passes_per_step; a partial accumulation steps at the epoch's end), times
    `epochs`. The same on every rank, and on the driver (a retry on fewer ranks keeps the global batch: the same
    steps)."""
    steps, _ = plan_steps(total_rows, world_size, batch_size, steps_per_epoch, drop_last)
    return math.ceil(steps / every) * epochs


def plan_epoch(spec, total: int, rows: int, world_size: int, training: bool) -> EpochPlan:
    """Training: every rank the same steps over `total` rows; validation: each rank its own rows once."""
    if training:
        steps, items = plan_steps(total, world_size, spec.batch_size, spec.train_steps_per_epoch, spec.drop_last)
        return EpochPlan(spec.batch_size, steps, items, spec.shuffle)
    steps = math.ceil(rows / spec.val_batch_size)
    if spec.validation_steps_per_epoch is not None:
        steps = min(steps, spec.validation_steps_per_epoch)
    return EpochPlan(spec.val_batch_size, steps, min(rows, steps * spec.val_batch_size), False)


def epoch_seed(seed: int, epoch: int, rank: int) -> np.random.SeedSequence:
    """Each epoch's randomness depends only on (seed, epoch, rank): a repeated epoch repeats exactly."""
    return np.random.SeedSequence([seed, epoch, rank])
