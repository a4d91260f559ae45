"""What a fit tells its user on the driver: the live epoch lines while the ranks train (a step bar with
verbose=2), why a run stopped early, and once the ranks are done, where the fit's time went (`fit stages`).
Lines for the user go to the Horovod backend's stdout when one was passed, else to stderr (a notebook shows
them without any logging set up); verbose=0 silences them."""
from __future__ import annotations

import contextlib
import json
import logging
import time
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

from estimator.console import say_to_user
from estimator.core.spec import DataSpec, WorkerResult
from estimator.core.stopping import Monitor
from estimator.fit.progress import ProgressWatcher, StepBar
from estimator.train.epochs import PROGRESS_SECONDS, format_metrics
from estimator.train.finite import non_finite_losses
from estimator.train.tensorboard import tensorboard_available

log = logging.getLogger("estimator")


@contextlib.contextmanager
def watching(p: Dict[str, Any], store: Any, layout: Any, run_id: str,
             on_epoch: Optional[Callable[[Dict[str, float]], None]] = None, done: int = 0) -> Iterator[None]:
    """The live epoch lines while the ranks train, and with verbose=2 a bar of the running epoch's steps;
    `on_epoch` (MLflow's live metrics) gets each row too. `done`: the epochs finished before this launch (a
    resumed run), whose rows are not told again."""
    bar = StepBar.open(p["verbose"])

    def report(row: Dict[str, float]) -> None:
        if bar is not None:
            bar.close()
        row = dict(row)
        seconds = row.pop(PROGRESS_SECONDS, None)
        report_epoch(p, run_id, row, seconds)
        if on_epoch is not None:
            on_epoch(row)

    try:
        with ProgressWatcher(store, layout, report, steps=bar.update if bar is not None else None, seen=done):
            yield
    finally:
        if bar is not None:
            bar.close()


def report_stop(p: Dict[str, Any], monitor: Monitor, run_id: str, history: List[Dict[str, float]]) -> None:
    """Say why a run ended before `epochs` (early stopping), and which epoch was best."""
    stopped = monitor.stop_reason(history) if len(history) < p["epochs"] else None
    if stopped is None:
        return
    best = monitor.best_epoch(history)
    log.info("Run %s stopped early after epoch %d of %d: %s", run_id, len(history), p["epochs"], stopped)
    say(p, f"run {run_id} stopped early after epoch {len(history)} of {p['epochs']}: {stopped}; best epoch {best}"
           + (" (restored)" if p["restore_best"] else ""))


def report_epoch(p: Dict[str, Any], run_id: str, row: Dict[str, float], seconds: Optional[float] = None) -> None:
    """One epoch's line, live on the driver, ending with the epoch's seconds on rank 0 (its training and
    validation); a warning for an epoch whose loss is not finite (reached only with terminate_on_nan=False:
    otherwise the ranks stop at the first such step)."""
    took = "" if seconds is None else f" ({seconds:.2f} s)" if seconds < 10 else f" ({seconds:.1f} s)"
    say(p, f"run {run_id} epoch {row['epoch']:.0f}: {format_metrics(row)}{took}")
    bad = [f"{k}={v}" for k, v in non_finite_losses(row).items()]
    if bad:
        warnings.warn(f"Run {run_id} epoch {row['epoch']:.0f}: {', '.join(bad)}. terminate_on_nan=False keeps "
                      "training, and a model with non-finite weights predicts NaN: lower lr, or set "
                      "gradient_clip_val.", RuntimeWarning, stacklevel=2)


def say(p: Dict[str, Any], line: str) -> None:
    """A line of the run for the user: to the Horovod backend's stdout, else printed to stderr (also logged at
    DEBUG). verbose=0 silences it."""
    if not p["verbose"]:
        return
    if p["backend"] is not None and hasattr(p["backend"], "write"):
        p["backend"].write(line)
    else:
        say_to_user(line)


def log_fit(run_id: str, results: Sequence[WorkerResult], data: DataSpec, dry_run_seconds: float,
            launch_seconds: float, started: float, direct: bool) -> None:
    """Where the ranks ran and read, and the fit's stages in seconds (`fit stages`: the slowest rank's figure
    of each, and materialize's share of the whole fit). `direct`: the ranks computed the DataFrame."""
    averaged = f"gradients averaged by {results[0].allreduce}" if len(results) > 1 else "one rank, nothing averaged"
    log.info("Trained run %s on %d ranks (%s, %s) in %.1fs", run_id, len(results), results[0].device, averaged,
             time.perf_counter() - started)
    readers = sorted({r.reader for r in results})
    log.info("Ranks read their data: %s", readers[0] if len(readers) == 1 else "; ".join(
        f"rank {r.rank}: {r.reader}" for r in results))
    stages = {"materialize_s": data.materialize_seconds, "dry_run_s": dry_run_seconds,
              "launch_s": launch_seconds, "rank_setup_s": max(r.setup_seconds for r in results),
              "train_s": max(r.seconds for r in results),  # the ranks' whole work: model, epochs, checkpoints
              "epochs_s": max(r.train_loop_seconds for r in results),  # their training passes only
              "shard_read_s": max(r.read_seconds for r in results),
              "train_waited_for_shard_s": max(r.read_wait_seconds for r in results),
              "data_wait_fraction": max(r.data_wait_seconds / max(r.train_loop_seconds, 1e-9) for r in results),
              "teardown_s": max(r.teardown_seconds for r in results),
              "checkpoint_wait_s": max(r.checkpoint_wait_seconds for r in results),
              "spark_overhead_s": launch_seconds - max(r.setup_seconds + r.seconds + r.teardown_seconds
                                                       for r in results),
              "train_rows": sum(r.train_rows for r in results) if direct else data.train_rows,
              "rank_peak_rss_mb": max(r.peak_rss_mb for r in results),
              "rank_state_mb": max(r.state_bytes for r in results) / 1e6}  # parameters and optimizer state
    if direct:  # the DataFrame computed into the ranks, and their local copies (in launch_s)
        stages["direct_spill_s"] = max(r.spill_seconds for r in results)
    stages["materialize_share"] = data.materialize_seconds / (data.materialize_seconds + time.perf_counter()
                                                              - started)
    log.info("fit stages: %s", json.dumps({k: round(v, 3) for k, v in stages.items()}))


def tensorboard_on(verbose: int) -> bool:
    """TensorBoard event files when the tensorboard package is installed. TensorBoard is optional: without it
    nothing is printed (a line on every fit of every new process was noise), only logged at DEBUG."""
    if tensorboard_available():
        return True
    log.debug("TensorBoard logs are off: the tensorboard package is not installed (pip install tensorboard, or "
              "this project's [tensorboard] extra)")
    return False
