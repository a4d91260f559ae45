"""FSDP2's mechanics on a rank, for the strategies that shard (estimator.train.strategies.fsdp): the model's units
sharded over the ranks (torch.distributed.fsdp's fully_shard: every parameter a DTensor holding 1/N of it, gathered
whole only for its unit's forward and backward; gradients reduce-scattered, so each rank's optimizer steps and
keeps state for its own shards), and whether sharding pays (strategy='auto'). Checkpoints:
estimator.train.sharded_checkpoint. torch only, no pyspark."""
from __future__ import annotations

import uuid
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from estimator.core.adapters import is_adapted
from estimator.core.meta import found_keys
from estimator.core.spec import compile_options
from estimator.train.precision import precision_of

DEFAULT_UNITS = "the items of every nn.ModuleList (a transformer's blocks), then the whole model"
# A LightningModule's steps call its submodules (or self(...)) from these methods, not only from forward.
LIGHTNING_METHODS = ("training_step", "validation_step", "predict_step")


def unit_modules(model: nn.Module, rule: Any = None) -> List[nn.Module]:
    """The submodules sharded as units besides the whole model, children before the modules that hold them
    (fully_shard's order). `rule`: None (DEFAULT_UNITS), a list of module classes, or a callable(module) -> bool.
    Modules without parameters of their own or below them are left to their parent."""
    if rule is None:
        chosen = {id(item) for holder in model.modules() if isinstance(holder, nn.ModuleList) for item in holder}
        picked = lambda m: id(m) in chosen  # noqa: E731
    elif isinstance(rule, (list, tuple, set, frozenset)):
        classes = tuple(rule)
        picked = lambda m: isinstance(m, classes)  # noqa: E731
    else:
        picked = lambda m: bool(rule(m))  # noqa: E731
    return [m for m in reversed(list(model.modules()))
            if m is not model and picked(m) and any(True for _ in m.parameters())]


