"""The draws a rank takes again so that every rank takes the same steps, marked, so that the built-in loop trains
none of them: what k ranks train is then what one process trains over the same rows, each once an epoch.

Ranks take the same number of equal batches (estimator.data.plan), so a rank whose shard is shorter than its
epoch's draws (rows not divisible by num_proc; the direct mode's smaller partitions; the rest of an interrupted
epoch dealt one row short) starts over on its shard. In an epoch of passes (`leaves_out`) a reader marks the
draws after the rank's first `real` ones with a REPEAT column in every batch of such an epoch (and in none of a
rank that draws no repeat). `without_repeats` drops them: a batch keeps its real rows, and a batch of nothing but
repeats is kept whole and void (the loop forwards it, for the ranks' collectives, scaled by 0; whole, as a
BatchNorm layer needs more than one row). A train_fn's loop keeps them (it has no way to be told a batch is void).
numpy only."""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import numpy as np

REPEAT = "__repeat__"  # the marking column: True for a draw past the rank's real ones


def leaves_out(spec) -> bool:
    """Whether a training epoch of this TrainSpec marks its repeats: an epoch of passes (no
    train_steps_per_epoch, whose draws start over by design) whose batches need not be full (with drop_last the
    batch keeps its size, the repeat trained, as DistributedSampler pads: BatchNorm, fixed shapes)."""
    return spec.train_steps_per_epoch is None and not spec.drop_last


def marked(batch: Dict[str, np.ndarray], first: int, real: Optional[int]) -> Dict[str, np.ndarray]:
    """`batch`, draws `first`.. of its rank's epoch, with REPEAT for those at or past `real` (None: no marks)."""
    if real is None:
        return batch
    rows = len(next(iter(batch.values()))) if batch else 0
    return {**batch, REPEAT: np.arange(first, first + rows) >= real}


def without_repeats(batch: Dict[str, np.ndarray], drop: bool) -> Tuple[Dict[str, np.ndarray], bool]:
    """(the batch without its REPEAT column, whether it is void); with `drop`, without the rows it marks too."""
    if REPEAT not in batch:
        return batch, False
    rest = {k: v for k, v in batch.items() if k != REPEAT}
    repeat = batch[REPEAT]
    if not drop or not repeat.any():
        return rest, False
    if repeat.all():  # forwarded, counted as none
        return rest, True
    keep = ~repeat
    return {k: v[keep] for k, v in rest.items()}, False
