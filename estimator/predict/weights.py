"""A model built by a factory, saved without pickling its weights.

A TorchModel whose module came from a `model` factory is saved as its weights plus what rebuilds the module:
  - a Hugging Face `PreTrainedModel`: `pretrained/`, the folder its own `save_pretrained` writes (config.json and
    model.safetensors; the tokenizer too when it is a Hugging Face one), rebuilt by the class's `from_pretrained`
    from that folder alone: the path the factory read at fit time need not exist where the model is loaded;
  - a model with adapters (peft_config): `adapter/`, peft's own folder (adapter_config.json and the adapters'
    weights), rebuilt by calling the factory (the base) and peft's PeftModel.from_pretrained over it;
  - any other module: `model.safetensors` (the state_dict; tied weights stored once), rebuilt by calling the
    factory (pickled with the other params) and loading those weights over what it built.
The optimizer at the end of training goes to `optimizer.pt` as its class, groups, hyperparameters and state (a
pickled optimizer would carry a copy of every weight), and to `optimizer_groups.pt` without its state (what a
load reads on the driver). `module.json` says which. Models given as instances keep
the pickle layout of earlier releases (persistence). Hugging Face's and safetensors' writers take local paths: remote stores get a local copy, then fsspec's put/get.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import posixpath
import re
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch import nn

from estimator.core.adapters import is_adapted, peft_reading_old_names, trainable_names
from estimator.core.handle import ModelHandle, with_values
from estimator.core.recipe import ModelRecipe
from estimator.core.meta import materialize, meta_tensors
from estimator.core.numbers import plain
from estimator.core.pickling import constructor_defaults, optimizer_groups, rebuild_optimizer
from estimator.core.quiet import hf_bars_off
from estimator.predict.folders import RemoteFolder, class_named, folder_key, get_folder, local_copy

MODULE_FILE = "module.json"
HUGGING_FACE_FOLDER = "pretrained"
ADAPTER_FOLDER = "adapter"
BASE_FOLDER = "base"  # a standalone save's base, under a model with adapters
WEIGHTS_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
OPTIMIZER_GROUPS_FILE = "optimizer_groups.pt"  # the same without its state: what a load reads on the driver

log = logging.getLogger("estimator")


def is_hugging_face_model(model: Any) -> bool:
    """A transformers PreTrainedModel (has a config and the save_pretrained/from_pretrained pair)."""
    return all(hasattr(model, name) for name in ("config", "save_pretrained", "from_pretrained"))


def save_module(model: nn.Module, optimizer: Optional[torch.optim.Optimizer], tokenizer: Any, fs: Any,
                root: str, standalone: bool = False,
                state: Optional[Tuple[Dict[str, torch.Tensor], Optional[dict]]] = None) -> None:
    """Write the trained weights, the optimizer and `module.json` under `root`. `standalone`: a model with adapters
    also writes its base (BASE_FOLDER, a Hugging Face folder), which a load then builds it on instead of calling
    the fit's factory. `state`: (the model's tensors, the optimizer's state_dict) written for `model`, a
    skeleton, and `optimizer`, made over it: a full fine-tune's, mapped from its run's checkpoint
    (estimator.core.handle.ModelHandle.mapped), the model never built here."""
    tensors, optimizer_state = state if state is not None else (None, None)
    with tempfile.TemporaryDirectory() as local, hf_bars_off():
        if is_adapted(model):  # the adapters alone (peft's folder); the base is rebuilt by the factory
            model.save_pretrained(local)
            put_folder(local, fs, posixpath.join(root, ADAPTER_FOLDER))
            kind = {"format": "peft", "folder": ADAPTER_FOLDER, "class": qualified_name(type(model))}
            if standalone:
                base = save_base(model, os.path.join(local, BASE_FOLDER))
                put_folder(os.path.join(local, BASE_FOLDER), fs, posixpath.join(root, BASE_FOLDER))
                kind.update(base=BASE_FOLDER, base_class=qualified_name(type(base)))
        elif is_hugging_face_model(model):
            save_pretrained_folder(model, tokenizer, local, tensors)
            put_folder(local, fs, posixpath.join(root, HUGGING_FACE_FOLDER))
            kind = {"format": "hugging_face", "folder": HUGGING_FACE_FOLDER, "class": qualified_name(type(model))}
        else:
            save_weights(model, tensors, os.path.join(local, WEIGHTS_FILE))
            fs.put_file(os.path.join(local, WEIGHTS_FILE), posixpath.join(root, WEIGHTS_FILE))
            kind = {"format": "safetensors", "file": WEIGHTS_FILE, "class": qualified_name(type(model))}
    if optimizer is not None:
        saved = {"class": qualified_name(type(optimizer)), "groups": optimizer_groups(optimizer, model),
                 "defaults": plain(constructor_defaults(optimizer)),
                 "state": optimizer.state_dict() if optimizer_state is None else optimizer_state}
        from fsspec.implementations.local import LocalFileSystem

        groups = {**{k: v for k, v in saved.items() if k != "state"}, "param_groups": saved["state"]["param_groups"]}
        if isinstance(fs, LocalFileSystem):  # written in place: mapped tensors are read as they go
            torch.save(saved, posixpath.join(root, OPTIMIZER_FILE))
            torch.save(groups, posixpath.join(root, OPTIMIZER_GROUPS_FILE))
        else:
            with tempfile.TemporaryDirectory() as local:  # a local file first, then copied
                for name, content in ((OPTIMIZER_FILE, saved), (OPTIMIZER_GROUPS_FILE, groups)):
                    torch.save(content, os.path.join(local, name))
                    fs.put_file(os.path.join(local, name), posixpath.join(root, name))
    with fs.open(posixpath.join(root, MODULE_FILE), "w") as f:
        json.dump(kind, f)


def save_weights(model: nn.Module, tensors: Optional[Dict[str, torch.Tensor]], path: str) -> None:
    """`model`'s state_dict as safetensors at `path` (a tensor tied under several names, once), or `tensors`, the
    state_dict given for it by name."""
    from safetensors.torch import save_file, save_model

    if tensors is None:
        save_model(model, path)
        return
    kept: Dict[int, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        kept.setdefault(id(tensor), name)
    save_file({name: tensors[name] for name in kept.values()}, path, metadata={"format": "pt"})


def save_base(model: nn.Module, folder: str) -> nn.Module:
    """The base under peft's adapters written to `folder` with save_pretrained (its weights as the base had them:
    the adapters' layers' `base_layer` names mapped back, the adapters left out); returns the base module."""
    if not is_hugging_face_model(model.get_base_model()):
        raise TypeError("A standalone save writes the base as a Hugging Face folder, and this base is a "
                        f"{type(model.get_base_model()).__name__}: save the model without the option (its adapters "
                        "and the factory that builds the base).")
    if any(getattr(c, "modules_to_save", None) for c in model.peft_config.values()):
        raise ValueError("A standalone save of a model whose peft_config has modules_to_save is not supported yet: "
                         "fitted.save_pretrained(folder) writes the adapters merged into the base, which stands alone.")
    base = model.get_base_model()
    state = {re.sub(r"\.base_layer(?=\.)", "", name): value for name, value in base.state_dict().items()
             if ".lora_" not in name}
    base.save_pretrained(folder, state_dict=state)
    return base


def standalone_base(fs: Any, root: str) -> Optional[Callable[[], nn.Module]]:
    """The factory of the base a standalone save wrote under `root` (a from_pretrained of its folder), None when
    it wrote none. The folder is read where the model is built: a local one (a mounted path too) in place, a
    remote one copied to that machine's disk first (estimator.predict.folders)."""
    kind = saved_kind(fs, root)
    if kind is None or "base" not in kind:
        return None
    return pretrained_at(fs, posixpath.join(root, kind["base"]), kind["base_class"])


