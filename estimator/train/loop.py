"""The step-level loop of one rank: an epoch of training over ready batches (forward under autocast, the
loss, backward with accumulation and a GradScaler, clipping, the optimizer step, NaN checks, checkpoints inside
the epoch) and exact validation. torch only, no pyspark."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import time
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from estimator.core.faults import Fault, inject
from estimator.core.spec import TrainSpec
from estimator.data.arrays import Tensors, Void
from estimator.data.plan import epoch_seed
from estimator.train.checkpoint import Position
from estimator.train.copy_ahead import copied_ahead
from estimator.train.distributed import RankContext
from estimator.train.finite import FiniteCheck
from estimator.train.precision import precision_of
from estimator.train.steps import StepContext
from estimator.train.sums import LOSS, ROWS, WEIGHT

log = logging.getLogger("estimator")


class TrainLoop:
    """One epoch of training or validation over ready batches, with accumulation and NaN checks. `trained`: what it
    trains through (the strategy's wrapper); `checkpoint(epoch, step, sums)`: every checkpoint_steps inside an
    epoch; `on_step(global_step, loss)`: after each optimizer step (TensorBoard); `after_step()`: a per-step
    scheduler's step; `scaler_state`: a resumed GradScaler's; `global_step`: the optimizer steps already taken."""

    def __init__(self, spec: TrainSpec, ctx: RankContext, strategy: Any, trained: nn.Module,
                 optimizer: torch.optim.Optimizer, objective: Any, faults: Tuple[Fault, ...] = (), attempt: int = 0,
                 checkpoint: Optional[Callable[[int, int, torch.Tensor], None]] = None,
                 on_step: Optional[Callable[[int, torch.Tensor], None]] = None,
                 after_step: Optional[Callable[[], None]] = None, scaler_state: Optional[dict] = None,
                 global_step: int = 0):
        self.spec, self.ctx, self.strategy, self.ddp, self.optimizer = spec, ctx, strategy, trained, optimizer
        self.objective, self.faults, self.attempt, self.checkpoint = objective, faults, attempt, checkpoint
        self.on_step, self.after_step = on_step, after_step
        self.device = torch.device(ctx.device)
        # autocast, the backward, the step (a GradScaler's for 16-mixed): the precision param's object
        self.precision = precision_of(spec.precision)(self.device, ctx.rank, scaler_state)
        self.global_step = global_step  # optimizer steps over the whole run (carried over a resume)
        self.steps_report = StepReport(spec, ctx) if spec.verbose >= 2 and ctx.rank == 0 else None
        data = spec.data
        named = (() if data.lm is not None else data.feature_cols, () if data.lm is not None else data.label_cols,
                 data.sample_weight_col)  # a causal LM's batch holds token ids and labels, which are never NaN
        self.finite = FiniteCheck(spec.terminate_on_nan, ctx.rank, self.device, named)

    def train_epoch(self, epoch: int, batches: Iterable[Tensors], inside: Optional[Position] = None,
                    uneven: bool = False) -> torch.Tensor:
        """`inside`: where a resumed epoch starts (its batch index, and rank 0's sums of the batches before);
        `uneven`: some rank's batches leave out rows drawn again, so the ranks' batches may differ in rows (a Void
        batch counts none; estimator.data.repeats)."""
        self.ddp.train()
        every, start = self.spec.backward_passes_per_step, inside.step if inside else 0
        layout = self.objective.layout
        sums = layout.zeros(self.device)
        if inside is not None and inside.sums and self.ctx.rank == 0:
            sums += layout.vector(layout.restore(inside.sums), self.device)
        self.optimizer.zero_grad(set_to_none=True)
        weighting = self.objective.weighting(every, self.ctx.world_size, layout, uneven)  # what the loss is divided by
        gradients = functools.partial(self.strategy.gradients, self.ddp)  # read only where the weighting scales them
        # Each batch's randomness (dropout) depends only on (seed, epoch, rank, step): a resumed run draws
        # what an uninterrupted one did, wherever it resumed.
        base = int(epoch_seed(self.spec.seed, epoch, self.ctx.rank).generate_state(1, np.uint64)[0]) >> 2
        step_ctx = self.step_context(epoch, training=True)
        # several steps on each prepared batch (GRPO's num_iterations) with accumulation: the window's batches are
        # all prepared first (sampled from the same policy), then each step accumulates over all of them (TRL's
        # generation batch)
        windowed = self.objective.iterations > 1 and every > 1
        window: List[Tuple[int, Any, StepContext, int]] = []
        for step, (batch, last) in enumerate(self.on_device(batches), start=start):
            rows = 0 if isinstance(batch, Void) else batch_rows(batch)  # before prepare: the rows it stands for
            self.strategy.remember(batch)
            inject(self.faults, "step", self.ctx.rank, self.attempt, epoch + 1, self.global_step + 1)
            self.seed(base + step)
            stepping = (step + 1) % every == 0 or last  # a partial accumulation still steps at epoch end
            this_ctx = dataclasses.replace(step_ctx, batch_idx=step, global_step=self.global_step)
            batch = self.objective.prepare(self.generation, batch, this_ctx)  # before the weighting counts it
            before = self.global_step
            if windowed:
                window.append((step, batch, this_ctx, rows))
                if stepping:
                    for _ in range(self.objective.iterations):
                        for i, (at, ready, ready_ctx, its_rows) in enumerate(window):
                            sums += self.backward(ready, ready_ctx, i == len(window) - 1, weighting, gradients,
                                                  epoch, at, its_rows)
                    window = []
            else:
                for _ in range(self.objective.iterations):  # steps on the same prepared batch (accumulation: one)
                    sums += self.backward(batch, this_ctx, stepping, weighting, gradients, epoch, step, rows)
            if self.steps_report is not None:
                self.steps_report.batch(epoch, step + 1, layout.named(sums) if self.steps_report.due(step + 1)
                                        else None)
            steps = self.spec.checkpoint_steps  # at a batch's end (a resume starts at a batch): a step due within
            if steps and self.global_step // steps > before // steps and not last and self.checkpoint is not None:
                self.checkpoint(epoch, step + 1, sums)
        self.finite.flush(epoch)
        return sums

    def backward(self, batch: Any, ctx: StepContext, stepping: bool, weighting: Any, gradients: Callable[[], Any],
                 epoch: int, step: int, rows: int) -> torch.Tensor:
        """One forward and backward of a prepared batch of `rows` rows (0: a Void, forwarded and counted as none;
        its gradients accumulated, not synced, unless `stepping`), then with `stepping` the optimizer step;
        returns the batch's sums."""
        weighting.begin(self.objective, batch, rows)
        with contextlib.nullcontext() if stepping else self.strategy.no_sync(self.ddp):  # none accumulating
            with self.autocast():
                loss, batch_sums = self.objective.on_batch(self.ddp, batch, ctx)
                if not rows:
                    batch_sums = torch.zeros_like(batch_sums)
            self.finite.loss(loss, epoch, step, batch)
            self.precision.backward(weighting.scale(loss))
        weighting.add(batch_sums)
        if stepping:
            weighting.before_step(gradients)
            self.step()
            if self.after_step is not None:
                self.after_step()
            self.global_step += 1
            self.optimizer.zero_grad(set_to_none=True)
            if self.on_step is not None:
                self.on_step(self.global_step, weighting.step_loss(loss, batch_sums))
        return batch_sums

    def count_step(self) -> None:
        """A step taken outside train_epoch (a train_fn's batch)."""
        self.global_step += 1

    def autocast(self) -> Any:
        return self.precision.autocast()

    @property
    def scaler(self) -> Optional[torch.amp.GradScaler]:
        """16-mixed's GradScaler (its state goes into the checkpoints), else None."""
        return self.precision.scaler

    def step(self) -> None:
        """One optimizer step: gradients unscaled (16-mixed), the global norm clipped (gradient_clip_val; every
        rank holds the same averaged gradients, so every rank clips alike), then the step."""
        self.precision.unscale(self.optimizer)
        if self.spec.gradient_clip_val is not None:
            self.strategy.clip(self.ddp, self.spec.gradient_clip_val)
        self.precision.step(self.optimizer)

    def seed(self, value: int) -> None:
        """This device's generator only: torch.manual_seed seeds every backend and took 200 us a step here."""
        if self.device.type == "cuda":
            torch.cuda.default_generators[self.device.index].manual_seed(value)
        torch.default_generator.manual_seed(value)

    def evaluate(self, model: nn.Module, batches: Iterable[Tensors], epoch: int) -> torch.Tensor:
        """Exact validation over this rank's batches. Runs the plain module, not DDP: ranks may have
        different numbers of validation batches, and no collective may run per batch (except where the strategy's
        forwards are collectives: it then keeps the ranks in lockstep, and says which batches count)."""
        model.eval()
        sums = self.objective.layout.zeros(self.device)
        step_ctx = self.step_context(epoch, training=False)
        ready = self.strategy.validation(b for b, _ in self.on_device(batches))
        with torch.no_grad():
            for index, (batch, own) in enumerate(ready):
                this_ctx = dataclasses.replace(step_ctx, batch_idx=index, global_step=self.global_step)
                batch = self.objective.prepare(self.generation, batch, this_ctx)
                with self.autocast():
                    batch_sums = self.objective.on_batch(model, batch, this_ctx)[1]
                if own:
                    sums += batch_sums
        return sums

    @contextlib.contextmanager
    def generation(self) -> Iterator[nn.Module]:
        """The strategy's context for generating inside training (an objective's prepare), under the precision's
        autocast as every other forward (a frozen base in autocast's dtype needs it: DDP.place)."""
        with self.strategy.generation(self.ddp) as module, self.autocast():
            yield module

    def step_context(self, epoch: int, training: bool) -> StepContext:
        return StepContext(self.ctx.rank, self.ctx.world_size, self.device, epoch + 1, training)

    def on_device(self, batches: Iterable[Tensors]) -> Iterator[Tuple[Tensors, bool]]:
        """(batch on the device, whether it is the last): on a GPU the next batch's copy (from pinned memory, on a
        side stream) is issued before this one is handed over, so it overlaps this step (estimator.train.copy_ahead)."""
        return copied_ahead(batches, self.device)


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

    def due(self, done: int) -> bool:
        """Whether `batch` writes now: about once a second, and at the epoch's last batch."""
        return time.perf_counter() - self.last >= self.INTERVAL or done >= self.steps

    def batch(self, epoch: int, done: int, sums: Optional[Dict[str, float]]) -> None:
        """`sums`: the epoch's so far on this rank, by name (None when not `due`: nothing is read off the device)."""
        if sums is None:
            return
        now = self.last = time.perf_counter()
        loss_sum, weight, rows = sums[LOSS], sums[WEIGHT], sums[ROWS]
        state = {"epoch": epoch + 1, "step": done, "steps": self.steps, "loss": loss_sum / weight if weight else None,
                 "rows_per_second": (rows - self.rows_at_start) * self.world / max(now - self.started, 1e-9)}
        try:
            self.spec.data.store.write_bytes_atomic(self.spec.run.steps, json.dumps(state).encode())
        except Exception:  # noqa: BLE001 - progress only
            log.debug("could not write the step progress", exc_info=True)


def batch_rows(batch: Tensors) -> int:
    """The rows of a batch as the reader gave it (the first tensor's first dimension)."""
    return int(next(batch.each()).shape[0])


def reduce_sums(sums: torch.Tensor) -> List[float]:
    """One all_reduce: every rank's (loss * rows, rows, metric * rows, ...) summed."""
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    return sums.cpu().tolist()
