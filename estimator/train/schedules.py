"""The built-in learning-rate schedules (`lr_schedule`, `warmup_steps`, `warmup_ratio`): the learning rate of
every param group multiplied, after each optimizer step, by a factor of the steps taken, as Hugging Face's
get_{constant,linear,cosine}_schedule_with_warmup (what TRL's SFTTrainer runs) computes it: a linear warmup from
0 over the warmup steps, then constant, a linear decay to 0 at the run's last step, or a half cosine to 0. The
run's steps are counted where the ranks are (estimator.data.plan.optimizer_steps: the same on every rank and on
a retry with fewer ranks, the global batch kept). A torch LambdaLR: its step count is checkpointed and a resumed
run continues it. torch only."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

SCHEDULES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class WarmupSchedule:
    """The factor of the base learning rate after `step` optimizer steps (a picklable callable: LambdaLR keeps
    it, and a checkpoint holds its step count)."""

    kind: str
    warmup: int
    total: int

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return step / max(1, self.warmup)
        if self.kind == "constant":
            return 1.0
        progress = (step - self.warmup) / max(1, self.total - self.warmup)
        if self.kind == "linear":
            return max(0.0, 1.0 - progress)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0))))


def warmup_of(total: int, warmup_steps: Optional[int], warmup_ratio: Optional[float]) -> int:
    """The warmup's optimizer steps: `warmup_steps`, or `warmup_ratio` of the run's steps rounded up."""
    if warmup_steps is not None:
        return warmup_steps
    return math.ceil(total * warmup_ratio) if warmup_ratio else 0


def built_in_schedule(optimizer: torch.optim.Optimizer, kind: Optional[str], warmup_steps: Optional[int],
                      warmup_ratio: Optional[float], total: int) -> Optional[torch.optim.lr_scheduler.LambdaLR]:
    """The scheduler of `lr_schedule` (None: none; a warmup alone is 'constant' after it) over `optimizer`,
    stepped after every optimizer step of a run of `total` steps."""
    if kind is None and not warmup_steps and not warmup_ratio:
        return None
    return torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupSchedule(kind or "constant",
                                                                       warmup_of(total, warmup_steps, warmup_ratio),
                                                                       total))
