"""One rank's training, set up: the user's objects unpickled, the model on the rank's device, the optimizer
and the learning-rate schedule, the checkpoint restored (a retry or a refit continues where it stands), the
module compiled and wrapped in DistributedDataParallel with its gradient averaging (nccl, gloo, fp16 or shared
memory); then the epochs (estimator.train.epochs). It runs the same inside a Spark barrier task and in a local
process (tests, LocalLauncher). torch only, no pyspark."""
from __future__ import annotations

import contextlib
import logging
import pickle
import time
from datetime import timedelta
from typing import Any, Iterator, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from estimator.core.faults import Fault
from estimator.core.meta import materialize
from estimator.core.pickling import optimizer_from_factory, rebuild_optimizer
from estimator.core.quiet import hf_bars_off
from estimator.core.spec import TrainSpec, UserObjects, WorkerResult, compile_options
from estimator.data.plan import optimizer_steps
from estimator.data.shards import EarlyRead
from estimator.train import lightning
from estimator.train.checkpoint import format_of, position_of, restore
from estimator.train.distributed import RankContext
from estimator.train.epochs import Run
from estimator.train.host_allreduce import HostAllreduce
from estimator.train.memory import checkpoint_activations
from estimator.train.sharding import Sharded, auto_shards, shard

log = logging.getLogger("estimator")


def train_worker(spec: TrainSpec, ctx: RankContext, faults: Tuple[Fault, ...] = (), attempt: int = 0,
                 early: Optional[EarlyRead] = None) -> WorkerResult:
    """Train this rank; `early` holds its shards when the launcher started opening them already."""
    started = time.perf_counter()
    objs: UserObjects = pickle.loads(spec.payload)
    device = torch.device(ctx.device)
    with torch.random.fork_rng(devices=[]), hf_bars_off():  # the factory's and adapters' draws: the run's seed's
        torch.manual_seed(spec.seed)
        model = objs.module()  # a model_factory builds it here, on the rank (with its adapters: peft_config)
    if spec.gradient_checkpointing:
        log.debug("rank %d: activations recomputed in backward (%s)", ctx.rank,
                  checkpoint_activations(model, objs.shard_units))
    # strategy='fsdp' on one rank: nothing to shard, so the model trains whole as ddp's would (FSDP2's per-unit hooks
    # cost 2-3x on a model that fits), its checkpoints still folders of shards that more ranks resume from
    shard_format = format_of(spec.strategy) == "fsdp"
    sharded = shard_format and (ctx.world_size > 1 or spec.shard_alone)
    chosen = ""
    if spec.strategy == "auto":  # the same decision on every rank (auto_shards reduces over them)
        sharded, chosen = auto_shards(model, device, ctx.world_size)
        chosen = f"strategy='auto': {chosen}"
        if ctx.rank == 0:
            log.info("%s", chosen)
    if not sharded:  # fsdp: shard reads each rank's shards of what is on the meta device, and moves the rest
        if objs.weights_folder:
            materialize(model, objs.weights_folder, device)
        model = model.to(device)
    else:
        if ctx.shared_gpus:
            raise ValueError(f"strategy='fsdp' needs a GPU per rank, but rank {ctx.rank} shares {ctx.device} with "
                             "other ranks (spark.task.resource.gpu.amount < 1): nccl refuses two ranks on one GPU. "
                             "Give each task a whole GPU, or use strategy='ddp'.")
        units = shard(model, objs.shard_units, spec.precision, device, ctx.world_size, objs.lightning,
                      objs.weights_folder, spec.compile, spec.reshard_after_forward)
        log.debug("rank %d: %d units sharded", ctx.rank, units)
    trainer = lightning.attach(model, lightning.StandInTrainer(ctx.rank, ctx.world_size, ctx.local_rank, spec.epochs,
                                                               run_optimizer_steps(spec, ctx.world_size))
                               ) if objs.lightning else None
    optimizer, scheduler, scheduler_monitor, interval = optimization(objs, model)  # over the shards, with fsdp
    # a retry or a refit of this run_id: continue where the checkpoint stands (the optimizer's state loaded after
    # the scheduler's constructor reset the lr)
    state = restore(spec.data.store, spec.run, spec.resume_from, model, optimizer, device) if spec.resume_from else None
    if state is not None and scheduler is not None and state.get("lr_scheduler") is not None:
        scheduler.load_state_dict(state["lr_scheduler"])
    history = [dict(row) for row in state["history"]] if state is not None else []
    # A LightningModule's training_step runs inside DDP's forward (LightningSteps), as a module's forward would.
    wrapped = (lightning.LightningSteps(model) if objs.lightning  # fsdp: shard compiled the units
               else model if sharded else compiled(model, spec.compile))
    comm, allreduce, shard_group = None, ctx.backend, None
    if sharded:
        ddp: nn.Module = Sharded(model, wrapped)
        allreduce = (f"{ctx.backend} reduce-scatter (fsdp: model, gradients and optimizer state in "
                     f"{ctx.world_size} shards)")
    else:
        ddp = wrap(wrapped, device, ctx.world_size)
    if shard_format:  # the checkpoints' own group: DCP writes over it while training goes on over the default one
        shard_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=spec.collective_timeout))
    if isinstance(ddp, Solo):
        allreduce = SOLO  # one rank: no gradients to average, nor to compress
    elif not sharded and spec.compression == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        allreduce = f"{ctx.backend} fp16"
    elif not sharded and spec.shared_memory_allreduce and device.type == "cpu":
        comm = HostAllreduce.connect(ctx.rank, ctx.world_size, gradient_bytes(model), spec.collective_timeout)
        if comm is not None:
            ddp.register_comm_hook(None, comm.hook)
            allreduce = "shared memory"
    if chosen:
        allreduce = f"{allreduce}; {chosen}"
    try:
        run = Run(spec, ctx, objs, model, ddp, optimizer, scheduler, history, faults, attempt, trainer)
        run.scheduler_monitor, run.scheduler_interval, run.shard_group = scheduler_monitor, interval, shard_group
        if scheduler is not None and interval == "step":  # OneCycleLR and the like: after every optimizer step
            run.loop.after_step = scheduler.step
        if state is not None and state.get("grad_scaler") and run.loop.scaler is not None:
            run.loop.scaler.load_state_dict(state["grad_scaler"])
        run.restored_extra = dict(state.get("extra") or {}) if state is not None else {}
        return run.train(position_of(state), started, allreduce, early)
    except BaseException:
        if comm is not None:
            comm.abort()  # the peers stop waiting for this rank in the next allreduce
        raise
    finally:
        if comm is not None:
            comm.close()


