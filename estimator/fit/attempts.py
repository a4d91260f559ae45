"""A fit's launches: the ranks launched, and after a failure launched again from the run's last checkpoint, up
to max_retries times (Spark never retries a failed barrier ResultStage itself), as long as the failure's kind
says another launch can help (estimator.failures)."""
from __future__ import annotations

import copy
import warnings
import logging
import time
import uuid
from dataclasses import replace
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from estimator.core.spec import TrainSpec, WorkerResult
from estimator.data.remainder import replayable
from estimator.data.row_checks import BadRows
from estimator.failures import FailureKind, NotEnoughSlots, RankFailed
from estimator.fit.report import say, watching
from estimator.launch.liveness import wait_for_other_launch
from estimator.launch.session import default_retries, task_slots
from estimator.launch.spark import SparkBarrierLauncher
from estimator.train.checkpoint import Position, describe, load_checkpoint, position_of, restore, shards_of
from estimator.train.strategies import STRATEGIES, writer_of
from store import Store

log = logging.getLogger("estimator")


def launch_with_retries(p: Dict[str, Any], run: Any, spec: TrainSpec, spark: Any, source: Any = None,
                        on_epoch: Optional[Callable[[Dict[str, float]], None]] = None) -> List[WorkerResult]:
    """Launch the ranks; after a failure launch again from the last checkpoint, up to max_retries
    times (Spark never retries a failed barrier ResultStage itself). Returns [] when the run's
    checkpoint already has every requested epoch. In the direct mode every launch computes `source`. `run`: the
    fit's RunPlan (estimator.estimator). `on_epoch`: called with each history row as the driver learns it."""
    retries = p["max_retries"] if p["max_retries"] is not None else default_retries(spark)
    launcher = SparkBarrierLauncher(spark, f"TorchEstimator.fit {run.run_id}")
    world = run.num_proc
    # never resume from (or return) a checkpoint another launch is still writing
    wait_for_other_launch(run.store, spec.run, run.run_id, spec.rendezvous_timeout, lambda line: say(p, line))
    last_failure: Optional[tuple] = None
    for attempt in range(retries + 1):
        if attempt:  # a lost executor may have taken slots with it
            world = retry_world(spark, run.run_id, run.num_proc, p["min_num_proc"] or run.num_proc, run.per_task,
                                spec.batch_size, spec.rendezvous_timeout)
        done, history = resume_point(run.store, spec.run, p["model"], run.run_id, spec.strategy)
        if done.epochs >= spec.epochs:  # said at verbose=1 too: the model returned was trained before
            log.info("Run %s already has %d finished epochs (epochs=%d): nothing to train", run.run_id,
                     done.epochs, spec.epochs)
            say(p, f"run {run.run_id} already has {done.epochs} finished epochs (epochs={spec.epochs}): nothing to "
                   "train; its model is returned (a larger epochs trains on)")
            return []
        stopped = run.monitor.stop_reason(history)
        if stopped is not None:
            log.info("Run %s stopped early after epoch %d: nothing to train (%s)", run.run_id, done.epochs,
                     stopped)
            say(p, f"run {run.run_id} stopped early after epoch {done.epochs} ({stopped}): nothing to train; its "
                   "model is returned")
            return []
        if done.epochs or done.step:
            log.info("Run %s continues from its checkpoint after %s", run.run_id, describe(done))
            say(p, f"resuming run {run.run_id} at epoch {done.epochs + 1} of {spec.epochs}"
                   + (f", after its step {done.step}" if done.step else "") + f" (its checkpoint after {describe(done)})")
        batch_size = spec.batch_size * run.num_proc // world  # the global batch kept
        if done.step and done.layout[:2] != [batch_size, world]:  # (a change of reader only: said by the ranks)
            log.info("Run %s: the checkpoint stands inside epoch %d with batch_size, ranks = %s; this launch has %s: %s",
                     run.run_id, done.epochs + 1, done.layout[:2], [batch_size, world],
                     "the rest of the epoch trains each row not yet trained on once, dealt to these ranks"
                     if replayable(spec, done.layout, done.step) else "the epoch starts over (the rows done cannot be known "
                     "with petastorm, data_mode='direct' or inside a window of packed batches)")
        launch = replace(spec, attempt=attempt, launch_id=uuid.uuid4().hex[:12],
                         resume_from=spec.run.checkpoint if done.epochs or done.step else None,
                         batch_size=batch_size)
        try:
            with watching(p, run.store, spec.run, run.run_id, on_epoch, done=done.epochs):
                return launcher.run(launch, world, source, run.per_task)
        except Exception as exc:  # noqa: BLE001 - retried below or re-raised as it is
            if isinstance(exc, RankFailed) and exc.kind is FailureKind.DATA:
                raise BadRows(exc.summary.split(": ", 1)[-1]) from None  # as a materialized fit raises it
            if attempt >= retries or not retryable(exc):
                if attempt:
                    log.error("Run %s failed on attempt %d of %d; giving up", run.run_id, attempt + 1,
                              retries + 1)
                raise
            failure = repeating(exc, done)
            if failure is not None and failure == last_failure:
                log.error("Run %s failed the same way on attempts %d and %d, both launched from %s: %s. Another "
                          "launch would fail again: giving up (%d of max_retries=%d unused)", run.run_id, attempt,
                          attempt + 1, "its checkpoint after " + describe(done) if done.epochs or done.step
                          else "the start", str(exc).splitlines()[0][:300], retries - attempt, retries)
                raise
            last_failure = failure
            log.warning("Run %s failed on attempt %d of %d; retrying from its last checkpoint: %s",
                        run.run_id, attempt + 1, retries + 1, str(exc).splitlines()[0][:300])
    raise AssertionError("unreachable")