def pretrained_at(fs: Any, folder: str, class_name: str) -> Callable[[], nn.Module]:
    """`from_pretrained` of the Hugging Face folder `folder` on `fs` by the class named `class_name`: a partial of
    the local path, or a RemoteFolder (the folder copied where it is called)."""
    import functools

    from fsspec.implementations.local import LocalFileSystem

    if isinstance(fs, LocalFileSystem):
        return functools.partial(class_named(class_name).from_pretrained, folder)
    return RemoteFolder(fs.unstrip_protocol(folder), class_name, folder_key(fs, folder), fs)


def factory_model(factory: Callable[[], nn.Module], root: str, meta: bool = False, seed: Optional[int] = None,
                  peft_config: Any = None) -> nn.Module:
    """The base a saved model's adapters go on, built by the fit's model factory (the adapters alone are saved),
    under the seed the ranks built it under, with the adapters of `peft_config` (their values not yet read);
    `meta`: its parameters on the meta device (estimator.core.handle)."""
    try:
        return ModelRecipe(factory, peft_config, seed).build(on_meta=meta)
    except Exception as exc:  # noqa: BLE001 - whatever the factory raised, said with what to do
        raise ValueError(f"{root} holds a model's adapters (peft_config) without its base weights: the base is built "
                         f"at load by the fit's model factory, {factory!r}, which raised {type(exc).__name__}: {exc}. "
                         "Make the base loadable there again (the folder it names, moved or deleted?), or save a model "
                         "that stands alone: fitted.write().option('standalone', 'true').save(path) keeps the base "
                         "beside the adapters, and fitted.save_pretrained(folder) writes the adapters merged into the "
                         "base, which AutoModelForCausalLM.from_pretrained(folder) loads.") from exc


