"""packing=True with shuffle=True: each window of a rank's training batches holds the same rows, spread over the
window's batches so that the batches are about equally long. A packed batch costs what its tokens cost, and the
ranks step together, so a step lasts as long as its longest rank's batch: balanced batches make every rank's
batch about its window's mean (rows of 2 to 200 tokens, 2 ranks of 8: 1.69-1.72x fewer positions than padded
batches, against 1.57-1.62x for the shuffle's batches as drawn). The rows of a window are the shuffle's, each
trained once in the epoch, and every batch keeps its size; the order is a function of the drawn batches only, so
a resumed epoch reads from its window's first batch and drops the balanced batches already trained.

A row's length here is the characters it is tokenized from (tokenizing happens later, on the decoding threads):
close enough to order rows, never read as a count."""
from __future__ import annotations

import heapq
from typing import Dict, Iterator, List

import numpy as np

from estimator.core.spec import LMSpec

WINDOW = 8  # batches balanced together: the rows of a window wait at most this many steps longer to be trained
Arrays = Dict[str, np.ndarray]


def balanced_groups(lengths: np.ndarray, sizes: List[int]) -> List[np.ndarray]:
    """Indices into `lengths` for groups of the given sizes, longest rows first each to the group with the least
    length so far that has room (ties: the lower group, the earlier row); each group's indices ascending."""
    heap = [(0, g) for g, size in enumerate(sizes) if size > 0]
    heapq.heapify(heap)
    groups: List[List[int]] = [[] for _ in sizes]
    for i in np.argsort(-lengths, kind="stable"):
        total, g = heapq.heappop(heap)
        groups[g].append(int(i))
        if len(groups[g]) < sizes[g]:
            heapq.heappush(heap, (total + int(lengths[i]), g))
    return [np.sort(np.array(g, dtype=np.int64)) for g in groups]


def balance(batches: Iterator[Arrays], spec: LMSpec, drop: int = 0, window: int = WINDOW) -> Iterator[Arrays]:
    """`batches` (from a window's first batch) as balanced windows of `window` batches; the first `drop` batches
    (a resumed epoch's, already trained) not yielded."""
    pending: List[Arrays] = []
    for batch in batches:
        pending.append(batch)
        if len(pending) == window:
            yield from _window(pending, spec, drop)
            pending, drop = [], max(0, drop - window)
    if pending:
        yield from _window(pending, spec, drop)


def _window(batches: List[Arrays], spec: LMSpec, drop: int) -> Iterator[Arrays]:
    rows = {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}
    sizes = [len(next(iter(b.values()))) for b in batches]
    for group in balanced_groups(spec.rows.lengths(rows), sizes)[drop:]:
        yield {k: v[group] for k, v in rows.items()}
