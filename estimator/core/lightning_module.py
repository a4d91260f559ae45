"""A LightningModule as the driver, the ranks and transform's executors see it, without importing Lightning: is a
model one (either package's LightningModule in its classes), which hooks it overrides, a hook called with the
batch_idx its signature takes, and what transform calls (its forward, else its predict_step). Training it is
estimator.train.lightning's. torch only."""
from __future__ import annotations

import inspect
from typing import Any, Optional, Tuple

import torch
from torch import nn

BASES = ("lightning.pytorch.core.module", "pytorch_lightning.core.module")


def lightning_base(model: Any) -> Optional[type]:
    """The LightningModule class `model` derives from (Lightning 2.x, either package name), or None."""
    return next((c for c in type(model).__mro__ if c.__name__ == "LightningModule" and c.__module__ in BASES), None)


def is_lightning_module(model: Any) -> bool:
    return lightning_base(model) is not None


def overrides(model: Any, name: str) -> bool:
    base = lightning_base(model)
    return base is not None and getattr(type(model), name, None) is not getattr(base, name, None)


class PredictStep(nn.Module):
    """What transform runs for a LightningModule without forward(): its predict_step over the batch of feature
    columns (one column: that tensor; several: their tuple), batch_idx 0."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *features: torch.Tensor) -> Any:
        return call_hook(self.module, "predict_step", features[0] if len(features) == 1 else tuple(features), 0)


def for_inference(model: nn.Module) -> nn.Module:
    """The module transform calls: the model; a LightningModule without forward() through its predict_step; one
    with neither is refused by name (it trains all the same: a Trainer needs no forward either)."""
    if not is_lightning_module(model) or overrides(model, "forward"):
        return model
    if overrides(model, "predict_step"):
        return PredictStep(model)
    raise ValueError(f"{type(model).__name__} has no forward() and no predict_step(): TorchModel.transform calls one "
                     "of them on the feature columns. Define forward(x) (what a prediction is), or "
                     "predict_step(batch, batch_idx).")


def call_hook(module: nn.Module, name: str, batch: Tuple[torch.Tensor, ...], batch_idx: int) -> Any:
    """training_step/validation_step with batch_idx when its signature takes one (Lightning 2.x makes it optional)."""
    hook = getattr(module, name)
    inner = getattr(hook, "__wrapped__", None)  # fsdp's forward-method wrapper holds the bound method it wraps
    try:
        params = inspect.signature(inner if inspect.ismethod(inner) else hook).parameters.values()
    except (TypeError, ValueError):
        return hook(batch, batch_idx)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    takes_index = len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params)
    return hook(batch, batch_idx) if takes_index else hook(batch)
