"""A model the `model` factory builds on the meta device (shapes, no memory), its weights read from a folder of
.safetensors files (a save_pretrained folder) named by the `weights_folder` param: the way to train a model no
rank can hold whole, or that a host's ranks cannot each build whole on the CPU first.

    def build():
        config = BertConfig.from_pretrained("/dbfs/models/bert")
        with parameters_on_meta():         # parameters on meta; buffers (position ids) keep their values
            model = BertForSequenceClassification(config)
        model.classifier = nn.Linear(config.hidden_size, 2)  # built with values: kept, not read
        return model

What the factory leaves on the meta device is read from the folder by its state-dict name (each rank only its own
shards with strategy='fsdp', estimator.train.sharding); what it builds with values is kept. The driver builds it
whole (its dry run; the TorchModel at the end): `materialize`. torch and safetensors only, no pyspark.
"""
from __future__ import annotations

import contextlib
import os
import socket
import threading
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
from torch import nn

SUFFIX = ".safetensors"
HOW = ("build the parameters on the meta device with estimator.parameters_on_meta() (buffers keep their values) "
       "and name the folder of their weights with weights_folder")


_ORIGINAL_REGISTER = nn.Module.register_parameter
_BUILDING = threading.local()  # this thread's depth inside parameters_on_meta
_USERS_LOCK = threading.Lock()
_users = 0  # threads inside parameters_on_meta: nn.Module.register_parameter is patched while any is


