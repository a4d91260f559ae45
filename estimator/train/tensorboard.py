"""TensorBoard on rank 0: it writes with the `tensorboard` package's writer (through torch.utils.tensorboard) into a
local folder and copies the event files into the run's logs folder in the store (`store.get_logs_path(run_id)`)
after every epoch, so any store fsspec reaches (local, HDFS, S3, ABFS) holds them: `tensorboard --logdir <that
folder>`. A retry or a refit writes a new event file next to the earlier ones; TensorBoard reads them together.
An optional extra; torch only, no pyspark."""
from __future__ import annotations

import importlib.util
import logging
import os
import posixpath
import shutil
import tempfile
from typing import Any, Dict, Optional

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
