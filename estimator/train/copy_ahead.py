"""Batches onto the rank's GPU one step ahead, without the host ever waiting for the GPU: each batch arrives
in pinned host memory (estimator.data.feed), its copy is issued on a side stream while the step before it is
still queued (so the copy overlaps that step's kernels), and the training stream waits for the copy on the GPU
(an event), not on the host. On a CPU rank the batches pass through. torch only."""
from __future__ import annotations

from typing import Any, Iterable, Iterator, Optional, Tuple

import torch

from estimator.data.arrays import Tensors, tensors_to


def copied_ahead(batches: Iterable[Tensors], device: torch.device) -> Iterator[Tuple[Tensors, bool]]:
    """(batch on `device`, whether it is the last) pairs. On CUDA, batch i + 1's copy is issued before batch i is
    handed over; a batch's tensors are recorded on the training stream, so that the caching allocator does not
    give their memory (allocated on the side stream) to the next copy while the step still reads it."""
    if device.type != "cuda":
        yield from with_last(batches)
        return
    side, training = torch.cuda.Stream(device), torch.cuda.current_stream(device)
    pending: Optional[Tuple[Tensors, Any]] = None
    for batch in batches:
        issued = _issue(batch, device, side)
        if pending is not None:
            yield _take(pending, training), False
        pending = issued
    if pending is not None:
        yield _take(pending, training), True


def _issue(batch: Tensors, device: torch.device, side: Any) -> Tuple[Tensors, Any]:
    with torch.cuda.stream(side):
        moved = tensors_to(batch, device)
        done = torch.cuda.Event()
        done.record(side)
    return moved, done


def _take(pending: Tuple[Tensors, Any], training: Any) -> Tensors:
    moved, done = pending
    training.wait_event(done)  # on the GPU: the step's kernels start after the copy
    for tensor in moved.each():
        tensor.record_stream(training)
    return moved


def with_last(items: Iterable[Any]) -> Iterator[Tuple[Any, bool]]:
    """(item, is_last) pairs, looking one item ahead."""
    iterator = iter(items)
    try:
        current = next(iterator)
    except StopIteration:
        return
    for following in iterator:
        yield current, False
        current = following
    yield current, True
