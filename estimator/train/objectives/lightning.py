"""The objective of a fit whose model is a LightningModule: its training_step's loss and every number it logs
(estimator.train.lightning: the module run by the built-in loop, its stand-in trainer, self.log's capture).
torch only: Lightning itself is not imported here."""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from estimator.core.lightning_module import call_hook, is_lightning_module
from estimator.data.arrays import Tensors
from estimator.train.lightning import StandInTrainer, lightning_batch, logging_into, step_loss
from estimator.train.objectives.base import BuiltIn
from estimator.train.steps import StepContext
from estimator.train.sums import Sums, metric_slot, weight_slot


class LightningObjective(BuiltIn):
    """training_step's loss and every logged number, per batch, in the sums the loop reduces: the loss times the
    rows, the rows twice, then per key its value times the rows and the rows of the batches that logged it:
    training_step's keys, then validation_step's (each key's mean is over the rows of the batches that logged it)."""

    @classmethod
    def applies(cls, p: Mapping[str, Any]) -> bool:
        return is_lightning_module(p.get("model"))

    @classmethod
    def for_rank(cls, spec: Any, objs: Any, model: nn.Module, trainer: "StandInTrainer") -> "LightningObjective":
        return cls(model, spec.step_metrics, spec.val_metrics, trainer)

    def __init__(self, module: nn.Module, train_keys: Sequence[str], val_keys: Sequence[str],
                 trainer: StandInTrainer):
        self.module, self.trainer = module, trainer
        self.train_keys, self.val_keys = tuple(train_keys), tuple(val_keys)
        self.layout = Sums.of_loss(pairs=tuple(dict.fromkeys(self.train_keys + self.val_keys)))
        self.slots = {k: (self.layout.index(metric_slot(k)), self.layout.index(weight_slot(k)))
                      for k in self.train_keys + self.val_keys}

    def on_batch(self, model: Any, tensors: Tensors, ctx: StepContext) -> Tuple[torch.Tensor, torch.Tensor]:
        batch = lightning_batch(tensors)
        rows = int(batch[0].shape[0])
        self.trainer.update(ctx)
        hook = "training_step" if ctx.training else "validation_step"
        with logging_into(self.module, hook) as logged:
            if ctx.training:
                loss = step_loss(model(batch, ctx.batch_idx))  # model: DDP over LightningSteps
            else:
                call_hook(self.module, hook, batch, ctx.batch_idx)
                loss = None
        device = batch[0].device
        sums = self.layout.zeros(device)
        sums[1] = sums[2] = rows
        if loss is not None:
            sums[0] = loss.detach().double() * rows
        known = self.train_keys if ctx.training else self.val_keys
        for name, value in logged.values.items():
            if ctx.training and name == "loss":
                continue  # the history's loss is training_step's returned loss
            if name not in known:
                raise ValueError(f"{hook} logged {name!r} on rank {ctx.rank} (epoch {ctx.epoch}, batch "
                                 f"{ctx.batch_idx}), which it did not log on the driver's dry run ({list(known)}): "
                                 "log the same names in every batch (the history's keys are fixed before training).")
            total, weight = self.slots[name]
            sums[total] = value.to(device=device, dtype=torch.float64) * rows
            sums[weight] = rows
        return (loss if loss is not None else torch.zeros((), device=device)), sums

    def summarize(self, train: Mapping[str, float], val: Optional[Mapping[str, float]]) -> Dict[str, float]:
        """The loss and training_step's keys from training's sums; validation_step's keys (named as it logs them,
        no 'val_' added) from validation's."""
        means = self.layout.means_of(train)
        row = {"loss": means["loss"], **{key: means[key] for key in self.train_keys}}
        if val is not None:
            row.update((key, self.layout.means_of(val)[key]) for key in self.val_keys)
        return row
