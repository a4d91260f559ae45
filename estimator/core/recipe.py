"""How a model is built, written once: the factory's base (its parameters on the meta device where only the
shapes are needed: the driver of a LoRA fit, a saved model's skeleton), then the adapters of `peft_config`, all
under the run's seed. A base the factory quantizes (a `from_pretrained` with a bitsandbytes `quantization_config`:
QLoRA) is quantized where its weights are read (a rank, an executor), prepared for training through its adapters
as peft's prepare_model_for_kbit_training does, and built without its quantization where only shapes are needed
(a skeleton has no values to quantize) or asked for in full precision (a merged save). The ranks
(estimator.core.spec), the executors and getModel() (estimator.core.handle), the driver (estimator.fit.recipes)
and a saved model's load (estimator.predict.weights) build through this, so a base the factory draws at random
and the adapters' initial values are the same everywhere. torch (peft for adapters) only, no pyspark."""
from __future__ import annotations

import functools
import importlib.util
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from estimator.core.adapters import with_adapters
from estimator.core.meta import parameters_on_meta
from estimator.core.quiet import hf_bars_off

log = logging.getLogger("estimator")


@dataclass(frozen=True, eq=False)
class ModelRecipe:
    """The model param as a recipe.

    Attributes:
        factory: The zero-argument callable that builds the base (the fit's `model`).
        peft_config: The adapters put on the base (the fit's `peft_config`); None: the base is the model.
        seed: The run's seed, drawn from before the factory is called (None: the process's own draws).
    """

    factory: Callable[[], nn.Module]
    peft_config: Any = None
    seed: Optional[int] = None

    def base(self, on_meta: bool = False) -> nn.Module:
        """The factory's module alone (no adapters), under the seed."""
        return self._built(on_meta, adapters=False)

    def build(self, on_meta: bool = False, training: bool = False) -> nn.Module:
        """The base with its adapters: the adapters' initial values drawn after the base's, from the one seed
        (as each rank draws them). `training`: a rank's, whose quantized layers keep their gradients in every
        mode (cpu_repacking_off)."""
        model = self._built(on_meta, adapters=True)
        if training:
            cpu_repacking_off(model)
        return model

    @property
    def quantization(self) -> Any:
        """The factory's quantization_config (bitsandbytes' 4 or 8 bits), or None."""
        return quantization_of(self.factory)

    def dequantized(self) -> "ModelRecipe":
        """The same recipe with the base in its stored precision (no quantization_config)."""
        return ModelRecipe(unquantized(self.factory), self.peft_config, self.seed)

    def _built(self, on_meta: bool, adapters: bool) -> nn.Module:
        factory = unquantized(self.factory) if on_meta else self.factory
        if quantization_of(factory) is not None:
            require_bitsandbytes("here")
        with hf_bars_off(), torch.random.fork_rng(devices=[]):
            if self.seed is not None:
                torch.manual_seed(self.seed)
            base = built_on_meta(factory) if on_meta else factory()
            if not adapters or self.peft_config is None:
                return base
            if quantized(base):
                kbit_prepared(base)
            return with_adapters(base, self.peft_config)


def quantization_of(factory: Any) -> Any:
    """The quantization a factory loads its base with: a `functools.partial` of a `from_pretrained`'s
    quantization_config (transformers' BitsAndBytesConfig: 4-bit NF4 or FP4, or 8 bits), else None."""
    if not isinstance(factory, functools.partial):
        return None
    return factory.keywords.get("quantization_config")


def quantization_name(quantization: Any) -> str:
    """A quantization_config in a few words, for messages: '4-bit nf4', '8-bit', else its type."""
    def get(key: str) -> Any:
        return quantization.get(key) if isinstance(quantization, dict) else getattr(quantization, key, None)

    if get("load_in_4bit"):
        return f"4-bit {get('bnb_4bit_quant_type') or 'fp4'}"
    return "8-bit" if get("load_in_8bit") else type(quantization).__name__