SOLO = "nothing (one rank)"  # WorkerResult.allreduce of a rank that trains alone


def wrap(module: nn.Module, device: torch.device, world_size: int) -> nn.Module:
    """What the loop trains through: DistributedDataParallel, whose hooks average the gradients over the ranks,
    or for one rank `Solo`, which has nothing to average (DDP's hooks and its allreduce of one rank cost 27% of
    a small MLP's steps on an H100 and change no number)."""
    if world_size == 1:
        return Solo(module)
    return DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None)


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


def compiled(model: nn.Module, setting: Any) -> nn.Module:
    """The module DDP wraps: `model` itself, or with compile=True/kwargs `torch.compile(model)`, which shares
    its parameters (the checkpoints save `model`, so they hold the plain module's keys). Compiling the inner
    module, not the DDP wrapper, keeps DDP's gradient hooks (and the shared-memory averaging) outside the
    compiled graph."""
    options = compile_options(setting)
    return model if options is None else torch.compile(model, **options)


def gradient_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def optimization(objs: UserObjects, model: nn.Module) -> Tuple[torch.optim.Optimizer, Any, Optional[str], str]:
    """The optimizer, the learning-rate scheduler (or None), what a ReduceLROnPlateau steps on (None: val_loss,
    else loss) and when the scheduler steps ('epoch', or 'step': after every optimizer step): a LightningModule's
    configure_optimizers(), or the user's optimizer and lr_scheduler_fn (a scheduler, or Lightning's dict form
    {'scheduler': ..., 'interval': 'step'})."""
    if objs.lightning:
        optimizer, scheduler, monitor, interval = lightning.optimizers_of(model)
    else:
        optimizer, scheduler, monitor, interval = build_optimizer(objs, model), None, None, "epoch"
    if scheduler is None and objs.lr_scheduler_fn is not None:
        scheduler, monitor, interval = lightning.scheduler_config(objs.lr_scheduler_fn(optimizer), "lr_scheduler_fn")
    return optimizer, scheduler, monitor, interval


def run_optimizer_steps(spec: TrainSpec, world_size: int) -> int:
    """The run's optimizer steps, as the driver counted them (the direct mode: over the largest shard)."""
    total = spec.data.train_rows if spec.data.local is None else spec.data.largest_shard * world_size
    return optimizer_steps(total, world_size, spec.batch_size, spec.train_steps_per_epoch, spec.drop_last,
                           spec.backward_passes_per_step, spec.epochs)


def build_optimizer(objs: UserObjects, model: nn.Module) -> torch.optim.Optimizer:
    """The user's optimizer rebuilt over this rank's model: same class, groups, hyperparams, state; or the
    optimizer param's callable called with this rank's parameters."""
    if objs.optimizer_factory is not None:
        return optimizer_from_factory(objs.optimizer_factory, model, objs.optimizer_lr)
    return rebuild_optimizer(objs.optimizer_cls, objs.optimizer_groups, objs.optimizer_defaults,
                             objs.optimizer_state, model)
