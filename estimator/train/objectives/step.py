"""The objective of a fit with `train_step`: the user's step computes the loss and its numbers (estimator.train.steps:
the Batch and StepContext it gets, what it may return). torch only, no pyspark."""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence, Tuple

import torch

from estimator.core.spec import DataSpec
from estimator.data.arrays import Tensors
from estimator.train.objectives.base import BuiltIn
from estimator.train.steps import StepContext, as_batch, step_result
from estimator.train.sums import Sums


class StepObjective(BuiltIn):
    """The loss and the per-batch sums from the user's step, in the layout of losses.Objective (the loss times the
    rows, the rows twice, each metric times the rows), so that the loop, the reductions and the history treat both
    alike."""

    @classmethod
    def applies(cls, p: Mapping[str, Any]) -> bool:
        return p.get("train_step") is not None

    @classmethod
    def for_rank(cls, spec: Any, objs: Any, model: Any, trainer: Any) -> "StepObjective":
        return cls(objs.train_step, spec.step_metrics, spec.data)

    def __init__(self, fn: Callable[..., Any], keys: Sequence[str], data: DataSpec):
        self.fn, self.keys, self.data = fn, tuple(keys), data
        self.layout = Sums.of_loss(self.keys)

    def on_batch(self, model: Any, tensors: Tensors, ctx: StepContext) -> Tuple[torch.Tensor, torch.Tensor]:
        batch = as_batch(tensors, self.data)
        loss, metrics = step_result(self.fn(model, batch, ctx))
        if tuple(metrics) != self.keys:
            raise ValueError(f"train_step returned the numbers {['loss', *metrics]} on rank {ctx.rank} (epoch "
                             f"{ctx.epoch}, training={ctx.training}), but {['loss', *self.keys]} on the driver's "
                             "dry run: return the same keys for every batch, in training and validation.")
        rows = batch.rows
        sums = self.layout.zeros(loss.device)
        sums[0], sums[1], sums[2] = loss.detach().double() * rows, rows, rows
        for j, value in enumerate(metrics.values()):
            sums[3 + j] = torch.as_tensor(value, device=loss.device).detach().double() * rows
        return loss, sums
