"""Adapters (peft): the `peft_config` param. The adapters are added where a model is built (the driver's copy, each
rank's, a loaded TorchModel's), and one rule says what trains: the parameters that require gradients. That rule
decides what the optimizer sees, what the gradient averaging carries (frozen parameters have no gradients), what
a checkpoint holds and what a resume loads (`trainable_state`): a LoRA checkpoint is the adapters and their
optimizer state, not the frozen base. torch only (peft imported when a config is given), no pyspark."""
from __future__ import annotations

import contextlib
import copy
import sys
import warnings
from typing import Any, Dict, Iterator, List, Optional

import torch
from torch import nn

PEFT_HINT = "pip install peft (or the [hf] extra: pip install 'spark-torch-estimator[hf]')"


def check_peft_config(config: Any, owner: str = "TorchEstimator") -> None:
    """peft is importable and `config` is one of its configs; else a clear error before any job."""
    if config is None:
        return
    try:
        from peft import PeftConfig
    except ImportError:
        raise ImportError(f"The 'peft_config' parameter of {owner} needs the peft package, which is not installed "
                          f"here: {PEFT_HINT}.") from None
    if not isinstance(config, PeftConfig):
        raise TypeError(f"The 'peft_config' parameter of {owner} must be a peft config (LoraConfig(r=16, "
                        f"lora_alpha=32, target_modules='all-linear', task_type='CAUSAL_LM')). Got "
                        f"{type(config).__name__} instead.")


def with_adapters(model: nn.Module, config: Any) -> nn.Module:
    """`model` with the adapters `config` describes (peft.get_peft_model: the base frozen, the adapters
    trainable); `model` itself when config is None. The config is copied: peft fills it in (base model name...)."""
    if config is None or is_adapted(model):
        return model
    from peft import get_peft_model

    with peft_reading_old_names():
        return get_peft_model(model, copy.deepcopy(config))


@contextlib.contextmanager
def peft_reading_old_names() -> Iterator[None]:
    """peft (0.21) reads transformers' deprecated `is_gradient_checkpointing` when it wraps a model, and
    transformers 5 warns of it (a FutureWarning in every fit's log, with or without gradient_checkpointing):
    that one warning left out, inside."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def is_adapted(model: Any) -> bool:
    """Whether `model` is peft's model around a base. It can only be one where peft is imported already: asked of
    every model (checkpoints, pickling, transform), this never imports peft (which imports transformers, and
    bitsandbytes where installed: seconds, and their warnings in a classic fit's logs)."""
    peft = sys.modules.get("peft")
    model_class = getattr(peft, "PeftModel", None)
    return model_class is not None and isinstance(model, model_class)


def trainable_parameters(model: nn.Module) -> List[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def trainable_names(model: nn.Module) -> List[str]:
    return [name for name, p in model.named_parameters() if p.requires_grad]


def trainable_state(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The state_dict entries of the parameters that train (an adapted model's adapters)."""
    names = set(trainable_names(model))
    return {k: v for k, v in model.state_dict().items() if k in names}


def load_trainable(model: nn.Module, state: Dict[str, torch.Tensor], where: str = "the checkpoint") -> None:
    """A `trainable_state` loaded back: every trainable parameter must be in it and nothing else (a checkpoint of
    other adapters, or of another model, is refused by name rather than half loaded)."""
    check_trainable(model, state, where)
    model.load_state_dict(state, strict=False)


def check_trainable(model: nn.Module, state: Dict[str, Any], where: str) -> None:
    """`state` names every trainable parameter of `model` and nothing else; else an error naming them."""
    names = set(trainable_names(model))
    missing, unexpected = sorted(names - set(state)), sorted(set(state) - names)
    if missing or unexpected:
        raise ValueError(f"{where} holds the trainable parameters of another model: "
                         + (f"{len(missing)} of this model's are not in it ({', '.join(missing[:3])}...) "
                            if missing else "")
                         + (f"{len(unexpected)} in it are not this model's ({', '.join(unexpected[:3])}...)"
                            if unexpected else "")
                         + ". Resume with the same model and peft_config, or under a new run_id.")


def merged(model: nn.Module) -> nn.Module:
    """A copy of an adapted model with its adapters merged into the base weights (peft's merge_and_unload): a
    plain transformers model, for serving with from_pretrained."""
    return copy.deepcopy(model).merge_and_unload() if is_adapted(model) else model


def base_model(model: Any) -> Any:
    """The model under peft's adapters (an adapted model's base), or the model itself."""
    return model.get_base_model() if is_adapted(model) else model


def can_generate(model: Any) -> bool:
    """A transformers model with generate() that is a decoder (GenerationMixin's can_generate())."""
    inner = base_model(model)
    check = getattr(inner, "can_generate", None)
    try:
        return bool(check()) if callable(check) else False
    except Exception:  # noqa: BLE001 - a model of the user's own with another can_generate
        return False


def base_config(model: Any) -> Optional[Any]:
    """The transformers config of the (adapted) model, or None."""
    inner = base_model(model)
    return getattr(inner, "config", None)


def model_positions(model: Any) -> Optional[int]:
    """The positions of the (adapted) model's transformers config, prompt and generated tokens together, or None."""
    config = base_config(model)
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    return positions if isinstance(positions, int) else None