def _register_on_meta(module: nn.Module, name: str, param: "nn.Parameter | None") -> None:
    _ORIGINAL_REGISTER(module, name, param)
    if getattr(_BUILDING, "depth", 0) and param is not None and not param.is_meta:
        module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter a module registers inside this block, in this thread, goes to the meta device (its
    initialization then costs nothing); buffers keep their values (a non-persistent buffer, such as a transformer's
    position ids, is in no weights file: on meta it could not be restored). nn.Module.register_parameter is
    patched while any thread is inside; other threads' modules (fits of a grid side by side) keep their weights,
    and the original is back when the last one leaves."""
    global _users
    with _USERS_LOCK:
        if _users == 0:
            nn.Module.register_parameter = _register_on_meta  # type: ignore[method-assign]
        _users += 1
    depth = getattr(_BUILDING, "depth", 0)
    _BUILDING.depth = depth + 1
    try:
        yield
    finally:
        _BUILDING.depth = depth
        with _USERS_LOCK:
            _users -= 1
            if _users == 0:
                nn.Module.register_parameter = _ORIGINAL_REGISTER  # type: ignore[method-assign]


def meta_tensors(model: nn.Module) -> List[List[str]]:
    """The parameters and persistent buffers on the meta device, each as its state-dict names (several where
    modules share it: a tied embedding; a weights file holds one of them): what the weights folder must give."""
    names: Dict[int, List[str]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if t.is_meta:
            names.setdefault(id(t), []).append(name)
    return list(names.values())


def weight_keys(model: nn.Module, keys: Iterable[str] = ()) -> Dict[str, Optional[str]]:
    """{a state-dict name of each tensor on the meta device: its key among a weights folder's `keys`, or None}.
    A name is its own key. A model that declares `base_model_prefix` (transformers' models do) also finds its
    weights as from_pretrained does: without the prefix (a base model's folder read into a model with a head:
    bert.encoder... from encoder...) or with it (a folder of a model with a head read into its base model).
    Tensors shared by several names (tied weights) take the first name that has a key, else their first name."""
    there = set(keys)
    prefix = getattr(model, "base_model_prefix", "")
    prefix = f"{prefix}." if isinstance(prefix, str) and prefix else ""

    def key(name: str) -> Optional[str]:
        if name in there:
            return name
        if prefix and name.startswith(prefix) and name[len(prefix):] in there:
            return name[len(prefix):]
        return prefix + name if prefix and prefix + name in there else None

    found: Dict[str, Optional[str]] = {}
    for names in meta_tensors(model):
        name = next((n for n in names if key(n) is not None), names[0])
        found[name] = key(name)
    return found


def unloadable(model: nn.Module) -> List[str]:
    """Buffers on the meta device that no state dict holds (non-persistent): nothing could give them values."""
    saved = set(model.state_dict(keep_vars=True))
    return [name for name, b in model.named_buffers() if b.is_meta and name not in saved]


def folder_entries(folder: str) -> Dict[str, Tuple[str, Tuple[int, ...]]]:
    """{state-dict name: (its .safetensors file in `folder`, its shape)}, from the files' headers only."""
    from safetensors import safe_open

    entries: Dict[str, Tuple[str, Tuple[int, ...]]] = {}
    for file in sorted(os.listdir(folder)):
        if file.endswith(SUFFIX):
            with safe_open(os.path.join(folder, file), framework="pt") as f:
                entries.update({key: (file, tuple(f.get_slice(key).get_shape())) for key in f.keys()})
    return entries


def check_weights(model: nn.Module, folder: "str | None", owner: str) -> Dict[str, str]:
    """{each meta name of `model`: its key in `folder`} (weight_keys), after checking that the folder gives each a
    value of its shape; a clear error otherwise (before any Spark job). Empty: the model has its weights, and
    `folder` must be None."""
    meta = list(weight_keys(model))
    if not meta and not unloadable(model):
        if folder is not None:
            raise ValueError(f"The 'weights_folder' parameter of {owner} ({folder!r}) names the weights of what the "
                             "model factory leaves on the meta device, and the model it built has every weight: "
                             f"drop weights_folder, or {HOW}.")
        return []
    lost = unloadable(model)
    if lost:
        raise ValueError(f"The model built for {owner} has buffers on the meta device that no weights file holds "
                         f"(non-persistent: {', '.join(lost[:3])}{' ...' if len(lost) > 3 else ''}): nothing could "
                         f"give them values. {HOW[0].upper()}{HOW[1:]}.")
    if folder is None:
        raise ValueError(f"The model built for {owner} has {len(meta)} weights on the meta device (no values: "
                         f"{', '.join(meta[:3])}{' ...' if len(meta) > 3 else ''}): name the folder of .safetensors "
                         "files holding them with weights_folder='/path/on/every/executor' (a save_pretrained "
                         "folder), or build the model with its weights (from_pretrained(path)).")
    if not isinstance(folder, str) or "://" in folder or not os.path.isdir(folder):
        raise ValueError(f"The 'weights_folder' parameter of {owner} must be a folder of .safetensors files on the "
                         f"driver's and every executor's file system (e.g. /dbfs/..., a mounted volume); got "
                         f"{folder!r}, which is not a local folder.")
    entries = folder_entries(folder)
    if not entries:
        raise ValueError(f"The 'weights_folder' parameter of {owner} ({folder!r}) holds no {SUFFIX} files: save "
                         "the weights with save_pretrained(folder) or safetensors.torch.save_file.")
    state = model.state_dict(keep_vars=True)
    keys = weight_keys(model, entries)
    missing = [n for n, k in keys.items() if k is None]
    if missing:
        raise ValueError(f"{len(missing)} {weights(len(missing))} the model leaves on the meta device "
                         f"{'is' if len(missing) == 1 else 'are'} not in {folder!r} (by "
                         f"state-dict name, or base_model_prefix as from_pretrained reads them): "
                         f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}. Build those with values in "
                         "the factory (a new head: assign it after the parameters_on_meta block), or save a folder "
                         "that has them.")
    wrong = [f"{k} {entries[k][1]} in the folder, {n} {tuple(state[n].shape)} in the model" if n != k else
             f"{n} {entries[k][1]} in the folder, {tuple(state[n].shape)} in the model"
             for n, k in keys.items() if k is not None and entries[k][1] != tuple(state[n].shape)]
    if wrong:
        more = f" (and {len(wrong) - 3} more)" if len(wrong) > 3 else ""
        raise ValueError(f"{len(wrong)} {weights(len(wrong))} in {folder!r} do not have the model's shapes: "
                         f"{'; '.join(wrong[:3])}{more}.")
    return {n: k for n, k in keys.items() if k is not None}


def found_keys(model: nn.Module, folder: str, entries: "Dict[str, Tuple[str, Tuple[int, ...]]] | None" = None
               ) -> Dict[str, str]:
    """weight_keys of `model` in `folder` as this host sees it, every one found (the driver checked its own folder
    before the job: an executor's may differ)."""
    keys = weight_keys(model, folder_entries(folder) if entries is None else entries)
    lost = [n for n, k in keys.items() if k is None]
    if lost:
        raise ValueError(f"{len(lost)} {weights(len(lost))} the model leaves on the meta device "
                         f"{'is' if len(lost) == 1 else 'are'} not in {folder!r} on "
                         f"{socket.gethostname()}: {', '.join(lost[:5])}{' ...' if len(lost) > 5 else ''} (the "
                         "driver's folder has them): give every executor the same weights_folder.")
    return {n: k for n, k in keys.items() if k is not None}


def weights(count: int) -> str:
    return "weight" if count == 1 else "weights"


def allocated(model: nn.Module) -> None:
    """Each tensor `model` holds on the meta device given memory on the CPU, uninitialized, in place: what a whole
    state_dict is loaded into next (a full fine-tune's run checkpoint, where the factory builds on the meta device
    and weights_folder held the base). Tensors shared by several modules stay shared."""
    _meta_replaced(model, lambda t: torch.empty(t.shape, dtype=t.dtype))


def _meta_replaced(model: nn.Module, value_of: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Each tensor of `model` on the meta device replaced by `value_of(it)`, a parameter by a parameter of its
    class (requires_grad kept), each once: tensors shared by several modules stay shared. In place."""
    made: Dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for key, t in list(table.items()):
                if t is None or not t.is_meta:
                    continue
                if id(t) not in made:
                    value = value_of(t)
                    made[id(t)] = (type(t)(value, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter)
                                   else value)
                table[key] = made[id(t)]


def materialize(model: nn.Module, folder: str, device: "torch.device | str" = "cpu") -> None:
    """The whole model on `device`, in place: each tensor on the meta device replaced by its values from the
    folder (cast to the model's dtype); the others kept. Parameters shared by several modules stay shared."""
    from safetensors import safe_open

    files = folder_entries(folder)
    state = model.state_dict(keep_vars=True)
    names = {id(state[n]): k for n, k in found_keys(model, folder, files).items()}
    with torch.no_grad(), contextlib.ExitStack() as stack:
        opened: Dict[str, Any] = {}  # each file opened once

        def read(t: torch.Tensor) -> torch.Tensor:
            file = files[names[id(t)]][0]
            if file not in opened:
                opened[file] = stack.enter_context(safe_open(os.path.join(folder, file), framework="pt"))
            return opened[file].get_tensor(names[id(t)]).to(device=device, dtype=t.dtype)

        _meta_replaced(model, read)
