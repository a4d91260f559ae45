"""One rank's training, set up: the user's objects unpickled, the model built, placed and wrapped by the fit's
strategy (estimator.train.strategies: on the rank's device or sharded, DistributedDataParallel or its stand-ins),
the optimizer and the learning-rate schedule, the checkpoint restored (a retry or a refit continues where it
stands); then the epochs (estimator.train.epochs), over objects built whole here. It runs the same inside a Spark
barrier task and in a local process (tests, LocalLauncher). torch only, no pyspark."""
from __future__ import annotations

import dataclasses
import logging
import pickle
import time
from typing import Any, Optional, Tuple

import torch
from torch import nn

from estimator.core.faults import Fault
from estimator.core.pickling import optimizer_from_factory, rebuild_optimizer
from estimator.core.spec import TrainSpec, UserObjects, WorkerResult
from estimator.data.plan import optimizer_steps
from estimator.data.shards import EarlyRead
from estimator.train import lightning
from estimator.train.checkpoint import position_of
from estimator.train.distributed import RankContext
from estimator.train.epochs import Run
from estimator.train.rank import Rank, Resumed, Schedule
from estimator.train.schedules import built_in_schedule
from estimator.train.memory import checkpoint_activations
from estimator.lm.packed_attention import use_packed_attention
from estimator.train.strategies import STRATEGIES, Strategy

log = logging.getLogger("estimator")


def train_worker(spec: TrainSpec, ctx: RankContext, faults: Tuple[Fault, ...] = (), attempt: int = 0,
                 early: Optional[EarlyRead] = None) -> WorkerResult:
    """Train this rank; `early` holds its shards when the launcher started opening them already."""
    started = time.perf_counter()
    objs: UserObjects = pickle.loads(spec.payload)
    model = objs.module(spec.seed)  # a model_factory builds it here, on the rank (with its adapters: peft_config)
    if spec.gradient_checkpointing:
        log.debug("rank %d: activations recomputed in backward (%s)", ctx.rank,
                  checkpoint_activations(model, objs.shard_units, spec.gradient_checkpointing))
    strategy: Strategy = (objs.strategy or STRATEGIES[spec.strategy])(spec.strategy, spec, ctx, objs)
    with strategy.failing():
        model = strategy.place(model)  # on the device, or sharded (each rank reading its shards of the weights)
        if spec.data.lm is not None and spec.data.lm.packed:  # batches of rows in one sequence: whatever the
            use_packed_attention(model)  # objective, each row attends to itself only (before any forward)
        trainer = lightning.attach(model, lightning.StandInTrainer(ctx.rank, ctx.world_size, ctx.local_rank,
                                                                   spec.epochs, run_optimizer_steps(spec, ctx.world_size))
                                   ) if objs.lightning else None
        optimizer, schedule = optimization(objs, model, spec, ctx.world_size)  # over the shards, with fsdp
        preparing = time.perf_counter()
        if objs.objective is not None:  # e.g. DPO's reference log-probabilities, from the weights as built
            objs.objective.before_training(spec, ctx, objs, model)
        prepared = time.perf_counter() - preparing
        # a retry or a refit of this run_id: continue where the checkpoint stands (the optimizer's state loaded
        # after the scheduler's constructor reset the lr)
        resumed = resume(spec, strategy, model, optimizer, schedule)
        # A LightningModule's training_step runs inside DDP's forward (LightningSteps), as a module's forward would.
        trained = strategy.wrap(model, lightning.LightningSteps(model) if objs.lightning else None)
        rank = Rank(spec, ctx, objs, strategy, model, trained, optimizer, schedule, resumed, trainer)
        return dataclasses.replace(Run(rank, faults, attempt).train(started, early), objective_setup_seconds=prepared)


def resume(spec: TrainSpec, strategy: Strategy, model: nn.Module, optimizer: torch.optim.Optimizer,
           schedule: Schedule) -> Resumed:
    """What the run's checkpoint restores (nothing without one): the model's and the optimizer's state loaded, the
    scheduler's, and the history, the position, train_fn's objects and 16-mixed's loss scale to continue from."""
    if not spec.resume_from:
        return Resumed()
    state = strategy.restore(spec.data.store, spec.run, spec.resume_from, model, optimizer)
    if schedule.scheduler is not None and state.get("lr_scheduler") is not None:
        schedule.scheduler.load_state_dict(state["lr_scheduler"])
    return Resumed(tuple(dict(row) for row in state["history"]), position_of(state), dict(state.get("extra") or {}),
                   state.get("grad_scaler"))


def optimization(objs: UserObjects, model: nn.Module, spec: Optional[TrainSpec] = None, world_size: int = 1
                 ) -> Tuple[torch.optim.Optimizer, Schedule]:
    """The optimizer and its schedule: the learning-rate scheduler (or None), what a ReduceLROnPlateau steps on
    (None: val_loss, else loss) and when the scheduler steps ('epoch', or 'step': after every optimizer step): a
    LightningModule's configure_optimizers(), or the user's optimizer and lr_scheduler_fn (a scheduler, or
    Lightning's dict form {'scheduler': ..., 'interval': 'step'})."""
    if objs.lightning:
        optimizer, scheduler, monitor, interval = lightning.optimizers_of(model)
    else:
        optimizer, scheduler, monitor, interval = build_optimizer(objs, model), None, None, "epoch"
    if scheduler is None and objs.lr_scheduler_fn is not None:
        scheduler, monitor, interval = lightning.scheduler_config(objs.lr_scheduler_fn(optimizer), "lr_scheduler_fn")
    if scheduler is None and spec is not None:  # lr_schedule (its conflicts are refused on the driver)
        scheduler = built_in_schedule(optimizer, spec.lr_schedule, spec.warmup_steps, spec.warmup_ratio,
                                      run_optimizer_steps(spec, world_size, objs.objective))
        interval, reports = "step", scheduler is not None
        return optimizer, Schedule(scheduler, monitor, interval, reports_lr=reports)
    return optimizer, Schedule(scheduler, monitor, interval)


def run_optimizer_steps(spec: TrainSpec, world_size: int, objective: Any = None) -> int:
    """The run's optimizer steps, as the driver counted them (the direct mode: over the largest shard), times the
    objective's steps on each batch (GRPO's num_iterations)."""
    total = spec.data.train_rows if spec.data.local is None else spec.data.largest_shard * world_size
    return optimizer_steps(total, world_size, spec.batch_size, spec.train_steps_per_epoch, spec.drop_last,
                           spec.backward_passes_per_step, spec.epochs) * getattr(objective, "iterations", 1)


def build_optimizer(objs: UserObjects, model: nn.Module) -> torch.optim.Optimizer:
    """The user's optimizer rebuilt over this rank's model: same class, groups, hyperparams, state; or the
    optimizer param's callable called with this rank's parameters."""
    if objs.optimizer_factory is not None:
        return optimizer_from_factory(objs.optimizer_factory, model, objs.optimizer_lr)
    return rebuild_optimizer(objs.optimizer_cls, objs.optimizer_groups, objs.optimizer_defaults,
                             objs.optimizer_state, model)