def shard(model: nn.Module, rule: Any, precision: str, device: torch.device, world_size: int,
          lightning: bool = False, weights_folder: Optional[str] = None, compile_setting: Any = False,
          reshard_after_forward: bool = True) -> int:
    """fully_shard every unit of `model`, then `model` itself (in place: its class becomes an FSDPModule), over
    all ranks of the process group, from rank 0's values (as DDP starts). What the model has on the meta device
    is read from `weights_folder`, each rank its own shards only (estimator.core.meta). `compile_setting` (the
    compile param: True or torch.compile's keyword arguments): each unit is compiled before it is sharded, as
    PyTorch compiles a sharded model (FSDP's hooks stay outside the compiled graphs); the root's own layers run
    eagerly, unless the model has no other unit (then it is compiled whole). `reshard_after_forward`: FSDP2's, for
    the units (the whole model's parameters stay gathered for the backward that follows its forward). Returns the
    number of units, the whole model included."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    meta = found_keys(model, weights_folder) if weights_folder else {}
    with torch.no_grad():  # what has values, on the device; then rank 0's everywhere (fully_shard keeps each
        for t in _valued(model, device):  # rank's slice of its own values: a factory's random head would mix)
            dist.broadcast(t, src=0)
    if meta:  # to_empty below replaces every tensor: what has values is put back after it
        kept = {n: t.detach().clone() for n, t in model.state_dict().items() if not t.is_meta}
        buffers = [(m, k, b) for m in model.modules() for k, b in m._buffers.items() if b is not None]
    # The ranks' device, not the one guessed from the host. Named anew for every sharding: Spark reuses its Python
    # workers, DTensor caches each op's output spec per input specs, and a mesh equals any other of its shape and
    # names whatever this process's rank in it was - an earlier fit's cache would give this fit's DTensors that
    # fit's mesh, and so that rank's offsets (seen: a head's bias checkpointed with its halves swapped).
    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=(f"ranks-{uuid.uuid4().hex[:12]}",))
    policy = precision_of(precision).fsdp_policy()
    if policy.param_dtype is not None and is_adapted(model):
        frozen_in(model, policy.param_dtype)
    units = unit_modules(model, rule)
    options = compile_options(compile_setting)
    for unit in units:
        if options is not None:
            unit.compile(**options)  # in place: the state dict keeps its names
        fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    if options is not None and not units:
        model.compile(**options)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if meta:
        _read_shards(model, meta, weights_folder, device, kept, buffers)
    # the whole model's own methods that run forwards go through its hooks as forward does: a LightningModule's
    # steps, and generate (a first call then initializes the root, not the first unit it reaches; an objective's
    # prepare samples through it inside Strategy.generation, where the units stay gathered)
    for method in (*LIGHTNING_METHODS, "generate") if lightning else ("generate",):
        if callable(getattr(model, method, None)):
            register_fsdp_forward_method(model, method)
    return len(units) + 1


AUTO_SHARE = 0.5  # strategy='auto' shards when the training state would take more than this share of a GPU


def auto_shards(model: nn.Module, device: torch.device, world_size: int) -> Tuple[bool, str]:
    """strategy='auto': (shard?, why). Sharded when the model's trainable parameters with their gradients and
    Adam's two states (4 times their bytes), and its frozen ones, would take more than AUTO_SHARE of the smallest
    GPU among the ranks (an all_reduce: every rank decides alike; activations need the rest). One rank, or CPU
    ranks (host memory, not a GPU's, holds their state): the whole model, as with ddp."""
    held = sum(p.numel() * p.element_size() * (4 if p.requires_grad else 1) for p in model.parameters())
    if world_size == 1 or device.type != "cuda":
        return False, ("one rank has nothing to shard" if world_size == 1 else "CPU ranks") + \
            f": the whole model on every rank ({held / 2**30:.2f} GiB of parameters, gradients and Adam's state)"
    import torch.distributed as dist

    smallest = torch.tensor([float(torch.cuda.get_device_properties(device).total_memory)], device=device)
    dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
    share = held / float(smallest)
    return share > AUTO_SHARE, (f"parameters, gradients and Adam's state take {held / 2**30:.2f} GiB, {share:.0%} of "
                                f"the smallest GPU's {float(smallest) / 2**30:.0f} GiB: "
                                + ("sharded over the ranks" if share > AUTO_SHARE else "the whole model on every rank"))


def frozen_in(model: nn.Module, dtype: torch.dtype) -> int:
    """An adapted model's frozen floating parameters (the base's) cast to `dtype`, before sharding: what its units
    gather and compute in anyway under the mixed-precision policy, so no number changes and the frozen shards take
    half the memory of float32. The trainable ones (the adapters) stay float32: the optimizer steps on them, and
    FSDP2 asks one dtype of a unit's trainable parameters only. Nothing frozen is checkpointed (the adapters'
    checkpoints hold the trainable parameters) or returned: the TorchModel's base comes from the factory. Returns the
    parameters cast."""
    cast = 0
    with torch.no_grad():
        for param in model.parameters():
            if not param.requires_grad and param.is_floating_point() and param.dtype != dtype:
                param.data = param.data.to(dtype)
                cast += 1
    return cast


def _valued(model: nn.Module, device: torch.device) -> List[torch.Tensor]:
    """The tensors of `model` that are not on the meta device, moved to `device` in place (a parameter keeps its
    identity, so modules sharing it still do); each once."""
    seen: Dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for key, t in table.items():
                if t is None or t.is_meta:
                    continue
                if id(t) not in seen:
                    if isinstance(t, nn.Parameter):
                        t.data = t.data.to(device)
                        seen[id(t)] = t
                    else:
                        seen[id(t)] = t.to(device)
                table[key] = seen[id(t)]
    return [t.data if isinstance(t, nn.Parameter) else t for t in seen.values()]


def _read_shards(model: nn.Module, meta: Dict[str, str], folder: str, device: torch.device,
                 kept: Dict[str, torch.Tensor], buffers: list) -> None:
    """The sharded model's tensors on the device (to_empty), each rank's shards of the meta ones read from the
    folder's .safetensors files (DCP's HuggingFaceStorageReader reads a slice per shard), the others put back."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader, load
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    model.to_empty(device=device)
    for module, key, value in buffers:  # buffers are not sharded: the same tensors, values and all
        if not value.is_meta:
            module._buffers[key] = value
    state = get_model_state_dict(model)  # this rank's shards (DTensors), in place
    load({key: state[name] for name, key in meta.items()}, storage_reader=HuggingFaceStorageReader(folder))
    if kept:  # whole on every rank (rank 0's): each keeps its slice
        set_model_state_dict(model, kept, options=StateDictOptions(full_state_dict=True, strict=False))