def retry_world(spark: Any, run_id: str, num_proc: int, min_num_proc: int, per_task: int, batch_size: int,
                timeout: float) -> int:
    """The ranks of a retry: num_proc when the application has the task slots for them; else, when a lost
    executor took slots with it, the most ranks the slots hold that keep the global batch whole (num_proc x
    batch_size divisible by them; per_task ranks a task), if at least min_num_proc; else wait up to `timeout`
    seconds for slots to come back, then a clear error (never a barrier stage Spark cannot schedule)."""
    deadline = time.monotonic() + timeout
    while True:
        slots = task_slots(spark)
        if slots is None or slots * per_task >= num_proc:
            return num_proc  # unknown (a Connect session with dynamic allocation) or all there
        world = next((w for w in range(slots * per_task, 0, -1)
                      if w % per_task == 0 and num_proc * batch_size % w == 0), 0)
        if world >= min_num_proc:
            log.warning("Run %s: %d task slot(s) left of the %d it needs (an executor was lost): retrying on %d "
                        "rank(s) (min_num_proc=%d) with %d rows per rank's batch, the global batch of %d kept",
                        run_id, slots, num_proc // per_task, world,
                        min_num_proc, num_proc * batch_size // world, num_proc * batch_size)
            return world
        if time.monotonic() > deadline:
            raise NotEnoughSlots(f"Run {run_id} cannot be retried: {slots} task slot(s) hold {world} rank(s), and it "
                                 f"needs at least {min_num_proc} (min_num_proc) of its {num_proc}; "
                                 f"{timeout:.0f} s (rendezvous_timeout) did not bring enough back. Add executors, or "
                                 "set min_num_proc lower to go on with fewer ranks from the last checkpoint.")
        time.sleep(1.0)


def repeating(exc: BaseException, start: Position) -> Optional[tuple]:
    """What makes a failure the same as another: a rank's exception (its rank and exception line) raised by an
    attempt launched from the same checkpoint position. A second such failure in a row is taken as certain to
    recur (the same code on the same rows from the same state: a max_length the model cannot take, a bug at
    step N); a lost or killed worker, a late rank or a failed read or write is not (None: always retried)."""
    if type(exc) is not RankFailed or exc.kind is not FailureKind.USER:
        return None
    return exc.rank, exc.summary, start.epochs, start.step


def retryable(exc: BaseException) -> bool:
    """Worth another launch from the checkpoint: a crashed or lost worker, a rank's error, a late rank, a failed
    read. Not: NaN/inf losses with terminate_on_nan (they would recur). Read from the failure's kind."""
    return not isinstance(exc, RankFailed) or exc.kind.retryable


def resume_point(store: Store, run: Any, model: torch.nn.Module, run_id: str, strategy: str = "ddp"
                 ) -> Tuple[Position, List[Dict[str, float]]]:
    """Where the run's checkpoint stands, and its history (nothing done without one); its model must be this
    model, and its checkpoints of the form this fit's strategy writes (a run keeps the strategy it began with,
    or one whose checkpoints it resumes: fsdp's and auto's are alike)."""
    if not store.exists(run.checkpoint):
        return Position(), []
    state = load_checkpoint(store, run.checkpoint, lazy=True)  # mapped: its tensors are only compared in shape
    shards = shards_of(state) is not None
    if shards != STRATEGIES[strategy].shards_checkpoints:
        written = writer_of(state, shards)
        raise ValueError(f"run_id {run_id!r} already has a checkpoint ({store.url(run.checkpoint)}) written with "
                         f"strategy={written!r}, and this fit has strategy={strategy!r}: a run continues "
                         f"with the strategy it began with. Set strategy={written!r}, or use a new run_id.")
    try:
        with warnings.catch_warnings():  # a skeleton's (estimator.core.handle): its names and shapes are checked
            warnings.filterwarnings("ignore", message=".*copying from a non-meta parameter.*")
            restore(store, run, run.checkpoint, copy.deepcopy(model), None, lazy=True)
    except (RuntimeError, ValueError, KeyError) as exc:
        raise ValueError(f"run_id {run_id!r} already has a checkpoint ({store.url(run.checkpoint)}) of a different "
                         f"model: {str(exc).splitlines()[0]} Use a new run_id, or remove that run's folder.") from None
    return position_of(state), list(state["history"])
