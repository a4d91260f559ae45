"""strategy='fsdp''s checkpoints: every rank writes its own shards of the model and of the optimizer's state with
torch.distributed.checkpoint (DCP) into a folder of the run (runs/<run_id>/sharded/<tag>: one file per rank and
the folder's .metadata), then rank 0 writes the run's checkpoint file as for DDP, holding the history, the
position, the schedule's state and that folder's name instead of the tensors: a reader sees the old checkpoint
or the new one, never half of one. Loading reshards: a folder written by 2 ranks loads on 1 or 4 ranks, and into
the driver's plain module (the TorchModel). torch only, no pyspark."""
from __future__ import annotations

import math
import os
import posixpath
import warnings
from concurrent.futures import Future
from typing import Any, Dict, Iterable, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from estimator.core.adapters import is_adapted

SHARDED = "sharded"  # the checkpoint file's key naming its folder of shards (in the run's sharded/ folder)


def folder(run: Any, tag: str) -> str:
    return posixpath.join(run.root, SHARDED, tag)


def storage_writer(store: Any, path: str) -> Any:
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    if store.is_local:
        return FileSystemWriter(path)
    return FsspecWriter(store.url(path), **store.storage_options)


def storage_reader(store: Any, path: str) -> Any:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    if store.is_local:
        return FileSystemReader(path)
    return FsspecReader(store.url(path), **store.storage_options)


def shard_states(model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> Dict[str, Any]:
    """This rank's shards (a plain module's whole tensors on the driver), keyed by parameter name: what DCP writes,
    and the template it loads into (the optimizer's state created first when it has none yet)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    # a model with adapters: its trainable parameters only (the frozen base comes from the model's factory)
    states = {"model": get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=is_adapted(model)))}
    if optimizer is not None:
        states["optimizer"] = get_optimizer_state_dict(model, optimizer)
    return states


def save_shards(store: Any, path: str, model: nn.Module, optimizer: torch.optim.Optimizer, group: Any,
                background: bool) -> Optional[Future]:
    """Every rank calls this at the same step. In the background: the shards copied to the CPU now, written by
    DCP's thread over `group` (a gloo group of its own: training's collectives go on meanwhile); the Future ends
    when every rank's file and the folder's metadata are written. In the foreground: written when this returns."""
    import torch.distributed.checkpoint as dcp

    states = shard_states(model, optimizer)
    if background:
        return dcp.async_save(states, storage_writer=storage_writer(store, path), process_group=group)
    dcp.save(states, storage_writer=storage_writer(store, path), process_group=group)
    return None


def load_shards(store: Any, path: str, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
    """The folder's shards loaded into `model` (sharded over this launch's ranks, or a plain module where no
    process group is up) and into `optimizer`'s state: DCP reads each rank's part, whatever rank count wrote it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    from torch.distributed.checkpoint.api import CheckpointException

    states = shard_states(model, optimizer)
    try:
        with warnings.catch_warnings():  # DCP warns whenever it loads without a process group: the driver's way
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(states, storage_reader=storage_reader(store, path), no_dist=not dist.is_initialized())
    except CheckpointException as exc:  # a BaseException holding each rank's: the first one's cause, as an error
        first = next(iter(exc.failures.values()), exc)
        cause = first[0] if isinstance(first, tuple) else getattr(first, "exc", first)
        raise RuntimeError(f"the checkpoint's shards at {store.url(path)} do not fit this model: "
                           f"{str(cause).splitlines()[0]}") from None
    set_model_state_dict(model, states["model"], options=StateDictOptions(strict=not is_adapted(model)))
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, states["optimizer"])


def mapped_shards(store: Any, path: str, optimizer: bool = True
                  ) -> Tuple[Dict[str, torch.Tensor], Optional[Dict[str, Any]]]:
    """(the model's state_dict, the optimizer's state by parameter name: "state" and "param_groups" as
    torch.distributed.checkpoint.state_dict's optimizer state; None without `optimizer`) of the folder of a model
    trained whole, read into files of a temporary folder and mapped from them: what it holds is the page cache's,
    not this process's memory (a save of a model too large for the driver). The folder goes when this returns;
    its files stay while their tensors live."""
    import tempfile

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = storage_reader(store, path)
    entries = reader.read_metadata().state_dict_metadata
    flat: Dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="spark-torch-estimator-shards-") as local:
        for i, (key, entry) in enumerate(entries.items()):
            if not optimizer and not key.startswith("model."):
                continue
            if isinstance(entry, TensorStorageMetadata):
                size, dtype = tuple(entry.size), entry.properties.dtype
                flat[key] = torch.from_file(os.path.join(local, str(i)), shared=True, size=max(1, math.prod(size)),
                                            dtype=dtype).reshape(size)
            else:  # a group's hyperparameter, or its list of parameter names: read as a value
                flat[key] = None
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(flat, storage_reader=reader, no_dist=True)
    model = {key[len("model."):]: value for key, value in flat.items() if key.startswith("model.")}
    if not optimizer:
        return model, None
    state: Dict[str, Dict[str, Any]] = {}
    groups: Dict[int, Dict[str, Any]] = {}
    for key, value in flat.items():
        if key.startswith("optimizer.state."):
            name, _, entry = key[len("optimizer.state."):].rpartition(".")
            state.setdefault(name, {})[entry] = value
        elif key.startswith("optimizer.param_groups."):
            index, _, entry = key[len("optimizer.param_groups."):].partition(".")
            groups.setdefault(int(index), {})[entry] = value
    return model, {"state": state, "param_groups": [groups[i] for i in sorted(groups)]}


def remove_unused(store: Any, run: Any, keep: Iterable[str]) -> None:
    """Rank 0, after its checkpoint file is written: the shard folders no checkpoint names any more (an older
    epoch's, a best epoch that left the top k, one a failed launch left half written)."""
    root = posixpath.join(run.root, SHARDED)
    names = set(keep)
    for path in store.ls(root) if store.exists(root) else []:
        if posixpath.basename(path.rstrip("/")) not in names:
            store.rm(path)
