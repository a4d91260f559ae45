"""One rank's objects, built whole before its epochs run (estimator.train.worker builds them; estimator.train.epochs
runs on them): nothing is set on them afterwards. torch only, no pyspark."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

from estimator.core.spec import TrainSpec, UserObjects
from estimator.train.checkpoint import Position
from estimator.train.distributed import RankContext
from estimator.train.strategies.base import Strategy


@dataclass(frozen=True)
class Schedule:
    """The learning-rate scheduler (None: none), the history key a ReduceLROnPlateau steps on (None: val_loss,
    else loss), and when it steps: 'epoch', or 'step' (after every optimizer step)."""

    scheduler: Any = None
    monitor: Optional[str] = None
    interval: str = "epoch"
    reports_lr: bool = False  # the history's rows hold 'lr' (the built-in lr_schedule)


@dataclass(frozen=True)
class Resumed:
    """What the run's checkpoint gives a launch to continue from (nothing: a new run)."""

    history: Tuple[Dict[str, float], ...] = ()
    position: Position = field(default_factory=Position)
    extra: Dict[str, Any] = field(default_factory=dict)  # train_fn's own stateful objects' states (ctx.keep)
    grad_scaler: Optional[Dict[str, Any]] = None  # 16-mixed's loss scale


@dataclass(frozen=True)
class Rank:
    """One rank's objects, built whole by estimator.train.worker: the spec, the context, the user's objects, the
    strategy, the model (`model`: the plain module; `trained`: what the loop trains through), the optimizer and its
    schedule, what a checkpoint restored, and a LightningModule's stand-in trainer."""

    spec: TrainSpec
    ctx: RankContext
    objs: UserObjects
    strategy: Strategy
    model: nn.Module
    trained: nn.Module
    optimizer: torch.optim.Optimizer
    schedule: Schedule
    resumed: Resumed
    trainer: Any = None
