"""The model and the optimizer given as recipes: `model` a zero-argument callable that builds the module (on every
rank, so that pretrained weights load there from their path, never through the driver's launch spec or the
store), `optimizer` a callable taking the parameters (`functools.partial(torch.optim.AdamW, lr=2e-5)`). The
driver builds each once, for its checks and its dry run on a few rows; the ranks get the recipes."""
from __future__ import annotations

import copy
from typing import Any, Callable, Mapping, Optional, Tuple

import torch
from torch import nn

from estimator.core.adapters import check_peft_config
from estimator.core.meta import check_weights, materialize, meta_tensors, unloadable
from estimator.core.params import param_error
from estimator.core.pickling import NotAnOptimizer, optimizer_from_factory
from estimator.core.recipe import (ModelRecipe, quantization_name, quantization_of, quantized,
                                   require_bitsandbytes)

OWNER = "TorchEstimator"


def model_of(value: Any, weights_folder: Optional[str] = None, whole: bool = True
             ) -> Tuple[nn.Module, Optional[Callable[[], nn.Module]]]:
    """(the module, the factory that built it or None): a module is used as it is; a callable is called once
    here, with no arguments, and what it leaves on the meta device is read whole from `weights_folder` (the
    driver's copy: its checks, its dry run, the TorchModel's module; estimator.core.meta). Not `whole`: the
    factory's model with every parameter on the meta device, no weight read into memory (estimator.core.handle:
    the driver of a language model's fit), `weights_folder` checked against it."""
    if isinstance(value, nn.Module):
        if quantized(value):
            raise ValueError(f"The 'model' parameter of {OWNER} is a model loaded quantized ({type(value).__name__}, "
                             "bitsandbytes): give the factory that loads it instead, so that each rank quantizes its "
                             "own copy and the driver holds none: model=functools.partial(AutoModelForCausalLM."
                             "from_pretrained, path, quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...)), "
                             "with peft_config (docs/language-models.md 'Fine-tune in 4 bits (QLoRA)').")
        if meta_tensors(value) or unloadable(value):
            raise ValueError(f"The 'model' parameter of {OWNER} is a module on the meta device (no weights): give "
                             "the callable that builds it instead, with weights_folder naming its weights, so that "
                             "each rank reads only what it holds (docs/gpus.md 'Build the model on the meta device').")
        if weights_folder is not None:
            check_weights(value, weights_folder, OWNER)  # the module has its weights: refused with why
        return value, None
    try:  # a skeleton of a weights_folder's factory: built as the factory builds it, for the folder's check below
        built = ModelRecipe(value).base(on_meta=not whole and weights_folder is None)
    except Exception as exc:
        raise ValueError(f"The 'model' parameter of {OWNER} is a callable, which fit calls with no arguments to "
                         "build the module: once on the driver (its checks and dry run), then on every rank. On the "
                         f"driver it raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(built, nn.Module):
        raise TypeError(param_error(OWNER, "model", "a torch.nn.Module, or a zero-argument callable returning one; "
                                    f"the callable returned {type(built).__name__}", value))
    if not whole:  # every parameter on the meta device, a weights_folder checked but not read (what the factory
        if weights_folder is not None:  # built with values too: the run's checkpoint holds them all after the fit)
            check_weights(built, weights_folder, OWNER)
            built = built.to("meta")
        return built, value
    if check_weights(built, weights_folder, OWNER):
        materialize(built, weights_folder)
    return built, value


def check_optimizer(value: Any, model: nn.Module, lr: Optional[float]) -> None:
    """An optimizer given as a callable returns an optimizer over the model's parameters (built here once, over
    the driver's model: a constructor allocates no state)."""
    if value is None or isinstance(value, torch.optim.Optimizer):
        return
    try:
        optimizer_from_factory(value, model, lr)
    except NotAnOptimizer:
        raise
    except Exception as exc:
        raise ValueError(f"The 'optimizer' parameter of {OWNER} is a callable, which fit calls with the model's "
                         f"parameters on every rank; called on the driver it raised {type(exc).__name__}: {exc}"
                         ) from exc


def with_peft(model: nn.Module, factory: Any, config: Any, weights_folder: Optional[str], optimizer: Any) -> nn.Module:
    """The driver's model with the adapters of peft_config (a copy of a module given as an instance: fit never
    changes the user's module); `model` itself without a config."""
    if config is None:
        return model
    check_peft_config(config, OWNER)
    if weights_folder is not None:
        raise ValueError("peft_config with weights_folder is not supported yet: the adapters rename the base's "
                         "weights. Load the base in the model factory (from_pretrained), or leave peft_config unset.")
    if isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError("peft_config trains the adapters only, so the optimizer must be built over them on each "
                         "rank: pass it as a callable, optimizer=functools.partial(torch.optim.AdamW, lr=2e-4), not "
                         "an optimizer built over the base model's parameters.")
    source = model if factory is not None else copy.deepcopy(model)
    return ModelRecipe(lambda: source, config).build()


def check_quantized(p: Mapping[str, Any], language_model: bool) -> None:
    """A factory that loads its base quantized (quantization_config: QLoRA) trains a causal LM's adapters over the
    frozen base, with bitsandbytes here and on every executor; anything else refused by name before any job."""
    quantization = quantization_of(p["model_factory"])
    if quantization is None:
        return
    if p["peft_config"] is None:
        raise ValueError(f"The model factory loads its base quantized ({quantization_name(quantization)}, its "
                         "quantization_config), and peft_config is None: a quantized base cannot be trained itself "
                         "(its weights are packed integers), only adapters over it. Set peft_config=LoraConfig(r=16, "
                         "lora_alpha=32, target_modules='all-linear', task_type='CAUSAL_LM'), or load the base "
                         "unquantized for a full fine-tune.")
    if not language_model:
        raise ValueError("The model factory loads its base quantized (quantization_config): a quantized base trains "
                         "a causal language model's adapters (SFT, DPO: a string response, a chat or preference "
                         "pairs, and a tokenizer), whose driver never runs the base's forward. This fit's objective "
                         "runs the model on the driver: load the base unquantized.")
    if p["weights_folder"] is not None:
        raise ValueError("weights_folder reads the base's weights into a model the factory left on the meta device; "
                         "a factory that loads its base quantized reads them itself (from_pretrained): leave "
                         "weights_folder unset.")
    require_bitsandbytes("on the driver")
