"""gradient_checkpointing: activations recomputed in backward instead of kept from forward. True: every
activation of a unit recomputed; 'selective': the outputs of the unit's wide matrix products and its attention
kept, the rest recomputed (the norms, the activation functions, rotary embeddings, casts, and the adapters'
low-rank products), torch's selective activation checkpointing. A Hugging Face model through its own switch
(gradient_checkpointing_enable, non-reentrant: it works with frozen inputs, as under adapters); any other module
per unit: each item of every nn.ModuleList (or each of shard_units) runs its forward under
torch.utils.checkpoint, its state_dict names unchanged. Either way the recomputation gives the same numbers as
the forward did. torch only, no pyspark."""
from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any, Callable, Dict, Optional, Tuple

import torch.utils.checkpoint
from torch import nn

from estimator.core.adapters import base_model
from estimator.train.sharding import unit_modules

SELECTIVE = "selective"  # the gradient_checkpointing value that keeps the matrix products' outputs
NARROW = 8  # a product whose one side is at most 1/NARROW of the other is recomputed (an adapter's rank)
MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def checkpoint_activations(model: nn.Module, units: Any = None, mode: Any = True) -> str:
    """Turns recomputation on in `model` (in place), all of it (`mode` True) or selective ('selective'); says how
    ('hugging face', or 'N units')."""
    options: Dict[str, Any] = {"use_reentrant": False}
    if mode == SELECTIVE:
        options["context_fn"] = selective_contexts
    inner = base_model(model)
    if getattr(inner, "supports_gradient_checkpointing", False) and hasattr(inner, "gradient_checkpointing_enable"):
        with warnings.catch_warnings():  # transformers 5 renames it (activation_checkpointing_enable), warning
            warnings.simplefilter("ignore", FutureWarning)
            inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
        if hasattr(inner, "config"):
            inner.config.use_cache = False  # a KV cache is of no use in training, and HF warns when both are on
        return "hugging face" + (", selective" if mode == SELECTIVE else "")
    refusal = no_units(model, units, mode)
    if refusal:
        raise ValueError(refusal)
    chosen = unit_modules(model, units)
    for unit in chosen:  # an instance attribute: state_dict unchanged
        unit.forward = functools.partial(_recomputed, unit.forward, options)
    return f"{len(chosen)} units" + (", selective" if mode == SELECTIVE else "")


def no_units(model: nn.Module, units: Any, mode: Any) -> Optional[str]:
    """Why gradient_checkpointing=`mode` cannot recompute `model`, or None: a Hugging Face model recomputes its
    own way; another needs units (the items of its nn.ModuleLists, or shard_units). Checked on the driver's model
    before any job (estimator.fit.checks), and where the rank turns it on."""
    inner = base_model(model)
    if getattr(inner, "supports_gradient_checkpointing", False) and hasattr(inner, "gradient_checkpointing_enable"):
        return None
    if unit_modules(model, units):
        return None
    return (f"gradient_checkpointing={mode!r} recomputes activations unit by unit, and {type(model).__name__} has "
            "no unit: no nn.ModuleList items with parameters, and shard_units names none. Put its blocks in an "
            "nn.ModuleList, or name them with shard_units.")


def _recomputed(forward: Callable[..., Any], options: Dict[str, Any], *args: Any, **kwargs: Any) -> Any:
    return torch.utils.checkpoint.checkpoint(forward, *args, **options, **kwargs)


def selective_contexts() -> Tuple[Any, Any]:
    """The contexts of one checkpointed forward and its recomputation: `kept`'s policy, and autocast's cache of
    cast weights off in both. The recomputation must call every op as many times as the forward did, and a forward
    run after another in the same autocast region (packing's check on the first batch, DPO's two answers) finds
    its weights' casts cached where the recomputation, in backward, casts them again. Off, each use casts: the
    same numbers, and no more casts in a unit that uses each weight once."""
    forward, recompute = torch.utils.checkpoint.create_selective_checkpoint_contexts(kept)
    if torch.compiler.is_compiling():  # compiled, the graph recomputes as traced (and compile asks for the modes)
        return forward, recompute
    return _Together(forward, _NoCastCache()), _Together(recompute, _NoCastCache())


class _NoCastCache:
    """Autocast's cache of cast weights off inside (set back after)."""

    def __enter__(self) -> None:
        self.was = torch.is_autocast_cache_enabled()
        torch.set_autocast_cache_enabled(False)

    def __exit__(self, *exc: Any) -> None:
        torch.set_autocast_cache_enabled(self.was)


class _Together:
    """Contexts entered in order, left in reverse."""

    def __init__(self, *contexts: Any):
        self.contexts, self.stack = contexts, contextlib.ExitStack()

    def __enter__(self) -> None:
        for context in self.contexts:
            self.stack.enter_context(context)

    def __exit__(self, *exc: Any) -> Any:
        return self.stack.__exit__(*exc)


def kept(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """What a unit keeps from its forward for backward (torch's CheckpointPolicy): the outputs of attention and of
    the matrix products whose sides are both wide (the projections of the layer), which cost most to recompute;
    everything else is recomputed from them: elementwise ops, reductions and casts read and write memory only,
    and a product with a narrow side (an adapter's rank: LoRA's x @ A and (x A) @ B) costs little. For a Llama
    layer of 1B's shape with LoRA on every projection, 54 KiB a token kept in bf16 against 115 KiB."""
    from torch.utils.checkpoint import CheckpointPolicy

    name = op.name() if hasattr(op, "name") else str(op)
    if name in MATMULS:
        first, second = (args[1], args[2]) if name in ("aten::addmm", "aten::baddbmm") else (args[0], args[1])
        inner, width = int(first.shape[-1]), int(second.shape[-1])
        wide = min(inner, width) * NARROW > max(inner, width)
        return CheckpointPolicy.MUST_SAVE if wide else CheckpointPolicy.PREFER_RECOMPUTE
    if "attention" in name or "attn" in name:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE
