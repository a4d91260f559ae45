"""The rest of an epoch that was interrupted under another rank count, batch size or reader: a run checkpointed
inside an epoch at num_proc=4 continues at num_proc=2 (or back up) over exactly the rows the old ranks had not
yet trained on in that epoch, each once, dealt anew to the new ranks; the epochs after it are the new world's.
(An epoch of train_steps_per_epoch batches is not a pass: its rest is the draws the old ranks' plan had left.)

Which rows were done does not need to be stored: both Arrow readers' orders are functions of (seed, epoch, rank),
the old layout and the Parquet footers, so the checkpoint's position (batches done, batch size, rank count,
reader, steps per epoch) says which global rows the old ranks served. The in-memory reader's order is
estimator.data.cached's draw_order; the streaming reader's is its own draws replayed over row ids instead of rows
(no row is read). Where the old ranks read in memory, the new ones too, and the global batch is the same (old
batch_size x ranks = new), the rest trains the old ranks' own global batches, each dealt to the new ranks in
parts that differ by at most a row (a shorter one draws a row again, marked as a repeat): the steps of the
uninterrupted run, so its weights (`kept_batches`). Otherwise the rows left are dealt
in balanced contiguous slices of their global order, each rank's slice shuffled by (seed, epoch, rank, ranks);
ranks whose slices are one row shorter draw one row again so that every rank takes the same steps (the rule of
every epoch), marked as a repeat that the built-in loop does not train (estimator.data.repeats). A streaming
rank streams its slice (memory stays bounded); an in-memory one reads its rows into memory. torch only."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Iterator, List, Optional, Tuple

import numpy as np

from estimator.data.arrays import Arrays, prepare_arrays
from estimator.data.cached import draw_order
from estimator.data.parquet import read_rows, shard_range, spans
from estimator.data.plan import epoch_seed, plan_steps
from estimator.data.repeats import REPEAT, leaves_out, marked
from estimator.data.shards import Shard, streaming_train_shard
from estimator.data.streaming import StreamingShard


def left_rows(spec, total: int, epoch: int, layout: List[int], steps: int) -> np.ndarray:
    """How many more times each of the `total` global training rows is trained in `epoch`, which the ranks of
    `layout` ([batch_size, ranks, in memory, order known, train_steps_per_epoch or 0]) left after `steps`
    batches: an epoch of whole passes, once for each row they had not served (a byte a row); an epoch of
    train_steps_per_epoch batches, as often as their plan drew it after those batches (4 bytes a row)."""
    batch_size, world_size, in_memory, _, per_epoch = (int(v) for v in layout[:5])
    old = dataclasses.replace(spec, batch_size=batch_size, train_steps_per_epoch=per_epoch or None)
    left = np.zeros(total, dtype=np.int32) if per_epoch else np.ones(total, dtype=np.uint8)
    done = steps * batch_size
    for rank in range(world_size):
        at = 0
        for ids in drawn(old, total, epoch, rank, world_size, bool(in_memory), None if per_epoch else steps):
            if per_epoch:  # the draws after the first `done`
                np.add.at(left, ids[max(done - at, 0):], 1)
            else:
                left[ids] = 0
            at += len(ids)
    return left


def drawn(spec, total: int, epoch: int, rank: int, world_size: int, in_memory: bool,
          steps: Optional[int]) -> Iterator[np.ndarray]:
    """The global row ids `rank` of `world_size` draws in `epoch` (its first `steps` batches; all of them with
    None), in order, a batch or the whole epoch at a time, without reading a row."""
    if not in_memory:
        return streaming_train_shard(spec, rank, world_size).drawn(epoch, steps)
    start, stop = shard_range(total, rank, world_size)
    batches, items = plan_steps(total, world_size, spec.batch_size, spec.train_steps_per_epoch, spec.drop_last)
    order = draw_order(stop - start, items, spec.shuffle, epoch_seed(spec.seed, epoch, rank).entropy)
    return iter([start + order[:(batches if steps is None else steps) * spec.batch_size]])


def left_slice(left: np.ndarray, start: int, stop: int, block: int = 1 << 20) -> np.ndarray:
    """Draws `start`..`stop` of the rows `left` (each id as often as it is left), in id order (found a block at
    a time: memory for this slice only)."""
    out, seen = [], 0
    for lo in range(0, len(left), block):
        counts = left[lo:lo + block]
        at = np.flatnonzero(counts)
        ids = at if left.dtype == np.uint8 else np.repeat(at, counts[at])  # uint8: 0 or 1 each
        ids += lo
        take = ids[max(start - seen, 0):max(stop - seen, 0)]
        if len(take):
            out.append(take)
        seen += len(ids)
        if seen >= stop:
            break
    return np.concatenate(out) if len(out) > 1 else out[0] if out else np.empty((0,), dtype=np.int64)


def kept_batches(spec, total: int, epoch: int, layout: List[int], steps: int, rank: int,
                 world_size: int) -> Optional[Tuple[np.ndarray, np.ndarray]]:
    """This rank's part of each global batch the old ranks had left after `steps`, in training order, and which of
    its draws are repeats: old rank r's batch t is rows [t*b, (t+1)*b) of its draw order (less the draws it took
    again, in an epoch that leaves them out: estimator.data.repeats), the global batch t is theirs together, and
    new rank q takes the q-th of world_size parts of it. Parts differ by at most a row (a short last batch); a
    shorter one draws one of the batch's rows again, marked as a repeat, so every rank takes the same steps. None
    when that cannot hold the uninterrupted run's steps: the old ranks streamed (their orders are replayed batch
    by batch elsewhere) or the global batch changed."""
    batch_size, old_world, in_memory, _, per_epoch = (int(v) for v in layout[:5])
    if not in_memory or batch_size * old_world != spec.batch_size * world_size:
        return None
    old = dataclasses.replace(spec, batch_size=batch_size, train_steps_per_epoch=per_epoch or None)
    orders = [np.concatenate(list(drawn(old, total, epoch, r, old_world, True, None))) for r in range(old_world)]
    if len({len(order) for order in orders}) != 1:
        return None
    real = [len(range(*shard_range(total, r, old_world))) if leaves_out(old) else len(orders[r])
            for r in range(old_world)]  # an old rank's draws from there on were repeats, not trained
    mine, again = [], []
    for begin in range(steps * batch_size, len(orders[0]), batch_size):
        batch = np.concatenate([order[begin:min(begin + batch_size, max(real[r], begin))]
                                for r, order in enumerate(orders)])
        if len(batch) == 0:
            break
        parts = np.array_split(batch, world_size)
        part, width = parts[rank], len(parts[0])
        mine.append(np.concatenate([part, np.resize(batch, width - len(part))]))
        again.append(np.arange(width) >= len(part))
    if not mine:
        return np.empty((0,), dtype=np.int64), np.empty((0,), dtype=bool)
    return np.concatenate(mine), np.concatenate(again)


def read_kept(data, ids: np.ndarray, chunk: int = 1 << 16) -> Arrays:
    """The rows `ids` (any order, repeats allowed) as arrays in that order, read a chunk of global rows at a time
    and only those rows kept (memory: this rank's rows and one chunk)."""
    wanted = np.unique(ids)
    parts = []
    for lo in range(int(wanted[0]), int(wanted[-1]) + 1, chunk):
        hi = min(lo + chunk, int(wanted[-1]) + 1)
        here = wanted[(wanted >= lo) & (wanted < hi)]
        if len(here):
            arrays = prepare_arrays(data, read_rows(data.source, data.train, lo, hi, data.columns))
            parts.append({k: v[here - lo] for k, v in arrays.items()})
    rows = {k: np.concatenate([part[k] for part in parts]) for k in parts[0]}
    at = np.searchsorted(wanted, ids)
    return {k: v[at] for k, v in rows.items()}


@dataclass(frozen=True)
class Remainder:
    """This rank's part of the rest of an interrupted epoch."""

    rows: np.ndarray  # its global row ids, sorted (an id twice: a row drawn twice, train_steps_per_epoch)
    draws: int  # rows every rank trains on: a part one row shorter draws one again
    seed: List[int]  # of the order they are trained in
    batch_size: int
    kept: bool = False  # `rows` is in training order, the old global batches' parts (kept_batches)
    own: int = -1  # of `rows`, those dealt to this rank (fewer left rows than ranks: 0), the draws past them repeats
    # to leave out (estimator.data.repeats.leaves_out); -1: none left out
    again: Optional[np.ndarray] = None  # kept: which of `rows` are a short part's repeats

    @property
    def steps(self) -> int:  # the same on every rank
        return math.ceil(self.draws / self.batch_size)

    @staticmethod
    def plan(spec, total: int, epoch: int, layout: List[int], old_steps: int, rank: int,
             world_size: int, in_memory: bool = False) -> "Remainder":
        kept = kept_batches(spec, total, epoch, layout, old_steps, rank, world_size) if in_memory else None
        if kept is not None:
            return Remainder(kept[0], len(kept[0]), [], spec.batch_size, kept=True, again=kept[1])
        counts = left_rows(spec, total, epoch, layout, old_steps)
        left = int(counts.sum(dtype=np.int64))
        start, stop = shard_range(left, rank, world_size)
        draws = math.ceil(left / world_size)
        if spec.drop_last:  # full batches only: the rest's last partial batch is not trained
            draws -= draws % spec.batch_size
        mine = left_slice(counts, start, stop) if stop > start else left_slice(counts, 0, draws)  # fewer than ranks
        return Remainder(mine, draws, [*epoch_seed(spec.seed, epoch, rank).entropy, world_size], spec.batch_size,
                         own=stop - start if leaves_out(spec) else -1)

    @property
    def real(self) -> Optional[int]:
        """The draws before the first repeat (estimator.data.repeats), or None without one."""
        return self.own if 0 <= self.own < self.draws else None

    @property
    def repeats(self) -> bool:
        """Whether this rank draws a repeat that the built-in loop leaves out."""
        return self.real is not None or (self.again is not None and bool(self.again.any()))

    def batches(self, spec, train: Shard) -> Iterator[Arrays]:
        """Streamed when `train` streams (only these rows kept from the row groups that hold them), else read
        into memory (the span of global rows that holds them)."""
        if len(self.rows) == 0:
            return
        data = spec.data
        if self.kept:  # the old global batches' parts, in their order
            arrays = read_kept(data, self.rows)
            if self.repeats:
                arrays[REPEAT] = self.again
            for step in range(self.steps):
                yield {k: v[step * self.batch_size:(step + 1) * self.batch_size] for k, v in arrays.items()}
            return
        lo, hi = int(self.rows[0]), int(self.rows[-1]) + 1
        if isinstance(train, StreamingShard):
            stream = StreamingShard(spec, spans(data.train, lo, hi), train.total, train.rank, train.world_size, True,
                                    train.buffer_rows, first=lo, keep=self.rows)
            rng = np.random.default_rng(self.seed) if spec.shuffle else None
            for batch in stream.batches(self.draws, self.batch_size, spec.shuffle, rng, real=self.real):
                yield prepare_arrays(data, batch)
            return
        arrays = prepare_arrays(data, read_rows(data.source, data.train, lo, hi, data.columns))
        order = self.rows[draw_order(len(self.rows), self.draws, spec.shuffle, self.seed)] - lo
        for step in range(self.steps):
            idx = order[step * self.batch_size:(step + 1) * self.batch_size]
            yield marked({k: v[idx] for k, v in arrays.items()}, step * self.batch_size, self.real)


def known_order(spec) -> bool:
    """Whether the rows an epoch of this spec draws can be replayed: the Arrow readers' over materialized data
    (not petastorm's order, not the direct mode's partitions)."""
    return spec.reader.kind == "arrow" and spec.data.local is None


def replayable(spec, layout: list, step: int) -> bool:
    """Whether the rows left after `step` batches under `layout` (a checkpoint's [batch_size, ranks, in memory,
    order known, train_steps_per_epoch or 0, balanced window or 0]; older checkpoints end before the window) can
    be known, and this run can train them. Inside a balanced window (estimator.data.balance) the rows done depend
    on the rows' lengths, which the replay never reads: not known."""
    window = int(layout[5]) if len(layout) == 6 else 0
    return len(layout) in (5, 6) and bool(layout[3]) and known_order(spec) and (not window or step % window == 0)


def remainder_for(spec, train: Shard, epoch: int, layout: list, rank: int, world_size: int,
                  step: int) -> Optional[Remainder]:
    """The rest of `epoch` for this rank when the checkpoint's layout (batch size, rank count, reader) differs
    from this run's and the done rows can be known; None: the epoch starts over."""
    if not replayable(spec, layout, step):
        return None
    return Remainder.plan(spec, train.total, epoch, layout, step, rank, world_size,
                          in_memory=not isinstance(train, StreamingShard))
