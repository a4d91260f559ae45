"""strategy='ddp': every rank holds the whole model, its gradients and the optimizer's state; DistributedDataParallel
averages the gradients (over nccl or gloo, in float16 with gradient_compression, or through shared memory between
the CPU ranks of one host), and one rank trains through `Solo`, which has nothing to average. Rank 0 writes the
checkpoints, the tensors in the file. torch only, no pyspark."""
from __future__ import annotations

import contextlib
import logging
from typing import Any, ClassVar, Dict, Iterator, Mapping, Optional

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from estimator.core.adapters import is_adapted
from estimator.core.meta import materialize
from estimator.core.spec import compile_options
from estimator.train.host_allreduce import HostAllreduce
from estimator.train.precision import precision_of
from estimator.train.strategies.base import Strategy

SOLO = "nothing (one rank)"  # WorkerResult.allreduce of a rank that trains alone
OWNER = "TorchEstimator"
log = logging.getLogger("estimator")


class DDP(Strategy):
    """The whole model on every rank, its gradients averaged by DistributedDataParallel."""

    options: ClassVar[Dict[str, Any]] = {}  # DistributedDataParallel's keyword arguments (bucket_cap_mb...)

    def __init__(self, name: str, spec: Any, ctx: Any, objs: Any):
        super().__init__(name, spec, ctx, objs)
        self.comm: Optional[HostAllreduce] = None  # shared memory's averaging, when the ranks use it
        self.averaging = ""  # how the gradients are averaged, once wrapped

    @classmethod
    def check(cls, name: str, p: Mapping[str, Any]) -> None:
        if p["shard_units"] is not None:
            raise ValueError(f"{OWNER}: shard_units says what strategy='fsdp' shards; with strategy={name!r} nothing "
                             "is sharded. Set strategy='fsdp', or leave shard_units None.")
        if p["reshard_after_forward"] is not True:
            raise ValueError(f"{OWNER}: reshard_after_forward={p['reshard_after_forward']!r} is strategy='fsdp''s "
                             f"choice; with strategy={name!r} nothing is sharded. Set strategy='fsdp', or leave "
                             "reshard_after_forward at True.")

    def place(self, model: nn.Module) -> nn.Module:
        if self.objs.weights_folder:  # what the factory left on the meta device, read whole
            materialize(model, self.objs.weights_folder, self.device)
        if is_adapted(model) and only_autocast_forwards(self.objs):  # before the copy to the device: half of it
            cast = precision_of(self.spec.precision).frozen_linears_cast(model)
            if cast:
                log.debug("rank %d: %d frozen linear tensors kept in %s, autocast's dtype", self.ctx.rank, cast,
                          self.spec.precision)
        return model.to(self.device)

    def wrap(self, model: nn.Module, steps: Optional[nn.Module] = None) -> nn.Module:
        """DistributedDataParallel over the module (compiled with `compile`: the checkpoints save `model`, so they
        hold the plain module's keys; compiling the inner module keeps DDP's hooks outside the graph), or over
        `steps`; for one rank `Solo`. Then the gradients' averaging: in float16, or through shared memory."""
        module = steps if steps is not None else compiled(model, self.spec.compile)
        if self.ctx.world_size == 1:  # DDP's hooks and its allreduce of one rank cost 27% of a small MLP's steps on
            self.averaging = SOLO  # an H100 and change no number
            return Solo(module)
        trained = DistributedDataParallel(module, device_ids=[self.device.index] if self.device.type == "cuda"
                                          else None, **self.options)
        self.averaging = self.ctx.backend
        if self.spec.compression == "fp16":
            trained.register_comm_hook(None, default_hooks.fp16_compress_hook)
            self.averaging = f"{self.ctx.backend} fp16"
        elif self.spec.shared_memory_allreduce and self.device.type == "cpu":
            self.comm = HostAllreduce.connect(self.ctx.rank, self.ctx.world_size, gradient_bytes(model),
                                              self.spec.collective_timeout)
            if self.comm is not None:
                trained.register_comm_hook(None, self.comm.hook)
                self.averaging = "shared memory"
        return trained

    def describe(self) -> str:
        return self.averaging

    def teardown(self, failed: bool) -> None:
        if self.comm is None:
            return
        if failed:
            self.comm.abort()  # the peers stop waiting for this rank in the next allreduce
        self.comm.close()


class Solo(nn.Module):
    """One rank's stand-in for DistributedDataParallel, with the same calls a train_step or train_fn makes:
    call it (its forward is the module's), `.module` (the wrapped module) and `no_sync()`."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield


def only_autocast_forwards(objs: Any) -> bool:
    """Whether every forward of the rank's model runs under the precision's autocast: the built-in loop's objectives
    (their steps, validation, a reference pass, GRPO's sampling: estimator.train.loop), not a train_fn's or a
    train_step's code, nor a LightningModule's hooks, which may call the model as they like."""
    return objs.objective is not None and objs.train_fn is None and objs.train_step is None and not objs.lightning


def compiled(model: nn.Module, setting: Any) -> nn.Module:
    """The module DDP wraps: `model` itself, or with compile=True/kwargs `torch.compile(model)`, which shares
    its parameters."""
    options = compile_options(setting)
    return model if options is None else torch.compile(model, **options)


def gradient_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