def load_module(fs: Any, root: str, factory: Optional[Callable[[], nn.Module]], seed: Optional[int] = None
                ) -> Optional[Tuple[nn.Module, Optional[torch.optim.Optimizer]]]:
    """(the module, the optimizer or None) saved by save_module under `root`; None when `root` holds none (a
    model given as an instance, or an earlier release's save)."""
    kind = saved_kind(fs, root)
    if kind is None:
        return None
    if kind["format"] in ("peft", "safetensors") and factory is None:
        raise ValueError(f"{root} holds the weights of a model built by a factory, but not the factory (its "
                         "objects.pkl lacks model_factory): it was not saved by TorchModel.save.")
    with tempfile.TemporaryDirectory() as local, hf_bars_off():
        if kind["format"] == "peft":
            from peft import PeftModel

            get_folder(fs, posixpath.join(root, kind["folder"]), local)
            model = adapted_skeleton(factory_model(factory, root, meta=True, peft_config=saved_adapters(local)),
                                     local)
            if model is None:  # adapters peft names otherwise (modules_to_save...): the base built whole
                with peft_reading_old_names():
                    model = PeftModel.from_pretrained(factory_model(factory, root, seed=seed), local,
                                                      is_trainable=True)
        elif kind["format"] == "hugging_face":
            get_folder(fs, posixpath.join(root, kind["folder"]), local)
            model = class_named(kind["class"]).from_pretrained(local)
        else:
            from safetensors.torch import load_model

            model = factory()
            fs.get_file(posixpath.join(root, kind["file"]), os.path.join(local, WEIGHTS_FILE))
            if meta_tensors(model):  # built on the meta device (weights_folder at fit time): the saved weights
                materialize(model, local)
            load_model(model, os.path.join(local, WEIGHTS_FILE), strict=True)
    model.eval()
    optimizer_path = posixpath.join(root, OPTIMIZER_FILE)
    if not fs.exists(optimizer_path):
        return model, None
    saved = mapped_file(fs, optimizer_path)
    cls = optimizer_class(saved)
    if cls is None:
        return model, None
    return model, rebuild_optimizer(cls, saved["groups"], saved["defaults"], saved["state"], model)


def saved_kind(fs: Any, root: str) -> Optional[dict]:
    """What save_module wrote in `root`'s module.json (the format, the folder or file, the class), or None where
    it wrote none (a model given as an instance, or an earlier release's save)."""
    path = posixpath.join(root, MODULE_FILE)
    if not fs.exists(path):
        return None
    with fs.open(path, "r") as f:
        return json.load(f)


