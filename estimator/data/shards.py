"""A rank's shards behind one interface, and the choice between keeping them in memory and streaming.

    shard.rows, shard.plan(), shard.epoch(epoch, skip=0) -> batches (dicts of numpy arrays),
    shard.describe(), shard.close()

CachedShard (in memory), StreamingShard (row groups read every epoch) and PetastormShard implement it.
`inmemory_cache_all=None` keeps the shards in memory only when they fit this rank's memory budget.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any, Dict, Iterator, Optional, Protocol, Tuple

from estimator.core.faults import Fault, inject
from estimator.core.spec import TrainSpec
from estimator.data.arrays import Arrays
from estimator.data.cached import CachedShard
from estimator.data.parquet import estimated_bytes, shard_range, spans
from estimator.data.plan import EpochPlan
from estimator.data.streaming import StreamingShard

HOST_MEMORY_SHARE = 0.25  # of the host's memory, shared by the ranks on it, without spark.executor.pyspark.memory
CACHE_OVERHEAD = 2  # reading into memory holds Arrow's table and the numpy arrays at once
SHUFFLE_BUFFER_BYTES = 64 << 20  # the default shuffle buffer: rows that fit 64 MB, between the bounds below
SHUFFLE_BUFFER_ROWS = (1_000, 100_000)


class Shard(Protocol):
    rows: int  # this rank's rows
    total: int  # the rows the plan spreads over the ranks (every rank draws total / world_size a training epoch)

    def plan(self) -> EpochPlan: ...

    def epoch(self, epoch: int, skip: int = 0) -> Iterator[Arrays]: ...

    def describe(self) -> str: ...

    def close(self) -> None: ...


def memory_budget(budget_mb: Optional[float], ranks_on_host: int) -> Tuple[int, str]:
    """Bytes this rank may use to hold its shards, and where the figure comes from."""
    if budget_mb is not None:
        return int(budget_mb * 2**20), "spark.executor.pyspark.memory per task"
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    share = int(host * HOST_MEMORY_SHARE / max(1, ranks_on_host))
    return share, f"{HOST_MEMORY_SHARE:.0%} of the host's memory over {ranks_on_host} rank(s)"


def cache_decision(setting: Optional[bool], needed: int, budget: int, source: str) -> Tuple[bool, str]:
    """(keep in memory?, why) for inmemory_cache_all=`setting` and shards needing about `needed` bytes."""
    if setting is not None:
        return setting, f"inmemory_cache_all={setting}"
    if needed <= budget:
        return True, f"train + val shards ~{_mb(needed)} fit the budget {_mb(budget)} ({source})"
    return False, f"train + val shards ~{_mb(needed)} exceed the budget {_mb(budget)} ({source})"


def open_shards(spec: TrainSpec, rank: int, world_size: int, ranks_on_host: int = 1) -> Tuple[Shard, Optional[Shard]]:
    """The training shard and the validation shard (None without validation data) of `rank`."""
    data = spec.data
    if spec.reader.kind == "petastorm":
        from estimator.data.petastorm import PetastormShard

        train = PetastormShard(spec, data.train, rank, world_size, training=True)
        return train, PetastormShard(spec, data.val, rank, world_size, training=False) if data.val else None
    if data.local is not None:  # the direct mode: the rank's own rows, the plan over the largest shard
        ranges = {"train": (0, data.train_rows), "val": (0, data.val_rows)}
        totals = {"train": data.largest_shard * world_size, "val": data.val_rows}
    else:
        ranges = {"train": shard_range(data.train_rows, rank, world_size),
                  "val": shard_range(data.val_rows, rank, world_size)}
        totals = {"train": data.train_rows, "val": data.val_rows}
    parts = {"train": spans(data.train, *ranges["train"]), "val": spans(data.val, *ranges["val"])}
    needed = CACHE_OVERHEAD * (estimated_bytes(parts["train"]) + estimated_bytes(parts["val"]))
    cached, why = cache_decision(spec.reader.inmemory_cache_all, needed,
                                 *memory_budget(spec.reader.memory_budget_mb, ranks_on_host))
    buffer_rows = shuffle_buffer_rows(spec, parts["train"])

    def open_one(split: str, training: bool) -> Shard:
        pieces = data.train if training else data.val
        why_here = why if training else ""  # one decision for both shards: said once, on the training shard's line
        if cached:
            return CachedShard(spec, pieces, *ranges[split], rank, world_size, training, why_here, totals[split])
        first = ranges[split][0] if data.local is None else 0
        return StreamingShard(spec, parts[split], totals[split], rank, world_size, training, buffer_rows, why_here,
                              first)

    return open_one("train", True), open_one("val", False) if data.val else None


def streaming_train_shard(spec: TrainSpec, rank: int, world_size: int) -> StreamingShard:
    """The training shard `rank` of `world_size` streams (materialized data: rows by global order)."""
    start, stop = shard_range(spec.data.train_rows, rank, world_size)
    parts = spans(spec.data.train, start, stop)
    return StreamingShard(spec, parts, spec.data.train_rows, rank, world_size, True, shuffle_buffer_rows(spec, parts),
                          first=start)


def shuffle_buffer_rows(spec: TrainSpec, parts) -> int:
    """shuffle_buffer_size, or by default as many rows of `parts` as fit SHUFFLE_BUFFER_BYTES."""
    configured = spec.reader.shuffle_buffer_size
    return default_buffer_rows(parts) if configured is None else configured


def default_buffer_rows(parts) -> int:
    """As many rows as fit SHUFFLE_BUFFER_BYTES (uncompressed, from the footers), within SHUFFLE_BUFFER_ROWS."""
    rows = sum(s.rows for s in parts)
    row_bytes = estimated_bytes(parts) / rows if rows else 1
    low, high = SHUFFLE_BUFFER_ROWS
    return int(min(high, max(low, SHUFFLE_BUFFER_BYTES / max(row_bytes, 1))))


def _mb(n: int) -> str:
    return f"{n / 2**20:,.0f} MB"


class EarlyRead:
    """This rank's shards, opened on a thread while the rendezvous waits for the peers.

    A rank knows its rank and the world size before the ranks meet (partition id, task count), so a
    read into memory can overlap the meeting instead of following it. The
    launcher calls `begin()` once its own warm-up is done: both need the CPU (a rank usually has one core).
    `result()` begins the read if nobody did. An error in the read is raised where the read used to
    happen: by `train_worker` on that rank, after the rendezvous.
    """

    def __init__(self, spec: TrainSpec, rank: int, world_size: int, faults: Tuple[Fault, ...] = (), attempt: int = 0,
                 ranks_on_host: int = 1):
        self.rank, self.world_size = rank, world_size
        self.seconds = 0.0  # the read itself
        self._box: Dict[str, Any] = {}
        self._train_total: Optional[int] = None
        self._thread = threading.Thread(target=self._read, args=(spec, faults, attempt, ranks_on_host), daemon=True,
                                        name=f"shard-read-rank-{rank}")

    def begin(self) -> None:
        if self._thread.ident is None:
            self._thread.start()

    def _read(self, spec: TrainSpec, faults: Tuple[Fault, ...], attempt: int, ranks_on_host: int) -> None:
        started = time.perf_counter()
        try:
            inject(faults, "read", self.rank, attempt)
            self._box["shards"] = open_shards(spec, self.rank, self.world_size, ranks_on_host)
        except BaseException as exc:  # noqa: BLE001 - raised again by result(), on the training thread
            self._box["error"] = exc
        self.seconds = time.perf_counter() - started

    def plan_over(self, total_train: int) -> None:
        """The direct mode: the training rows the plan spreads over the ranks, known only after the rendezvous
        that this read overlaps (every rank draws as many as the largest shard holds)."""
        self._train_total = total_train

    def result(self, rank: int, world_size: int) -> Tuple[Shard, Optional[Shard]]:
        if (rank, world_size) != (self.rank, self.world_size):
            raise RuntimeError(f"shards read early for rank {self.rank} of {self.world_size}, "
                               f"but this is rank {rank} of {world_size}")
        self.begin()
        self._thread.join()
        box, self._box = self._box, {}  # the arrays belong to the shards from here on
        if "error" in box:
            raise box["error"]
        train, val = box["shards"]
        if self._train_total is not None:
            train.total = self._train_total
        return train, val

    @classmethod
    def for_spec(cls, spec: TrainSpec, rank: int, world_size: int, faults: Tuple[Fault, ...] = (),
                 attempt: int = 0, ranks_on_host: int = 1) -> Optional["EarlyRead"]:
        """An early read for the Arrow reader; petastorm opens its own reader threads at training time."""
        return cls(spec, rank, world_size, faults, attempt, ranks_on_host) if spec.reader.kind != "petastorm" else None
