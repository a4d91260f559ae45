"""Which checkpoints a run keeps, apart from writing them (estimator.train.epochs writes): the run's checkpoint
(the last), and at an epoch's end a copy of the epoch's when it is among the save_top_k best by the monitor. Once
a checkpoint is written, the best epochs' copies that left the top k are removed, and what the strategy left that
no kept checkpoint names (fsdp: folders of shards). Rank 0 only, in the checkpoint writer's thread. torch only."""
from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

from estimator.train.checkpoint import load_checkpoint, shards_of


@dataclass(frozen=True)
class Kept:
    """One checkpoint's retention: where it is written, and the best epochs' copies that stay."""

    targets: List[str]  # the run's checkpoint, and this epoch's copy when it is among the best
    best: List[str]  # the file names of the best epochs' copies kept (at an epoch's end)
    at_epoch_end: bool


@dataclass(frozen=True)
class Retention:
    store: Any
    run: Any  # the run's layout (store.RunLayout)
    monitor: Any  # estimator.core.stopping.Monitor
    top_k: int  # save_top_k

    def plan(self, history: Sequence[dict], at_epoch_end: bool) -> Kept:
        """Where a checkpoint of the run as it stands after `history` goes, and which best copies stay."""
        top = self.monitor.top_k(history, self.top_k) if at_epoch_end else []
        epoch = len(history)
        return Kept([self.run.checkpoint] + ([self.run.best(epoch)] if epoch in top else []),
                    [posixpath.basename(self.run.best(e)) for e in top], at_epoch_end)

    def apply(self, kept: Kept, strategy: Any, folder: Optional[str]) -> None:
        """After the checkpoint is written: the best copies no longer among the top k removed, then what the
        strategy keeps beside its checkpoints that neither this one (`folder`) nor a kept copy names."""
        store, best_dir = self.store, self.run.best_dir
        copies = store.ls(best_dir) if store.exists(best_dir) else []
        if kept.at_epoch_end:
            for path in copies:
                if posixpath.basename(path) not in kept.best:
                    store.rm(path)
            copies = [p for p in copies if posixpath.basename(p) in kept.best]
        if folder is not None:
            strategy.keep_folders(store, self.run, [folder, *(shards_of(load_checkpoint(store, p)) for p in copies)])