def optimizer_class(saved: dict) -> Optional[type]:
    """The class of a saved optimizer (optimizer.pt's "class"), or None with a warning where it cannot be
    imported here (a class defined in the saving notebook): the model then loads without its optimizer."""
    try:
        return class_named(saved["class"])
    except (ImportError, AttributeError) as exc:
        log.warning("The saved model's optimizer class %s cannot be imported here (%s): loaded without its "
                    "optimizer (getOptimizer() is None).", saved["class"], exc)
        return None


def mapped_file(fs: Any, path: str) -> Any:
    """What torch.save wrote at `path`, its tensors mapped from the file (copy-on-write: the file never changes),
    not read into this process's memory (an optimizer's state is twice the weights, for AdamW); a remote file
    is copied to a local one first. Tensors and plain values only (weights_only)."""
    from fsspec.implementations.local import LocalFileSystem

    if isinstance(fs, LocalFileSystem):
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except (OSError, RuntimeError):  # a mount that cannot map its files (some FUSE ones): read whole
            return torch.load(path, map_location="cpu", weights_only=True)
    with tempfile.NamedTemporaryFile(suffix=".pt") as local:  # mapped, the file may go: its pages stay
        fs.get_file(path, local.name)
        return torch.load(local.name, map_location="cpu", weights_only=True, mmap=True)


