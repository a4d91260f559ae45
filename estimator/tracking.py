"""Watching a run: TensorBoard event files (rank 0) and MLflow (the driver). Both are optional extras.

TensorBoard: rank 0 writes with the `tensorboard` package's writer (through torch.utils.tensorboard) into a local
folder and copies the event files into the run's logs folder in the store (`store.get_logs_path(run_id)`) after
every epoch, so any store fsspec reaches (local, HDFS, S3, ABFS) holds them: `tensorboard --logdir <that folder>`.
A retry or a refit writes a new event file next to the earlier ones; TensorBoard reads them together.
"""
from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import posixpath
import shutil
import tempfile
from typing import Any, Dict, Iterator, Optional

log = logging.getLogger("estimator")


def tensorboard_available() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


class TensorBoardLog:
    """Rank 0's event files: per epoch every history key, the learning rate, rows/s and the data-wait fraction
    (`epoch/...`, step = epoch); every `every` optimizer steps the training loss (`step/loss`, step = global step)."""

    def __init__(self, store: Any, logs_dir: str, every: int, launch_id: str):
        from torch.utils.tensorboard import SummaryWriter

        self.store, self.logs_dir, self.every = store, logs_dir, every
        self.local = tempfile.mkdtemp(prefix="tensorboard-")
        self.writer = SummaryWriter(self.local, filename_suffix=f".{launch_id}")

    @classmethod
    def open(cls, store: Any, logs_dir: str, every: int, launch_id: str) -> Optional["TensorBoardLog"]:
        try:
            return cls(store, logs_dir, every, launch_id)
        except ImportError as exc:  # the driver had tensorboard, this executor has not
            log.warning("TensorBoard logs are off on this executor: %s (pip install tensorboard)", exc)
            return None

    def step(self, global_step: int, loss: Any) -> None:
        if self.every and global_step % self.every == 0:
            self.writer.add_scalar("step/loss", float(loss), global_step)

    def epoch(self, epoch: int, row: Dict[str, float], lr: float, rows_per_second: float) -> None:
        for key, value in row.items():
            if key != "epoch":
                self.writer.add_scalar(f"epoch/{key}", value, epoch)
        self.writer.add_scalar("epoch/lr", lr, epoch)
        self.writer.add_scalar("epoch/rows_per_second", rows_per_second, epoch)
        self.sync()

    def sync(self) -> None:
        """The local event files, copied whole into the store (they are small; a remote store has no append)."""
        self.writer.flush()
        for name in os.listdir(self.local):
            with open(os.path.join(self.local, name), "rb") as handle:
                self.store.write_bytes_atomic(posixpath.join(self.logs_dir, name), handle.read())

    def close(self) -> None:
        try:
            self.writer.close()
            self.sync()
        finally:
            shutil.rmtree(self.local, ignore_errors=True)


def check_mlflow(setting: Optional[bool]) -> None:
    """Before any Spark job, when the fit would log to MLflow (True, or None with an active run): the package is
    there and its tracking store answers. A store that cannot be used (an unreachable server, a database URI that
    mlflow-skinny cannot open, a file store refused without MLFLOW_ALLOW_FILE_STORE) is named with the fix here,
    rather than after training."""
    if setting is False:
        return
    if importlib.util.find_spec("mlflow") is None:
        if setting:
            raise ValueError("The 'mlflow' parameter of TorchEstimator is True but the mlflow package is not "
                             "installed: pip install mlflow (or mlflow-skinny), or set mlflow=None to log only when "
                             "it is there.")
        return
    import mlflow
    from mlflow.tracking import MlflowClient

    if not setting and mlflow.active_run() is None:
        return
    uri = mlflow.get_tracking_uri()
    try:
        with _env(MLFLOW_HTTP_REQUEST_MAX_RETRIES="0", MLFLOW_HTTP_REQUEST_TIMEOUT="10"):  # a dead server: seconds
            MlflowClient(uri).search_experiments(max_results=1)
    except Exception as exc:  # noqa: BLE001 - whatever the store raises, the fix is the same
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        raise ValueError(f"mlflow={setting!r}: MLflow's tracking store {uri!r} cannot be used "
                         f"({type(exc).__name__}: {first}). Point MLFLOW_TRACKING_URI (or mlflow.set_tracking_uri) at "
                         "a tracking server (http://host:5000), at a database URI with the full mlflow package (pip "
                         "install mlflow), or at a folder with MLFLOW_ALLOW_FILE_STORE=true; or set mlflow=False."
                         ) from None


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def log_to_mlflow(setting: Optional[bool], params: Dict[str, Any], history: Any, best_epoch: Optional[int],
                  model: Any) -> Optional[str]:
    """Into the active MLflow run (mlflow=None: only when mlflow is installed and a run is active; True: a run
    is started when none is; False: never): the params, every epoch's history row (step = epoch), the best
    epoch and the trained module. Returns the MLflow run id, or None when nothing was logged."""
    if setting is False or importlib.util.find_spec("mlflow") is None:
        return None
    import mlflow
    import mlflow.pytorch
    import torch

    active = mlflow.active_run()
    if active is None and not setting:
        return None
    run = active or mlflow.start_run()
    try:
        mlflow.log_params({key: _param_text(value) for key, value in params.items() if value is not None})
        for row in history:
            mlflow.log_metrics({key: float(value) for key, value in row.items() if key != "epoch"},
                               step=int(row["epoch"]))
        if best_epoch is not None:
            mlflow.log_metric("best_epoch", best_epoch)
        # pickle: any module (the default 'pt2' traces forward with an example input); the requirement given,
        # so that MLflow does not spend seconds inferring it
        mlflow.pytorch.log_model(model, name="model", serialization_format="pickle",
                                 pip_requirements=[f"torch=={torch.__version__.split('+')[0]}"])
    finally:
        if active is None:
            mlflow.end_run()
    return run.info.run_id


def _param_text(value: Any) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= 6000 else text[:5997] + "..."  # MLflow's limit for a param value
