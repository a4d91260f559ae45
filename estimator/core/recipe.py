"""How a model is built, written once: the factory's base (its parameters on the meta device where only the
shapes are needed: the driver of a LoRA fit, a saved model's skeleton), then the adapters of `peft_config`, all
under the run's seed. The ranks (estimator.core.spec), the executors and getModel() (estimator.core.handle), the
driver (estimator.fit.recipes) and a saved model's load (estimator.predict.weights) build through this, so a base
the factory draws at random and the adapters' initial values are the same everywhere. torch (peft for adapters)
only, no pyspark."""
from __future__ import annotations

import functools
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

    def build(self, on_meta: bool = False) -> nn.Module:
        """The base with its adapters: the adapters' initial values drawn after the base's, from the one seed
        (as each rank draws them)."""
        return self._built(on_meta, adapters=True)

    def _built(self, on_meta: bool, adapters: bool) -> nn.Module:
        with hf_bars_off(), torch.random.fork_rng(devices=[]):
            if self.seed is not None:
                torch.manual_seed(self.seed)
            base = built_on_meta(self.factory) if on_meta else self.factory()
            return with_adapters(base, self.peft_config) if adapters else base


def loads_pretrained(factory: Any) -> bool:
    """A `functools.partial` of a transformers `from_pretrained` (no device_map of its own): every call gives the
    same weights, read from a folder, so the model may be built where it is needed instead of sent."""
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