@dataclass(frozen=True)
class SavedState:
    """A loaded full fine-tune's state where its saved folder holds it (a ModelHandle's `stored`, as a fit's
    run checkpoint is): the weights in the Hugging Face folder the handle's factory loads, the optimizer's state
    in `optimizer` (optimizer.pt, or None), read where the model is built (getModel()) and mapped where it is
    saved again. `key`: the files' sizes and times (a folder saved over again is another model)."""

    folder: str
    optimizer: Optional[str]
    key: str
    fs: Any = None  # where folder and optimizer are: None for a local (or mounted) path

    def file_system(self) -> Any:
        from fsspec.implementations.local import LocalFileSystem

        return LocalFileSystem() if self.fs is None else self.fs

    def load_into(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """The optimizer's saved state into `optimizer` (the model's weights are the factory's)."""
        if optimizer is not None and self.optimizer is not None:
            optimizer.load_state_dict(mapped_file(self.file_system(), self.optimizer)["state"])

    def mapped(self, optimizer: bool = True) -> Tuple[Dict[str, torch.Tensor], Optional[dict]]:
        """(the weights by name, the optimizer's state_dict or None), their tensors mapped from the files (a
        remote folder's from this machine's copy of it)."""
        from safetensors import safe_open

        folder = self.folder if self.fs is None else local_copy(self.fs, self.folder, self.key)
        tensors: Dict[str, torch.Tensor] = {}
        for name in sorted(os.listdir(folder)):
            if name.endswith(".safetensors"):
                with safe_open(os.path.join(folder, name), "pt") as f:
                    tensors.update({key: f.get_tensor(key) for key in f.keys()})
        state = mapped_file(self.file_system(), self.optimizer)["state"] if optimizer and self.optimizer else None
        return tensors, state


def held_saved(fs: Any, root: str) -> Optional[Tuple[nn.Module, Optional[torch.optim.Optimizer], ModelHandle]]:
    """A full fine-tune saved as a Hugging Face folder: (its skeleton on the meta device, an optimizer over it
    with the saved groups' hyperparameters, the handle that builds the model from that folder where it is
    needed), no weight nor any of the optimizer's state read here. A local or mounted path is read in place by
    every executor, as a fit's base folder is; a remote URL's folder is copied to each machine that builds the
    model (estimator.predict.folders), the driver reading its config and the weights' headers only. None for
    any other saved model (load_module builds it here)."""
    from fsspec.implementations.local import LocalFileSystem

    kind = saved_kind(fs, root)
    if kind is None or kind["format"] != "hugging_face":
        return None
    folder = posixpath.join(root, kind["folder"])
    factory = pretrained_at(fs, folder, kind["class"])
    skeleton = ModelRecipe(factory).build(on_meta=True)
    optimizer, optimizer_path = None, posixpath.join(root, OPTIMIZER_FILE)
    if fs.exists(optimizer_path):
        saved = saved_groups(fs, root)
        cls = optimizer_class(saved)
        if cls is not None:  # its groups' hyperparameters now; its state read where the model is built
            optimizer = rebuild_optimizer(cls, saved["groups"], saved["defaults"],
                                          {"state": {}, "param_groups": saved["param_groups"]}, skeleton)
    files = [folder_key(fs, folder)]
    if optimizer is not None:
        files.append(folder_key(fs, optimizer_path))
    key = hashlib.sha256(repr(files).encode()).hexdigest()
    stored = SavedState(folder, optimizer_path if optimizer is not None else None, key,
                        None if isinstance(fs, LocalFileSystem) else fs)
    return skeleton.eval(), optimizer, ModelHandle(factory, None, b"", None, stored=stored)


def saved_groups(fs: Any, root: str) -> dict:
    """A saved optimizer's class, groups, defaults and param_groups, without its state: from the small file that
    save_module writes beside it (a remote URL's optimizer.pt, twice the weights for AdamW, is not copied for
    them), or from optimizer.pt itself (saved before that file; mapped where it is local)."""
    path = posixpath.join(root, OPTIMIZER_GROUPS_FILE)
    if fs.exists(path):
        with fs.open(path, "rb") as f:
            return torch.load(f, map_location="cpu", weights_only=True)
    saved = mapped_file(fs, posixpath.join(root, OPTIMIZER_FILE))
    return {**saved, "param_groups": saved["state"]["param_groups"]}


def saved_adapters(folder: str) -> Any:
    """The config of the adapters saved in peft's `folder`, to train (not peft's inference mode)."""
    from peft import PeftConfig

    config = PeftConfig.from_pretrained(folder)
    config.inference_mode = False
    return config


def adapted_skeleton(model: nn.Module, folder: str) -> Optional[nn.Module]:
    """`model` (a base on the meta device with the adapters of peft's `folder`) given the adapters' values saved
    there (a few MB; the base's weights are read where the model is built: estimator.core.handle); None when a
    saved name is not the trainable parameter's name less its adapter's (`.default`), as peft saves LoRA's."""
    from peft.utils import load_peft_weights

    saved = load_peft_weights(folder, device="cpu")
    names = {name: re.sub(r"\.default(?=\.)", "", name) for name in trainable_names(model)}
    if sorted(names.values()) != sorted(saved):
        return None
    with_values(model, {name: saved[key] for name, key in names.items()})
    return model


def save_pretrained_folder(model: nn.Module, tokenizer: Any, folder: str,
                           tensors: Optional[Dict[str, torch.Tensor]] = None) -> None:
    """Hugging Face's own folder: the model's save_pretrained (of `tensors`, its state_dict given by name, when
    given: a skeleton's), and the tokenizer's when it has one."""
    if not is_hugging_face_model(model):
        raise TypeError(f"save_pretrained writes a Hugging Face folder, and this model is a {type(model).__name__}, "
                        "not a transformers PreTrainedModel: save it with TorchModel.save(path) (weights as "
                        "safetensors), or torch.save(model.getModel().state_dict(), path).")
    with hf_bars_off():
        model.save_pretrained(folder, state_dict=None if tensors is None else dict(tensors))
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(folder)


def save_pretrained_to(model: nn.Module, tokenizer: Any, url: str,
                       tensors: Optional[Dict[str, torch.Tensor]] = None) -> None:
    """save_pretrained_folder to a local path or an fsspec URL (written locally, then copied)."""
    from fsspec.core import url_to_fs
    from fsspec.implementations.local import LocalFileSystem

    fs, root = url_to_fs(url)
    if isinstance(fs, LocalFileSystem):
        save_pretrained_folder(model, tokenizer, root, tensors)
        return
    with tempfile.TemporaryDirectory() as local:
        save_pretrained_folder(model, tokenizer, local, tensors)
        put_folder(local, fs, root)


def put_folder(local: str, fs: Any, remote: str) -> None:
    """Every file under `local` to the same relative path under `remote`."""
    for folder, _, files in os.walk(local):
        for name in files:
            target = posixpath.join(remote, os.path.relpath(os.path.join(folder, name), local).replace(os.sep, "/"))
            fs.makedirs(posixpath.dirname(target), exist_ok=True)
            fs.put_file(os.path.join(folder, name), target)


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


