"""A model held as what rebuilds it, not as its weights: the factory that builds the base (a `from_pretrained` of
a folder every executor reads), the adapters' config and the trained adapters themselves (a few MB). The driver
of a LoRA fit never builds the base with its weights (`skeleton`: the parameters on the meta device), a fitted
TorchModel holds a ModelHandle, and transform sends it: each executor's Python worker builds the base once from
the factory (estimator.predict.inference keeps it) and loads the adapters.

What the driver holds then is the skeleton: the model's classes, config and shapes on the meta device (what the
checks read), with the adapters' values. `build()` makes the whole module where it is needed: an executor, a
user's getModel(). torch, safetensors and peft (for adapters) only, no pyspark."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch import nn

from estimator.core.adapters import check_trainable, load_trainable, trainable_state
from estimator.core.meta import allocated, meta_tensors
from estimator.core.recipe import ModelRecipe

@dataclass(frozen=True, eq=False)
class ModelHandle:
    """The base as its factory, the adapters as `peft_config` and their trained values (safetensors bytes).

    Attributes:
        factory: The zero-argument callable that builds the base (the fit's `model`).
        peft_config: The adapters' config (the fit's `peft_config`).
        trained: The trained adapters, `trainable_state` written by safetensors (names as the adapted model's).
    """

    factory: Callable[[], nn.Module]
    peft_config: Any
    trained: bytes = field(repr=False)
    seed: Optional[int] = None  # the run's: the ranks built the base and the adapters under it
    # where the trained state is read from when it is not `trained` (a full fine-tune's whole model, fsdp's
    # shards): the run's checkpoint in the store (estimator.train.checkpoint.RunState: `key`, `load_into`)
    stored: Any = None

    @classmethod
    def of(cls, factory: Callable[[], nn.Module], peft_config: Any, model: nn.Module,
           seed: Optional[int] = None) -> "ModelHandle":
        """The handle of `model`'s trained adapters (`model`: the skeleton or a whole module)."""
        from safetensors.torch import save

        state = {k: v.detach().cpu().contiguous() for k, v in trainable_state(model).items()}
        return cls(factory, peft_config, save(state), seed)

    @property
    def key(self) -> str:
        """What the executors' cache knows the model by: the trained values (a refit's new adapters are another
        model) and what builds the base."""
        func = getattr(self.factory, "func", self.factory)  # a partial's function, named (no address in it)
        digest = hashlib.sha256(self.trained)
        digest.update(repr((self.seed, self.stored.key if self.stored is not None else None,
                            getattr(self.factory, "key", None), function_name(func),
                            getattr(self.factory, "args", ()),
                            sorted(getattr(self.factory, "keywords", {}).items(), key=str))).encode())
        return "handle-" + digest.hexdigest()

    @property
    def recipe(self) -> ModelRecipe:
        return ModelRecipe(self.factory, self.peft_config, self.seed)

    def dequantized(self) -> "ModelHandle":
        """The same model over the base in its stored precision (a factory that quantizes it, QLoRA's, without its
        quantization_config): what a merged save merges the adapters into."""
        return replace(self, factory=self.recipe.dequantized().factory)

    def state(self) -> Dict[str, torch.Tensor]:
        from safetensors.torch import load

        return load(self.trained)

    def _base(self) -> nn.Module:
        """The factory's base with the adapters and their inline trained values, under the run's seed."""
        try:
            model = self.recipe.build()
        except Exception as exc:  # noqa: BLE001 - whatever the factory raised, said with where and what to do
            raise BaseUnavailable(
                f"The fitted model's base is built where it is needed (each executor for transform) by its model "
                f"factory, {self.factory!r}, which raised {type(exc).__name__}: {exc}. Make the base readable at "
                "that path from every executor (a Unity Catalog Volume, DBFS or a mounted ABFS/S3 path; moved or "
                "deleted?), or save a model that stands alone: fitted.write().option('standalone', 'true').save(path) "
                "keeps the base beside the adapters, and fitted.save_pretrained(folder) writes the adapters merged "
                "into the base, which AutoModelForCausalLM.from_pretrained(folder) loads.") from exc
        if self.trained:  # none: a pretrained model as its factory loads it (a TorchModel built without a fit)
            load_trainable(model, self.state(), "the fitted model's adapters")
        if self.stored is not None and meta_tensors(model):  # a factory that builds on the meta device (its
            allocated(model)  # weights the fit's weights_folder): memory for the stored state, the whole trained
        return model  # model, loaded strictly (no tensor left unread)

    def build(self) -> nn.Module:
        """The whole module, in eval mode: the factory's base with the adapters, their trained values loaded
        (loads the base's weights into this process), or the run's checkpoint's model (`stored`). Built as the
        ranks built it, under the run's seed: a base the factory draws at random (a config's model, no
        from_pretrained) is the one the adapters were trained on."""
        model = self._base()
        if self.stored is not None:  # the run's checkpoint, read here (only the model's part of it)
            self.stored.load_into(model)
        return model.eval()

    def built_with(self, optimizer: Optional[torch.optim.Optimizer], skeleton: nn.Module
                   ) -> "tuple[nn.Module, Optional[torch.optim.Optimizer]]":
        """(the whole module, `optimizer` made over its parameters: the skeleton's, with its state; a state left in
        the run's checkpoint, a full fine-tune's, read from there): what getModel() and save use."""
        from estimator.core.pickling import constructor_defaults, optimizer_groups, rebuild_optimizer

        if optimizer is None:
            return self.build(), None
        built = self._base()
        optimizer = rebuild_optimizer(type(optimizer), optimizer_groups(optimizer, skeleton),
                                      constructor_defaults(optimizer), optimizer.state_dict(), built)
        if self.stored is not None:  # the checkpoint read once: the model's part and the optimizer's
            self.stored.load_into(built, optimizer)
        return built.eval(), optimizer

    def mapped(self, skeleton: nn.Module, optimizer: Optional[torch.optim.Optimizer]
               ) -> Optional[Tuple[Dict[str, torch.Tensor], Optional[dict]]]:
        """(the trained model's state_dict, `optimizer`'s state_dict) of a full fine-tune whose state is in its run's
        checkpoint, their tensors mapped from files, not read: what save and save_pretrained write without building
        the model (estimator.predict.weights). None where the state is adapters, or not `skeleton`'s names and
        shapes: the model is then built whole. A tensor in another dtype than the skeleton's is cast, as
        load_state_dict would (that one is then in memory)."""
        if self.stored is None or self.peft_config is not None or not hasattr(self.stored, "mapped"):
            return None
        found = self.stored.mapped(optimizer is not None)
        tensors = found and of_skeleton(found[0], skeleton)
        if tensors is None:
            return None
        if optimizer is None:
            return tensors, None
        try:
            return tensors, by_position(found[1], optimizer, skeleton)
        except KeyError:  # a parameter the run's optimizer names that this one has not
            return None


def of_skeleton(tensors: Dict[str, torch.Tensor], skeleton: nn.Module) -> Optional[Dict[str, torch.Tensor]]:
    """`tensors` by the names of `skeleton`'s state_dict, in its dtypes (a tensor tied under two names may be saved
    under either); None where a name is missing or extra, or a shape differs."""
    wanted = skeleton.state_dict(keep_vars=True)
    names: Dict[int, list] = {}
    for name, tensor in wanted.items():
        names.setdefault(id(tensor), []).append(name)
    if set(tensors) - set(wanted):
        return None
    out, cast = {}, {}
    for name, tensor in wanted.items():
        value = next((tensors[n] for n in names[id(tensor)] if n in tensors), None)
        if value is None or value.shape != tensor.shape:
            return None
        if value.dtype != tensor.dtype:
            value = cast.setdefault(id(tensor), value.to(tensor.dtype))
        out[name] = value
    return out


def by_position(state: dict, optimizer: torch.optim.Optimizer, model: nn.Module) -> dict:
    """An optimizer's state_dict as `optimizer.state_dict()` keys it, by each parameter's position in its groups:
    from one keyed so already (returned as it is), or by parameter name (torch.distributed.checkpoint's, fsdp's
    shards). KeyError for a name that is not one of `optimizer`'s parameters."""
    if not any(isinstance(name, str) for group in state["param_groups"] for name in group["params"]):
        return state
    names: Dict[int, list] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    position = {name: i for i, param in enumerate(p for g in optimizer.param_groups for p in g["params"])
                for name in names.get(id(param), [])}
    return {"state": {position[name]: value for name, value in state["state"].items()},
            "param_groups": [{**group, "params": [position[n] for n in group["params"]]}
                             for group in state["param_groups"]]}


class BaseUnavailable(RuntimeError):
    """A handle's factory failed to build the base where the model is needed (an executor, getModel())."""


def with_values(model: nn.Module, state: Dict[str, torch.Tensor]) -> None:
    """The trainable parameters of a skeleton given their values (the rest stays on meta), in place."""
    check_trainable(model, state, "the fitted model's adapters")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in state.items():
            module_name, _, attr = name.rpartition(".")
            module = model.get_submodule(module_name)
            old = params[name]
            module._parameters[attr] = nn.Parameter(value.to(old.dtype), requires_grad=old.requires_grad)


def trainable_on_cpu(model: nn.Module) -> None:
    """A skeleton's trainable parameters given memory on the CPU (zeros), for a checkpoint's adapters to load into;
    the frozen base stays on meta. In place."""
    for name, param in list(model.named_parameters()):
        if param.requires_grad and param.is_meta:
            module_name, _, attr = name.rpartition(".")
            module = model.get_submodule(module_name)
            module._parameters[attr] = nn.Parameter(torch.zeros(param.shape, dtype=param.dtype), requires_grad=True)


def on_meta(model: Any) -> bool:
    """Whether `model` is a skeleton (any parameter or persistent buffer on the meta device)."""
    return isinstance(model, nn.Module) and bool(meta_tensors(model))


def held(model: Any, handle: Optional[ModelHandle]) -> Optional[ModelHandle]:
    """What a TorchModel's model is, decided in one place: the handle when the model is held as one (its module a
    skeleton on the meta device, rebuilt by the handle where it is needed), else None (the module is the model)."""
    return handle if handle is not None and on_meta(model) else None


def function_name(func: Any) -> str:
    """A factory's function by name, with what a method is bound to: AutoModel.from_pretrained and
    AutoModelForCausalLM.from_pretrained are one function (_BaseAutoModelClass.from_pretrained) bound to two
    classes, which build two models from one folder."""
    owner = getattr(func, "__self__", None)
    if owner is None:
        bound = ""
    elif isinstance(owner, type):
        bound = f"{owner.__module__}:{owner.__qualname__}."
    else:  # a bound method of an instance: its class (the instance's address is not a name)
        bound = f"{type(owner).__module__}:{type(owner).__qualname__}()."
    return (f"{bound}{getattr(func, '__module__', None)}:"
            f"{getattr(func, '__qualname__', type(func).__name__)}")
