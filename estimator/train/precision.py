"""The `precision` param as one object per value, in the manner of Lightning Fabric's precision plugins: the
forwards' autocast, the backward (a GradScaler's scaled loss for float16), the gradients unscaled before clipping,
the optimizer step, the scaler's state a checkpoint keeps, and FSDP2's mixed-precision policy. The loop
(estimator.train.loop), DPO's reference pass and the sharding ask this object, never the param's string. A new
precision is a class here and a line in PRECISIONS. torch only."""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Optional

import torch


class Precision:
    """precision='32': float32 everywhere, no autocast, no scaler."""

    name = "32"
    autocast_dtype: Optional[torch.dtype] = None  # the forwards' autocast dtype; None: no autocast
    fsdp_param_dtype: Optional[torch.dtype] = None  # what FSDP2 gathers and computes in; None: the parameters'

    def __init__(self, device: torch.device, rank: int = 0, scaler_state: Optional[Dict[str, Any]] = None):
        self.device = device
        self.check(rank)
        self.scaler = self.make_scaler()
        if self.scaler is not None and scaler_state:
            self.scaler.load_state_dict(scaler_state)  # a resumed run's loss scale and growth count

    def check(self, rank: int) -> None:
        """Refuses a device this precision cannot train on (rank: the one that would)."""

    def make_scaler(self) -> Optional[torch.amp.GradScaler]:
        return None

    def autocast(self) -> Any:
        """The context the forwards and the loss run in."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """The gradients as they are, before they are clipped or read."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)  # skipped where the scaled gradients overflowed
        self.scaler.update()

    @classmethod
    def frozen_linears_cast(cls, model: torch.nn.Module) -> int:
        """The frozen weights and biases of `model`'s plain nn.Linear layers (an adapted model's base) stored in the
        autocast dtype, in place: autocast casts them to it at every forward anyway (F.linear is among its
        lower-precision ops, and a frozen weight's cast is not cached), so every number stays the same while they
        take half the memory of float32 and no cast a step. Only where every forward of the model runs under this
        autocast (the built-in loop's, DDP's: estimator.train.strategies.ddp). Not cast: a tensor any other module
        also holds (an embedding tied to the head: its lookup is not autocast's), norms, embeddings, other layer
        types, and whatever trains. Returns the tensors cast."""
        dtype = cls.autocast_dtype
        if dtype is None:
            return 0
        elsewhere = {id(p) for m in model.modules() if type(m) is not torch.nn.Linear
                     for p in m.parameters(recurse=False)}
        cast = 0
        with torch.no_grad():
            for module in model.modules():
                if type(module) is not torch.nn.Linear:
                    continue
                for param in module.parameters(recurse=False):
                    if (not param.requires_grad and param.is_floating_point() and param.dtype != dtype
                            and id(param) not in elsewhere):
                        param.data = param.data.to(dtype)
                        cast += 1
        return cast

    @classmethod
    def fsdp_policy(cls) -> Any:
        """FSDP2's mixed-precision policy: parameters gathered and computed in `fsdp_param_dtype`, gradients reduced
        and the sharded master weights kept in float32 (the loop's autocast still runs the loss in float32)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if cls.fsdp_param_dtype is None:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=cls.fsdp_param_dtype, reduce_dtype=torch.float32)


class BF16Mixed(Precision):
    """precision='bf16-mixed': the forwards and the loss under autocast in bfloat16 (CPU or GPU), float32 weights
    and optimizer; FSDP2 gathers the parameters in bfloat16."""

    name = "bf16-mixed"
    autocast_dtype = torch.bfloat16
    fsdp_param_dtype = torch.bfloat16


class F16Mixed(Precision):
    """precision='16-mixed': autocast in float16 and a GradScaler (CUDA only)."""

    name = "16-mixed"
    autocast_dtype = torch.float16
    devices = ("cuda",)  # where it trains (tests add "cpu": torch has a CPU GradScaler)

    def check(self, rank: int) -> None:
        if self.device.type not in self.devices:
            raise ValueError(f"precision='16-mixed' needs CUDA (float16 autocast with a GradScaler) but rank {rank} "
                             f"trains on {self.device}. Use precision='bf16-mixed' on CPUs, or GPUs.")

    def make_scaler(self) -> Optional[torch.amp.GradScaler]:
        return torch.amp.GradScaler(self.device.type)


PRECISIONS = {cls.name: cls for cls in (Precision, BF16Mixed, F16Mixed)}  # the precision param's values


def precision_of(name: str) -> type:
    """The class of a precision param value (validated by the param: every value is here)."""
    return PRECISIONS[name]
