"""The step-level loop of one rank: an epoch of training over ready batches (forward under autocast, the
loss, backward with accumulation and a GradScaler, clipping, the optimizer step, NaN checks, checkpoints inside
the epoch) and exact validation. torch only, no pyspark."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from typing import Any, Callable, Iterable, Iterator, List, Optional, Tuple, Union

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from estimator.core.faults import Fault, inject
from estimator.core.spec import TrainSpec
from estimator.data.arrays import Tensors
from estimator.data.plan import epoch_seed
from estimator.train.checkpoint import Position
from estimator.train.copy_ahead import copied_ahead
from estimator.train.distributed import RankContext
from estimator.train.finite import FiniteCheck
from estimator.train.losses import Objective
from estimator.train.sharding import Sharded
from estimator.train.steps import StepContext, StepObjective

log = logging.getLogger("estimator")
SCALED_DEVICES = ("cuda",)  # where precision='16-mixed' runs (tests add "cpu": torch has a CPU GradScaler)


class TrainLoop:
    """One epoch of training or validation over ready batches, with accumulation and NaN checks."""

    def __init__(self, spec: TrainSpec, ctx: RankContext, ddp: nn.Module, optimizer: torch.optim.Optimizer,
                 objective: Optional[Union[Objective, StepObjective]], faults: Tuple[Fault, ...] = (), attempt: int = 0,
                 checkpoint: Any = None):
        self.spec, self.ctx, self.ddp, self.optimizer = spec, ctx, ddp, optimizer
        self.objective, self.faults, self.attempt, self.checkpoint = objective, faults, attempt, checkpoint
        self.device = torch.device(ctx.device)
        if spec.precision == "16-mixed" and self.device.type not in SCALED_DEVICES:
            raise ValueError(f"precision='16-mixed' needs CUDA (float16 autocast with a GradScaler) but rank "
                             f"{ctx.rank} trains on {ctx.device}. Use precision='bf16-mixed' on CPUs, or GPUs.")
        self.autocast_dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(spec.precision)
        self.scaler = torch.amp.GradScaler(self.device.type) if spec.precision == "16-mixed" else None
        self.global_step = 0  # optimizer steps over the whole run (carried over a resume)
        self.on_step: Optional[Callable[[int, torch.Tensor], None]] = None  # rank 0's TensorBoard step loss
        self.after_step: Optional[Callable[[], None]] = None  # a per-step scheduler's step()
        self.steps_report = StepReport(spec, ctx) if spec.verbose >= 2 and ctx.rank == 0 else None
        self.finite = FiniteCheck(spec.terminate_on_nan, ctx.rank, self.device)
        # a sharded model (fsdp): a forward gathers the parameters from every rank, so every rank validates as many
        # batches as the rank with the most (a rank out of batches repeats one: this, its first training batch)
        self.lockstep = isinstance(ddp, Sharded) and ctx.world_size > 1
        self.stand_in: Optional[Tensors] = None

    def train_epoch(self, epoch: int, batches: Iterable[Tensors], inside: Optional[Position] = None) -> torch.Tensor:
        """`inside`: where a resumed epoch starts (its batch index, and rank 0's sums of the batches before)."""
        self.ddp.train()
        every, start = self.spec.backward_passes_per_step, inside.step if inside else 0
        sums = torch.zeros(self.objective.width, dtype=torch.float64, device=self.device)
        if inside is not None and inside.sums and self.ctx.rank == 0:
            sums += torch.tensor(inside.sums[:self.objective.width], dtype=torch.float64, device=self.device)
        self.optimizer.zero_grad(set_to_none=True)
        tokens = getattr(self.objective, "token_weighted", False)  # a loss summed over tokens (objectives.py)
        window = torch.zeros((), dtype=torch.float64, device=self.device)  # its labelled tokens, this window
        # Each batch's randomness (dropout) depends only on (seed, epoch, rank, step): a resumed run draws
        # what an uninterrupted one did, wherever it resumed.
        base = int(epoch_seed(self.spec.seed, epoch, self.ctx.rank).generate_state(1, np.uint64)[0]) >> 2
        step_ctx = self.step_context(epoch, training=True)
        for step, (batch, last) in enumerate(self.on_device(batches), start=start):
            if self.lockstep and self.stand_in is None:
                self.stand_in = batch
            inject(self.faults, "step", self.ctx.rank, self.attempt, epoch + 1, self.global_step + 1)
            self.seed(base + step)
            stepping = (step + 1) % every == 0 or last  # a partial accumulation still steps at epoch end
            # a step of one batch: its tokens on all ranks summed while the forward runs
            counted = StepTokens(self.objective.tokens(batch), self.ctx.world_size) if tokens and every == 1 else None
            with contextlib.nullcontext() if stepping else self.ddp.no_sync():  # no allreduce while accumulating
                with self.autocast():
                    loss, batch_sums = self.objective.on_batch(self.ddp, batch, dataclasses.replace(
                        step_ctx, batch_idx=step, global_step=self.global_step))
                self.finite.loss(loss, epoch, step)
                if counted is not None:  # the loss summed over this rank's tokens, over the step's tokens
                    scaled = loss * counted.factor()
                else:
                    scaled = loss / every if every > 1 and not tokens else loss
                (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
            sums += batch_sums
            if tokens and every > 1:
                window += batch_sums[1]
            if self.steps_report is not None:
                self.steps_report.batch(epoch, step + 1, sums)
            if stepping:
                if tokens and every > 1:  # the window's gradients, divided once its tokens are all known
                    self.normalize(window)
                    window = torch.zeros_like(window)
                self.step()
                if self.after_step is not None:
                    self.after_step()
                self.global_step += 1
                self.optimizer.zero_grad(set_to_none=True)
                if self.on_step is not None:
                    self.on_step(self.global_step, loss.detach() / batch_sums[1].clamp_min(1) if tokens
                                 else loss.detach())
                steps = self.spec.checkpoint_steps
                if steps and self.global_step % steps == 0 and not last and self.checkpoint is not None:
                    self.checkpoint(epoch, step + 1, sums)
        self.finite.flush(epoch)
        return sums

    def normalize(self, window: torch.Tensor) -> None:
        """With gradient accumulation (the window's tokens known at its last batch only): the gradients of the
        summed losses multiplied by StepTokens' factor once, before the step."""
        factor = StepTokens(window, self.ctx.world_size).factor()
        grads = [getattr(p.grad, "_local_tensor", p.grad)  # fsdp: this rank's shard of a DTensor
                 for p in self.ddp.parameters() if p.grad is not None]
        for dtype in {g.dtype for g in grads}:
            torch._foreach_mul_([g for g in grads if g.dtype == dtype], factor.to(dtype))

    def autocast(self) -> Any:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def step(self) -> None:
        """One optimizer step: gradients unscaled (16-mixed), the global norm clipped (gradient_clip_val; every
        rank holds the same averaged gradients, so every rank clips alike), then the step."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if self.spec.gradient_clip_val is not None:
            torch.nn.utils.clip_grad_norm_(self.ddp.parameters(), self.spec.gradient_clip_val)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()

    def seed(self, value: int) -> None:
        """This device's generator only: torch.manual_seed seeds every backend and took 200 us a step here."""
        if self.device.type == "cuda":
            torch.cuda.default_generators[self.device.index].manual_seed(value)
        torch.default_generator.manual_seed(value)

    def evaluate(self, model: nn.Module, batches: Iterable[Tensors], epoch: int) -> torch.Tensor:
        """Exact validation over this rank's batches. Runs the plain module, not DDP: ranks may have
        different numbers of validation batches, and no collective may run per batch (except with fsdp, whose
        forwards are collectives: `in_lockstep`)."""
        model.eval()
        sums = torch.zeros(self.objective.width, dtype=torch.float64, device=self.device)
        step_ctx = self.step_context(epoch, training=False)
        ready = self.in_lockstep(batches) if self.lockstep else ((b, True) for b, _ in self.on_device(batches))
        with torch.no_grad(), self.autocast():
            for index, (batch, own) in enumerate(ready):
                batch_sums = self.objective.on_batch(model, batch, dataclasses.replace(
                    step_ctx, batch_idx=index, global_step=self.global_step))[1]
                if own:
                    sums += batch_sums
        return sums

    def in_lockstep(self, batches: Iterable[Tensors]) -> Iterator[Tuple[Tensors, bool]]:
        """(batch, whether it is this rank's) until no rank has a batch left: one small all_reduce per batch; a
        rank out of batches forwards its last one again (or its first training batch), its numbers dropped."""
        iterator, last = (b for b, _ in self.on_device(batches)), self.stand_in
        while True:
            batch = next(iterator, None)
            more = torch.tensor([0 if batch is None else 1], device=self.device)
            dist.all_reduce(more, op=dist.ReduceOp.MAX)
            if not int(more.item()):
                return
            last = batch if batch is not None else last
            yield last, batch is not None

    def step_context(self, epoch: int, training: bool) -> StepContext:
        return StepContext(self.ctx.rank, self.ctx.world_size, self.device, epoch + 1, training)

    def on_device(self, batches: Iterable[Tensors]) -> Iterator[Tuple[Tensors, bool]]:
        """(batch on the device, whether it is the last): on a GPU the next batch's copy (from pinned memory, on a
        side stream) is issued before this one is handed over, so it overlaps this step (estimator.train.copy_ahead)."""
        return copied_ahead(batches, self.device)


class StepTokens:
    """What a token-weighted objective's summed losses (or their gradients) are multiplied by so that the
    gradients, averaged over the ranks by DDP or FSDP, are those of the loss summed over every rank's labelled
    tokens of the step over their count, as one process computes it over the same rows: ranks / the step's tokens
    on all ranks. The sum is an all_reduce issued now and waited for by `factor` (on the device: no wait on the
    host)."""

    def __init__(self, count: torch.Tensor, world_size: int):
        self.total, self.world_size = count.detach().to(torch.float64).clone(), world_size
        self.work = dist.all_reduce(self.total, op=dist.ReduceOp.SUM, async_op=True) if world_size > 1 else None

    def factor(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        return (self.world_size / self.total.clamp_min(1.0)).float()


class StepReport:
    """verbose=2: rank 0 leaves where the epoch stands in the store about once a second (batch, of how many, rows/s,
    the running loss of its own batches), for the driver's progress bar."""

    INTERVAL = 1.0

    def __init__(self, spec: TrainSpec, ctx: RankContext):
        self.spec, self.world = spec, ctx.world_size
        self.steps = 0  # batches in this epoch, set by the Run before each epoch
        self.started, self.last, self.rows_at_start = time.perf_counter(), 0.0, 0.0

    def begin(self, steps: int, epoch_rows_so_far: float) -> None:
        self.steps, self.started, self.last, self.rows_at_start = steps, time.perf_counter(), 0.0, epoch_rows_so_far

    def batch(self, epoch: int, done: int, sums: torch.Tensor) -> None:
        now = time.perf_counter()
        if now - self.last < self.INTERVAL and done < self.steps:
            return
        self.last = now
        loss_sum, weight, rows = (float(v) for v in sums[:3])
        state = {"epoch": epoch + 1, "step": done, "steps": self.steps, "loss": loss_sum / weight if weight else None,
                 "rows_per_second": (rows - self.rows_at_start) * self.world / max(now - self.started, 1e-9)}
        try:
            self.spec.data.store.write_bytes_atomic(self.spec.run.steps, json.dumps(state).encode())
        except Exception:  # noqa: BLE001 - progress only
            log.debug("could not write the step progress", exc_info=True)


def reduce_sums(sums: torch.Tensor) -> List[float]:
    """One all_reduce: every rank's (loss * rows, rows, metric * rows, ...) summed."""
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    return sums.cpu().tolist()
