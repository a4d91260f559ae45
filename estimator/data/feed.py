"""Batches made ready off the training thread: transformation_fn (e.g. image decoding) in worker threads or
processes, conversion to tensors (pinned memory for a GPU), a bounded queue of ready batches ahead of the loop.

The loop only waits when the queue is empty; `waited` says how long it did, for the data-wait figures.
"""
from __future__ import annotations

import multiprocessing
import os
import queue
import sys
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any, Callable, Iterator, Optional, Tuple


from estimator.core.spec import DataSpec
from estimator.data.arrays import Arrays, Tensors, Void, to_tensors
from estimator.data.frames import cloudpickle_module, load_transformation, prepare_batch, run_loaded
from estimator.data.repeats import without_repeats

_END = object()


class Decoders:
    """Where transformation_fn runs, for a whole fit: on the feeding thread (`workers` 1, or pool_type
    'dummy'), in `workers` threads ('thread'), or in `workers` processes ('process'; the batches and results
    travel pickled). Batches keep their order. Processes sidestep the GIL (PIL decoding alone: 14.0k rows/s in
    2 forked processes, 8.1k in 2 threads). They start with `start_method`, by default 'fork' on Linux as
    torch's DataLoader workers do (0.06 s); 'spawn' and 'forkserver' start a fresh interpreter that imports
    the function's module (2 s when that imports torch) and are the safe choice if your transformation_fn
    uses threads or CUDA."""

    def __init__(self, fn: Any, workers: int = 1, pool_type: str = "thread", start_method: Optional[str] = None,
                 name: str = "decode", tokenize: Any = None):
        self.fn, self.tokenize, self.workers = fn, tokenize, workers if pool_type != "dummy" else 1
        processes = (fn is not None or tokenize is not None) and pool_type == "process"
        self._threads = (ThreadPoolExecutor(self.workers, thread_name_prefix=name)
                         if self.workers > 1 or processes else None)
        method = start_method or ("fork" if sys.platform.startswith("linux") else "spawn")
        self._processes = (ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context(method),
                                               initializer=load_transformation,
                                               initargs=(cloudpickle_module().dumps((fn, tokenize)),))
                           if processes else None)

    def submit(self, raw: Arrays, finish: Callable[[Arrays], Tensors]) -> "Future[Tensors]":
        """`finish(transformed batch)`, on a pool thread (or here, without one)."""
        if self._threads is None:
            return _done(finish(self.transform(raw)))
        return self._threads.submit(lambda: finish(self.transform(raw)))

    def transform(self, raw: Arrays) -> Arrays:
        if self.fn is None and self.tokenize is None:
            return raw
        if self._processes is not None:
            return self._processes.submit(run_loaded, raw).result()
        return prepare_batch(self.fn, self.tokenize, raw)

    def close(self) -> None:
        for pool in (self._threads, self._processes):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)


class Feed:
    """Iterate to get `Tensors` in the order of `batches`. Always `close()` (stops the thread early; the
    decoders stay open for the next epoch: their owner closes them)."""

    def __init__(self, batches: Iterator[Arrays], data: DataSpec, decoders: Optional[Decoders] = None,
                 depth: int = 4, pin: bool = False, name: str = "feed",
                 check: Optional[Callable[[Tensors], None]] = None, drop_repeats: bool = False):
        """`check`: called with each batch's tensors on the host (the objective's host_check), raising on rows
        that cannot be trained on; the error reaches the loop as the batch. `drop_repeats`: the rows a reader
        marked as drawn again are left out, a batch of nothing else comes as a Void (estimator.data.repeats);
        otherwise they are kept."""
        self._decoders = decoders if decoders is not None else Decoders(None)
        self._finish: Callable[[Arrays], Tensors] = lambda arrays: checked(to_tensors(arrays, data, pin=pin), check)
        self._void: Callable[[Arrays], Tensors] = lambda arrays: Void(*self._finish(arrays))
        self._drop = drop_repeats
        self._queue: "queue.Queue[Any]" = queue.Queue(maxsize=max(depth, self._decoders.workers + 1))
        self._stop = threading.Event()
        self.waited = 0.0  # seconds the consumer spent waiting for a batch
        self._thread = threading.Thread(target=self._produce, args=(batches,), daemon=True, name=name)
        self._thread.start()

    def _produce(self, batches: Iterator[Arrays]) -> None:
        try:
            for raw in batches:
                raw, void = without_repeats(raw, self._drop)
                item = self._decoders.submit(raw, self._void if void else self._finish)
                if not self._put(item):
                    return
        except BaseException as exc:  # noqa: BLE001 - raised on the training thread by __next__
            self._put(_failed(exc))
            return
        self._put(_END)

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> "Feed":
        return self

    def __next__(self) -> Tensors:
        started = time.perf_counter()
        try:
            item = self._queue.get()
            if item is _END:
                self._queue.put(_END)  # iterating again after the end ends again
                raise StopIteration
            return item.result()
        finally:
            self.waited += time.perf_counter() - started

    def close(self) -> None:
        self._stop.set()
        while True:  # unblock a producer waiting to put
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=30)


def checked(tensors: Tensors, check: Optional[Callable[[Tensors], None]]) -> Tensors:
    if check is not None:
        check(tensors)
    return tensors


def _done(value: Any) -> "Future[Any]":
    future: "Future[Any]" = Future()
    future.set_result(value)
    return future


def _failed(exc: BaseException) -> "Future[Any]":
    future: "Future[Any]" = Future()
    future.set_exception(exc)
    return future


def decoding(configured: Optional[int], pool_type: str, transform: bool, tokenize: bool, gpu: bool,
             cores: int) -> Tuple[int, str]:
    """(workers, pool type) of a rank's decoders. pool_type 'auto': processes on a GPU rank with a
    transformation_fn, `cores` - 1 of them by default (at least 2; the GPU's copies and launches keep one core),
    since a GPU waits on a decoder held by the GIL (PNG digits on an H200: 0.08x the pre-decoded rows/s with 2
    threads, 0.51x with 8 processes); elsewhere threads, 2 by default (the rank's cores train). Without a
    transformation_fn or a tokenizer, the feeding thread itself (1)."""
    if pool_type == "auto":
        pool_type = "process" if gpu and transform else "thread"
    if configured is not None:
        return configured, pool_type
    if not (transform or tokenize):
        return 1, pool_type
    return (max(2, cores - 1) if gpu and pool_type == "process" else 2), pool_type


def rank_cores(gpu: bool, threads: int) -> int:
    """The cores a rank may decode on: on a GPU host, the host's cores (this process's affinity) over its GPUs,
    whose ranks share them (the CPU does not train there); on a CPU rank, its torch threads (the task's cores)."""
    if not gpu:
        return threads
    import torch

    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, available // max(1, torch.cuda.device_count()))
