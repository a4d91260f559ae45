"""Batches made ready off the training thread: transformation_fn (e.g. image decoding) in worker threads,
conversion to tensors (pinned memory for a GPU), a bounded queue of ready batches ahead of the loop.

The loop only waits when the queue is empty; `waited` says how long it did, for the data-wait figures.
"""
from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator, Optional

from estimator.data.arrays import Arrays, Tensors, to_tensors, transform_batch
from estimator.spec import DataSpec

_END = object()


class Feed:
    """Iterate to get `Tensors` in the order of `batches`. Always `close()` (stops the thread early)."""

    def __init__(self, batches: Iterator[Arrays], data: DataSpec, transformation_fn: Any = None, workers: int = 1,
                 depth: int = 4, pin: bool = False, name: str = "feed"):
        self._make: Callable[[Arrays], Tensors] = lambda raw: to_tensors(
            transform_batch(transformation_fn, raw) if transformation_fn is not None else raw, data, pin=pin)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix=f"{name}-decode") if workers > 1 else None
        self._queue: "queue.Queue[Any]" = queue.Queue(maxsize=max(depth, workers + 1))
        self._stop = threading.Event()
        self.waited = 0.0  # seconds the consumer spent waiting for a batch
        self._thread = threading.Thread(target=self._produce, args=(batches,), daemon=True, name=name)
        self._thread.start()

    def _produce(self, batches: Iterator[Arrays]) -> None:
        try:
            for raw in batches:
                item = self._pool.submit(self._make, raw) if self._pool is not None else _done(self._make(raw))
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
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


def _done(value: Any) -> "Future[Any]":
    future: "Future[Any]" = Future()
    future.set_result(value)
    return future


def _failed(exc: BaseException) -> "Future[Any]":
    future: "Future[Any]" = Future()
    future.set_exception(exc)
    return future


def feed_workers(configured: Optional[int], has_transform: bool) -> int:
    """Decode workers: as configured; by default 2 when a transformation_fn runs per batch, else 1 (the
    feeding thread itself)."""
    if configured is not None:
        return configured
    return 2 if has_transform else 1
