"""strategy='fsdp': the model's units sharded over the ranks with FSDP2 (estimator.train.sharding: parameters,
gradients and optimizer state each held 1/N per rank), trained through `Sharded`; validation in lockstep (a
sharded forward is a collective); every rank writes its own shards of each checkpoint (DCP, over a gloo group of
its own: estimator.train.sharded_checkpoint), then rank 0 the file naming their folder. On one rank nothing is
sharded: the model trains whole, as with ddp (FSDP2's per-unit hooks cost 2-3x on a model that fits), and its
checkpoints are still folders of shards that more ranks resume from. torch only, no pyspark."""
from __future__ import annotations

import contextlib
import logging
from datetime import timedelta
from typing import Any, Iterable, Iterator, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from estimator.core.adapters import is_adapted
from estimator.core.recipe import quantization_of
from estimator.train.checkpoint import TRAINABLE
from estimator.train.sharded_checkpoint import SHARDED, folder, remove_unused, save_shards
from estimator.train.sharding import shard
from estimator.train.strategies.base import CheckpointAt, ModelState
from estimator.train.strategies.ddp import DDP

log = logging.getLogger("estimator")
OWNER = "TorchEstimator"
PAGE = "docs/gpus.md 'Shard a large model'"


class FSDP(DDP):
    """Sharded over the ranks (whole on one rank, as ddp), checkpointed in shards."""

    shards_checkpoints = True

    def __init__(self, name: str, spec: Any, ctx: Any, objs: Any):
        super().__init__(name, spec, ctx, objs)
        self.sharded = False  # decided by `place`
        self.group: Any = None  # the gloo group DCP writes the shards over while training goes on over the default
        self.stand_in: Any = None  # a training batch a rank out of validation batches forwards again (lockstep)

    @classmethod
    def check(cls, name: str, p: Mapping[str, Any]) -> None:
        refused = {
            "precision": (p["precision"] == "16-mixed", "float16 with a GradScaler is DDP's; FSDP2 trains in "
                          "precision='bf16-mixed' (bfloat16 compute, float32 reduction and master weights)"),
            "gradient_compression": (getattr(p["gradient_compression"], "name", p["gradient_compression"])
                                     not in (None, "none"), "FSDP reduce-scatters the gradients itself; "
                                     "precision='bf16-mixed' halves what it gathers"),
        }
        for param, (bad, why) in refused.items():
            if bad:
                raise ValueError(f"{OWNER} with strategy={name!r} takes no {param}={p[param]!r}: {why} ({PAGE}).")
        if quantization_of(p.get("model_factory")) is not None:
            raise ValueError(f"{OWNER} with strategy={name!r}: the model factory loads its base quantized "
                             "(quantization_config), whose packed 4- or 8-bit weights and their quantization state "
                             "FSDP2 does not shard here. Use strategy='ddp': the quantized base is frozen, and each "
                             "rank holds it whole (an 8B model in 4 bits: about 5 GB).")
        model, optimizer = p["model"], p["optimizer"]
        if not any(True for _ in model.parameters()):
            raise ValueError(f"{OWNER} with strategy={name!r}: the model {type(model).__name__} has no parameters to "
                             "shard. Use strategy='ddp'.")
        if isinstance(optimizer, torch.optim.Optimizer) and optimizer.state:
            raise ValueError(f"{OWNER} with strategy={name!r} builds the optimizer over each rank's shards, and the "
                             f"optimizer given ({type(optimizer).__name__}) has taken steps already: its state cannot "
                             "be dealt to the shards. Pass a new optimizer, or functools.partial(torch.optim.AdamW, "
                             "lr=...), to continue a run, refit its run_id.")

    @classmethod
    def check_gpus(cls, name: str, p: Mapping[str, Any], gpus_per_task: float) -> None:
        """Tasks given a fraction of a GPU share it: nccl refuses two ranks on one device, and fsdp is not served
        over gloo on GPUs here (the ranks would refuse it after the rendezvous; refused here first)."""
        if 0 < gpus_per_task < 1 and p["use_gpu"] is not False:
            raise ValueError(f"{OWNER} with strategy={name!r} needs a GPU per rank; spark.task.resource.gpu.amount="
                             f"{gpus_per_task:g} puts several tasks on one GPU. Give each task a whole GPU, set "
                             f"use_gpu=False, or use strategy='ddp' ({PAGE}).")

    def shards(self, model: nn.Module) -> bool:
        """Whether the model is sharded: on more than one rank (or alone, for the GPU suite's FSDP2 on one GPU)."""
        return self.ctx.world_size > 1 or self.spec.shard_alone

    def place(self, model: nn.Module) -> nn.Module:
        self.sharded = self.shards(model)
        self.lockstep = self.sharded and self.ctx.world_size > 1
        if not self.sharded:
            placed = super().place(model)
        else:
            if self.ctx.shared_gpus:
                raise ValueError(f"strategy={self.name!r} needs a GPU per rank, but rank {self.ctx.rank} shares "
                                 f"{self.ctx.device} with other ranks (spark.task.resource.gpu.amount < 1): nccl "
                                 "refuses two ranks on one GPU. Give each task a whole GPU, or use strategy='ddp'.")
            # the meta device's tensors: each rank reads its own shards from weights_folder
            units = shard(model, self.objs.shard_units, self.spec.precision, self.device, self.ctx.world_size,
                          self.objs.lightning, self.objs.weights_folder, self.spec.compile,
                          self.spec.reshard_after_forward)
            log.debug("rank %d: %d units sharded", self.ctx.rank, units)
            placed = model
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.spec.collective_timeout))
        return placed

    def wrap(self, model: nn.Module, steps: Optional[nn.Module] = None) -> nn.Module:
        if not self.sharded:
            return super().wrap(model, steps)
        self.averaging = (f"{self.ctx.backend} reduce-scatter (fsdp: model, gradients and optimizer state in "
                          f"{self.ctx.world_size} shards)")
        return Sharded(model, steps)  # the units were compiled as they were sharded

    def gradients(self, trained: nn.Module) -> List[torch.Tensor]:
        return [getattr(p.grad, "_local_tensor", p.grad)  # this rank's shard of a DTensor
                for p in trained.parameters() if p.grad is not None]

    @contextlib.contextmanager
    def generation(self, trained: nn.Module) -> Iterator[nn.Module]:
        """Sharded: every unit's parameters gathered once (the ranks together, in the modules' order) and kept
        gathered through the forwards: no all-gather per generated token (21 for 10 tokens of a 2-layer model
        otherwise); resharded after, each unit's reshard_after_forward as it was sharded (the root's False)."""
        if not self.sharded:
            with super().generation(trained) as module:
                yield module
            return
        from torch.distributed.fsdp import FSDPModule

        root = trained.module
        units = [m for m in root.modules() if isinstance(m, FSDPModule)]
        with super().generation(trained) as module:
            for unit in units:
                unit.unshard()
                unit.set_reshard_after_forward(False, recurse=False)
            try:
                yield module
            finally:
                for unit in units:
                    unit.reshard()
                    unit.set_reshard_after_forward(unit is not root and self.spec.reshard_after_forward,
                                                   recurse=False)

    def remember(self, batch: Any) -> None:
        if self.lockstep and self.stand_in is None:
            self.stand_in = batch

    def validation(self, batches: Iterable[Any]) -> Iterator[Tuple[Any, bool]]:
        """(batch, whether it is this rank's) until no rank has a batch left: one small all_reduce per batch; a
        rank out of batches forwards its last one again (or its first training batch), its numbers dropped."""
        if not self.lockstep:
            yield from super().validation(batches)
            return
        iterator, last = iter(batches), self.stand_in
        while True:
            batch = next(iterator, None)
            more = torch.tensor([0 if batch is None else 1], device=self.device)
            dist.all_reduce(more, op=dist.ReduceOp.MAX)
            if not int(more.item()):
                return
            last = batch if batch is not None else last
            yield last, batch is not None

    def writes_checkpoints(self) -> bool:
        return True  # every rank its shards; rank 0 then the file

    def model_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, at: CheckpointAt) -> ModelState:
        """A folder of shards named by the step, the launch and the attempt. In the background: written by DCP's
        thread (one DCP write at a time over the group), the shards copied to the CPU here; else in the writer's
        turn."""
        tag = f"step-{at.global_step}-{at.launch_id}-{at.attempt}"
        path = folder(at.run, tag)
        if at.writer.background:
            at.writer.wait()
            pending = save_shards(at.store, path, model, optimizer, self.group, background=True)
            write = pending.result  # every rank's shards and the folder's metadata are written
        else:
            def write() -> None:
                save_shards(at.store, path, model, optimizer, self.group, background=False)
        entries = {SHARDED: tag, "strategy": self.writes_as or self.name}
        if is_adapted(model):  # the adapters only: the frozen base comes from the model's factory
            entries["contents"] = TRAINABLE
        return ModelState(entries, write, tag)

    def keep_folders(self, store: Any, run: Any, named: Iterable[Optional[str]]) -> None:
        remove_unused(store, run, {n for n in named if n})


class Sharded(nn.Module):
    """What the loop trains through for strategy='fsdp', with the calls a train_step or train_fn makes on DDP:
    call it (the sharded module's forward), `.module` (the sharded module) and `no_sync()` (gradients accumulate
    whole on each rank; the batch after it reduce-scatters the sum, as DDP's allreduce does). `steps`: what a
    call runs, when not the module's forward (a LightningModule's training_step, estimator.train.lightning)."""

    def __init__(self, module: nn.Module, steps: Optional[nn.Module] = None):
        super().__init__()
        self.module = module
        self.steps = steps if steps is not None and steps is not module else None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return (self.module if self.steps is None else self.steps)(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)
