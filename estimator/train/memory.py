"""gradient_checkpointing=True: activations recomputed in backward instead of kept from forward. A Hugging Face
model through its own switch (gradient_checkpointing_enable, non-reentrant: it works with frozen inputs, as
under adapters); any other module per unit: each item of every nn.ModuleList (or each of shard_units) runs its
forward under torch.utils.checkpoint, its state_dict names unchanged. torch only, no pyspark."""
from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

import torch.utils.checkpoint
from torch import nn

from estimator.core.adapters import is_adapted
from estimator.train.sharding import unit_modules


def checkpoint_activations(model: nn.Module, units: Any = None) -> str:
    """Turns recomputation on in `model` (in place); says how ('hugging face', or 'N units')."""
    inner = model.get_base_model() if is_adapted(model) else model
    if getattr(inner, "supports_gradient_checkpointing", False) and hasattr(inner, "gradient_checkpointing_enable"):
        with warnings.catch_warnings():  # transformers 5 renames it (activation_checkpointing_enable), warning
            warnings.simplefilter("ignore", FutureWarning)
            inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if hasattr(inner, "config"):
            inner.config.use_cache = False  # a KV cache is of no use in training, and HF warns when both are on
        return "hugging face"
    chosen = unit_modules(model, units)
    if not chosen:
        raise ValueError(f"gradient_checkpointing=True recomputes activations unit by unit, and "
                         f"{type(model).__name__} has no unit: no nn.ModuleList items with parameters, and "
                         "shard_units names none. Put its blocks in an nn.ModuleList, or name them with shard_units.")
    for unit in chosen:
        unit.forward = functools.partial(_recomputed, unit.forward)  # an instance attribute: state_dict unchanged
    return f"{len(chosen)} units"


def _recomputed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)