QLORA_HINT = "pip install 'spark-torch-estimator[qlora]' (bitsandbytes)"


def require_bitsandbytes(where: str) -> None:
    """bitsandbytes is importable `where` (this process: a rank, an executor, the driver), else an ImportError
    naming the package and the extra (a rank's ImportError is an environment failure: never retried)."""
    try:
        found = importlib.util.find_spec("bitsandbytes") is not None
    except ValueError:  # a module object without a spec (sys.modules["bitsandbytes"] = None: blocked)
        found = False
    if not found:
        raise ImportError(f"The model factory loads its base quantized (quantization_config), which needs the "
                          f"bitsandbytes package, missing {where}: {QLORA_HINT} on the driver and every executor "
                          "(docs/language-models.md 'Fine-tune in 4 bits (QLoRA)').")


def unquantized(factory: Any) -> Any:
    """`factory` without its quantization_config (itself when it has none): the base in its stored dtype."""
    if quantization_of(factory) is None:
        return factory
    keywords = {k: v for k, v in factory.keywords.items() if k != "quantization_config"}
    return functools.partial(factory.func, *factory.args, **keywords)


def quantized(model: Any) -> bool:
    """Whether a transformers model was loaded quantized (bitsandbytes' 4 or 8 bits)."""
    return bool(getattr(model, "is_quantized", False)) and getattr(model, "hf_quantizer", None) is not None


def cpu_repacking_off(model: nn.Module) -> None:
    """bitsandbytes (0.50) on a CPU with AVX512-BF16 repacks a 4-bit layer's weights for its inference kernel at
    the layer's first forward in eval mode without gradients (validation, a reference pass, generation), and from
    then on the layer's forward gives no gradient to its input, in training too: the adapters of every layer
    below it would train on a fraction of their gradient (measured: a tiny Llama's first layer's LoRA gradient
    6.3 against 55.2), silently. A rank's model keeps the training layout (the attribute the layer reads). In
    place; nothing for a model without such layers."""
    for module in model.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            module.support_avx512bf16_for_cpu = False


def kbit_prepared(model: nn.Module) -> nn.Module:
    """A quantized base made ready for adapters, as peft's prepare_model_for_kbit_training does (QLoRA): every
    parameter frozen, those kept in 16 bits (norms, embeddings, the head) cast to float32 for a stable training
    through the adapters; gradient checkpointing is the gradient_checkpointing param's (estimator.train.memory).
    In place."""
    from peft import prepare_model_for_kbit_training

    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def loads_pretrained(factory: Any) -> bool:
    """A `functools.partial` of a transformers `from_pretrained` (no device_map of its own), or a factory that says
    it is one (`pretrained`: a saved folder at a remote URL, estimator.predict.folders): every call gives the
    same weights, read from a folder, so the model may be built where it is needed instead of sent."""
    if getattr(factory, "pretrained", False) is True:
        return True
    return (isinstance(factory, functools.partial) and getattr(factory.func, "__name__", "") == "from_pretrained"
            and "device_map" not in factory.keywords)


def built_on_meta(factory: Callable[[], Any]) -> Any:
    """`factory()` with every parameter it registers on the meta device. A `functools.partial` of a transformers
    `from_pretrained` is also told `device_map="meta"`: transformers then reads no tensor at all (else it reads
    each and casts it to the dtype asked before the parameter goes to meta: a float32 folder loaded with
    dtype=torch.bfloat16 took 1.3x its weights on the driver)."""
    meta_map = loads_pretrained(factory)
    with hf_bars_off(), parameters_on_meta():
        if meta_map:
            try:
                return factory(device_map="meta")
            except (TypeError, ValueError, ImportError) as exc:  # a from_pretrained that takes no device_map
                log.debug("from_pretrained(device_map='meta') failed (%s): built with its parameters moved to meta",
                          exc)
        return factory()
