"""What the loss of a step is divided by, so that k ranks of batch b compute the gradients one process computes
at batch k*b over the same rows. An objective says which by its `weighting` (estimator.train.objectives):

- `PerBatch`: the loss is already a mean over its batch's rows, and DistributedDataParallel (or FSDP) averages
  over the ranks. In an epoch where a rank's batches leave out rows it drew again (`uneven`:
  estimator.data.repeats) the ranks' batches may differ in rows, and a mean of their means is not the mean over
  their rows: each rank's loss is multiplied by its rows times the ranks over the rows of every rank's batch (an
  all_reduce issued before the forward). With gradient accumulation a window is one batch of its rows: each
  batch's mean weighed by its rows, the gradients divided by the window's rows on all ranks before the step.
- `PerWeight`: the loss is a sum over its batch's weight (a causal LM's labelled tokens, a classic fit's sample
  weights), which the objective tells before the forward (`weight_of`): the gradients are those of the summed
  losses over the weight of the whole window on all ranks, a mean of the ranks' means would weight a rank's
  short responses (or light rows) as much as another's long ones. With one batch a step, the batch's weight is summed over the ranks (an all_reduce issued before the
  forward, waited for on the device) and multiplies the loss; with accumulation the window's weight is known at
  its last batch only, so the gradients are multiplied once before the optimizer step.

A Void batch (a repeat forwarded for the ranks' collectives, `rows` 0) weighs nothing either way: its loss is
scaled by 0 and its weight is 0.

The loop calls the same methods either way: `begin` before a batch's forward (with the rows it stands for),
`scale` on its loss, `add` with its sums, `before_step` with what gives this rank's gradients, and `step_loss`
for the number TensorBoard shows. torch only."""
from __future__ import annotations

from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist

from estimator.train.sums import WEIGHT, Sums


class PerBatch:
    """Each batch's loss is its mean over its rows. One batch a step: as it is, and in an `uneven` epoch weighed by
    its share of the rows of every rank's batch. With accumulation, a window is one batch of all its rows: each
    batch's mean weighed by its rows, and the window's gradients divided by the rows of the window's batches on
    every rank (a short last batch, or an epoch's last window of fewer batches, counts for the rows it has, as
    one process's smaller last batch does)."""

    def __init__(self, every: int, world_size: int, sums: Sums, uneven: bool = False):
        self.every, self.world_size, self.uneven = every, world_size, uneven
        self.rows, self.counted = 1, None
        self.window, self.unit, self.device = 0, 0, None  # accumulation: this rank's rows of the window so far

    def begin(self, objective: Any, batch: Any, rows: int = 1) -> None:
        self.rows = rows
        if self.every > 1:
            self.window += rows
            self.unit = self.unit or rows  # the first batch's rows: the scale stays about what 1/every gives
            self.device = next(batch.each()).device
        elif self.uneven:  # every rank's rows summed while the forward runs (a fill on the device: no copy)
            device = next(batch.each()).device
            self.counted = WindowWeight(torch.full((), float(rows), dtype=torch.float64, device=device),
                                        self.world_size)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        if self.every > 1:  # its rows' sum, in units of the first batch's rows (before_step divides)
            return loss * (self.rows / (max(self.unit, 1) * self.every))
        if self.counted is not None:
            return loss * self.counted.share(self.rows)
        return loss * 0.0 if not self.rows else loss

    def add(self, sums: torch.Tensor) -> None:
        pass

    def before_step(self, gradients: Callable[[], List[torch.Tensor]]) -> None:
        """With accumulation: the window's gradients times ranks x unit x every over the window's rows on all
        ranks (1 for full windows of full batches), once."""
        if self.every == 1 or self.device is None:
            return
        total = torch.full((), float(self.window), dtype=torch.float64, device=self.device)
        self.window = 0
        factor = WindowWeight(total, self.world_size).share(max(self.unit, 1) * self.every)
        scale_gradients(gradients(), factor)

    def step_loss(self, loss: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
        return loss.detach()


class PerWeight:
    """Each batch's loss is a sum over its weight: the window's gradients divided by the window's weight on all
    ranks (times the ranks, which DDP and FSDP divide by when they average)."""

    def __init__(self, every: int, world_size: int, sums: Sums, uneven: bool = False):
        self.every, self.world_size, self.slot = every, world_size, sums.index(WEIGHT)
        self.counted: Optional[WindowWeight] = None
        self.window: Optional[torch.Tensor] = None  # with accumulation: this rank's weight of the window so far
        self.rows = 1

    def begin(self, objective: Any, batch: Any, rows: int = 1) -> None:
        self.rows = rows
        if self.every == 1:  # the batch's weight on all ranks summed while its forward runs
            weight = objective.weight_of(batch)
            self.counted = WindowWeight(weight if rows else torch.zeros_like(weight), self.world_size)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            loss = loss * 0.0
        return loss * self.counted.factor() if self.counted is not None else loss

    def add(self, sums: torch.Tensor) -> None:
        if self.every > 1:
            self.window = sums[self.slot] if self.window is None else self.window + sums[self.slot]

    def before_step(self, gradients: Callable[[], List[torch.Tensor]]) -> None:
        """With accumulation: the window's gradients multiplied by WindowWeight's factor, once."""
        if self.window is None:
            return
        factor = WindowWeight(self.window, self.world_size).factor()
        self.window = None
        scale_gradients(gradients(), factor)

    def step_loss(self, loss: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
        return loss.detach() / sums[self.slot].clamp_min(1)


def scale_gradients(grads: List[torch.Tensor], factor: torch.Tensor) -> None:
    """Every gradient multiplied by `factor` in place (on the device), one foreach call per dtype."""
    for dtype in {g.dtype for g in grads}:
        torch._foreach_mul_([g for g in grads if g.dtype == dtype], factor.to(dtype))


class WindowWeight:
    """ranks / the weight summed over the ranks: what summed losses (or their gradients) are multiplied by. The sum
    is an all_reduce issued now and waited for by `factor` (on the device: no wait on the host)."""

    def __init__(self, count: torch.Tensor, world_size: int):
        self.total, self.world_size = count.detach().to(torch.float64).clone(), world_size
        self.work = dist.all_reduce(self.total, op=dist.ReduceOp.SUM, async_op=True) if world_size > 1 else None

    def factor(self) -> torch.Tensor:
        """0 for a window of no weight (its summed loss is 0 too): sample weights may sum below 1."""
        return self.share(1.0)

    def share(self, weight: float) -> torch.Tensor:
        """`weight` times the ranks over the total (in float64, then float32: b * ranks / (b * ranks) is 1)."""
        if self.work is not None:
            self.work.wait()
        total = self.total
        return torch.where(total > 0, weight * self.world_size / total.where(total > 0, 1.0), 0.0).float()
