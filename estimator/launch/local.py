"""Ranks on this machine, without Spark: in-process for one rank, processes of their own otherwise; the same
per-rank code as Spark's barrier tasks (estimator.launch.rank_setup).

On a machine without a GPU the rank processes are forked from multiprocessing's forkserver, which has imported
torch, the rank code, transformers and peft once (PRELOAD): a fresh process spends about 4 s of CPU importing
them, at every run of every rank (on 2 cores, tests/test_preference.py and test_grpo.py, 41 tests of mostly
two-rank runs: 66 s spawned, 27 s forked). Each rank takes the caller's environment and working folder as a
spawned process does; its output goes where the caller's went when the forkserver started (the first run).
The server (about 480 MB resident, its pages shared with the ranks it forks) stays until the caller exits.
With a GPU (CUDA must not be initialized before a fork), and where there is no forkserver, they are spawned."""
from __future__ import annotations

import multiprocessing
import os
from datetime import timedelta
from typing import List, Optional, Tuple

import torch
from torch.distributed import TCPStore

from estimator.core.faults import Fault
from estimator.core.spec import TrainSpec, WorkerResult
from estimator.failures import FailureKind, failure_kind
from estimator.launch.rank_setup import Placement, train_rank

# what the forkserver imports before it forks a rank (one missing is skipped)
PRELOAD = ("torch", "estimator.launch.rank_setup", "transformers", "peft")


class LocalLauncher:
    """Ranks on this machine, without Spark: in-process for one rank, processes of their own otherwise."""

    def __init__(self, use_processes: Optional[bool] = None, faults: Tuple[Fault, ...] = ()):
        self.use_processes, self.faults = use_processes, faults  # faults: estimator.core.faults, for tests

    def run(self, spec: TrainSpec, num_proc: int) -> List[WorkerResult]:
        server = TCPStore("127.0.0.1", 0, num_proc, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=spec.rendezvous_timeout))
        try:
            if num_proc == 1 and not self.use_processes:
                return [_local_rank(spec, 0, 1, server.port, self.faults)]
            return self._spawn(spec, num_proc, server.port)
        finally:
            del server

    def _spawn(self, spec: TrainSpec, num_proc: int, port: int) -> List[WorkerResult]:
        mp = rank_context(spec)
        with mp.Pool(num_proc) as pool:
            # the machine's cores shared by its ranks, as Spark gives each task its own (spark.task.cpus)
            threads = max(1, torch.get_num_threads() // num_proc)
            environ = dict(os.environ)  # now, not the forkserver's from its start
            handles = [pool.apply_async(_pooled_rank, (environ, spec, r, num_proc, port, self.faults, threads))
                       for r in range(num_proc)]
            results, failures = [], []
            for handle in handles:
                try:
                    results.append(handle.get())
                except Exception as exc:  # noqa: BLE001 - every rank's outcome first, then the cause
                    failures.append(exc)
        if failures:  # the failing rank's own error, not a peer's echo of it
            raise next((f for f in failures if failure_kind(f) is not FailureKind.PEER), failures[0])
        return results


def rank_context(spec: TrainSpec) -> multiprocessing.context.BaseContext:
    """forkserver, with PRELOAD imported once, where it exists and no GPU is used; else spawn."""
    gpu = spec.use_gpu is not False and torch.cuda.is_available()
    if gpu or "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))  # taken when the server starts (the first run), then kept
    return context


def _pooled_rank(environ: dict, *args) -> WorkerResult:
    """_local_rank in a pool's process, in the caller's environment of the moment."""
    os.environ.clear()
    os.environ.update(environ)
    return _local_rank(*args)


def _local_rank(spec: TrainSpec, rank: int, world: int, port: int, faults: Tuple[Fault, ...] = (),
                threads: Optional[int] = None) -> WorkerResult:
    gpus = torch.cuda.device_count() if spec.use_gpu is not False else 0
    place = Placement(("127.0.0.1",) * world, (gpus,) * world, (None,) * world, port,
                      threads or torch.get_num_threads(), by_spark=False)
    return train_rank(spec, faults, spec.attempt, rank, place)
