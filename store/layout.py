"""The paths of a run and of materialized data, in one place. Pure string functions."""
from __future__ import annotations

import posixpath
from dataclasses import dataclass


COMMITTED, USED, LEASE = "_COMMITTED.json", "_USED.json", ".lease-"  # file names beside the data


@dataclass(frozen=True)
class DataLayout:
    """Materialized training data of one shape (columns, their types, split, file count), keyed by content.

    Each write goes to its own `attempt-<id>/` folder; a commit marker named by the content's fingerprint,
    written last, names the attempt that holds those rows. Readers use only what a marker names, so an
    interrupted write is never read, and the same rows are found again by their fingerprint. A fit that
    uses a copy holds a lease on it (a file per fit) so that the store's budget never removes it meanwhile.
    """

    root: str

    def attempt(self, attempt_id: str) -> str:
        return posixpath.join(self.root, f"attempt-{attempt_id}")

    def train(self, attempt_id: str) -> str:
        return posixpath.join(self.attempt(attempt_id), "train")

    def val(self, attempt_id: str) -> str:
        return posixpath.join(self.attempt(attempt_id), "val")

    def commit_marker(self, fingerprint: str) -> str:
        return posixpath.join(self.root, f"{fingerprint}{COMMITTED}")

    def used(self, fingerprint: str) -> str:
        """When a fit last used the copy (JSON), for the store's age and size budget."""
        return posixpath.join(self.root, f"{fingerprint}{USED}")

    def lease(self, fingerprint: str, lease_id: str) -> str:
        """Held while a fit uses the copy; removed when it ends (a lease older than a day is stale)."""
        return posixpath.join(self.root, f"{fingerprint}{LEASE}{lease_id}")


@dataclass(frozen=True)
class RunLayout:
    """The files of one training run (one run_id)."""

    root: str
    checkpoint_filename: str = "checkpoint.pt"

    @property
    def checkpoint(self) -> str:
        return posixpath.join(self.root, self.checkpoint_filename)

    @property
    def best_dir(self) -> str:
        """Checkpoints of the best epochs by the monitored metric (save_top_k of them), one file per epoch."""
        return posixpath.join(self.root, "best")

    def best(self, epoch: int) -> str:
        return posixpath.join(self.best_dir, f"epoch-{epoch}.pt")

    @property
    def progress(self) -> str:
        """Per-epoch history so far, rewritten by rank 0 after every epoch (the driver polls it)."""
        return posixpath.join(self.root, "progress.json")

    @property
    def steps(self) -> str:
        """Where the current epoch stands (verbose=2): rewritten by rank 0 about once a second."""
        return posixpath.join(self.root, "steps.json")

    @property
    def metadata(self) -> str:
        return posixpath.join(self.root, "metadata.json")

    @property
    def alive(self) -> str:
        """Rewritten every few seconds by the task of rank 0 while a launch trains; removed when it ends (or by
        the driver that cancelled it). A fit of the run waits while it beats (estimator.launch.liveness)."""
        return posixpath.join(self.root, "alive.json")

    def launch(self, launch_id: str) -> str:
        """Per-launch scratch, removed when the launch ends: what the ranks train (the spec), rank 0's store
        address, each rank's failure record, and the driver's stop marker."""
        return posixpath.join(self.root, f"launch-{launch_id}")

    def launch_spec(self, launch_id: str) -> str:
        return posixpath.join(self.launch(launch_id), "spec.pkl")

    def rendezvous(self, launch_id: str) -> str:
        """Where rank 0 leaves its TCPStore's host and port for the other ranks."""
        return posixpath.join(self.launch(launch_id), "rendezvous.json")

    def failure(self, launch_id: str, rank: int) -> str:
        return posixpath.join(self.launch(launch_id), f"failed-{rank}.json")

    def stop(self, launch_id: str) -> str:
        """Written by the driver when a rank failed: the failed ranks end their tasks (launch.failure_watch)."""
        return posixpath.join(self.launch(launch_id), "stop")

    @property
    def logs(self) -> str:
        """TensorBoard event files (rank 0)."""
        return posixpath.join(self.root, "logs")
