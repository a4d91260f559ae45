"""The petastorm shard reader (`reader="petastorm"`), for the Spark 3.5 stack where petastorm runs.

petastorm shards by row group (rank r reads row groups r, r + world, ...), so materialization
always writes at least one row group per rank. Training streams an endless, row-group-shuffled
reader and re-batches it into exactly the same number of equal batches on every rank; validation
reads the rank's row groups exactly once per epoch. With inmemory_cache_all the shard is read once
and then served from memory.
"""
from __future__ import annotations

import itertools
from typing import Any, Dict, Iterator, List, Optional, Sequence

import numpy as np

from estimator.core.spec import Piece, TrainSpec, total_rows
from estimator.data.arrays import prepare_arrays
from estimator.data.cached import ShardBatches
from estimator.data.plan import EpochPlan, epoch_seed, plan_epoch
from estimator.data.repeats import leaves_out
from estimator.data.streaming import in_order, rows_in

PINS = ("pyspark 3.5.9, pyarrow 14.0.2, numpy 1.26.4, pandas 2.2.3 and petastorm 0.12.1 (pip install "
        "pyspark==3.5.9 pyarrow==14.0.2 numpy==1.26.4 pandas==2.2.3 petastorm==0.12.1)")


def check_petastorm() -> None:
    """A clear error, on the driver, when petastorm cannot run in this environment."""
    import pyarrow

    if int(pyarrow.__version__.split(".")[0]) >= 15:  # first: petastorm 0.12 installs beside pyarrow 26, then fails
        raise ValueError(f"reader='petastorm' needs pyarrow < 15 (found {pyarrow.__version__}), which pyspark 4 does "
                         f"not run on: petastorm runs on the Spark 3.5 stack, {PINS}. Use the default "
                         "reader='arrow' on this stack.")
    try:
        import petastorm  # noqa: F401
    except ImportError as exc:
        raise ValueError(f"reader='petastorm' needs petastorm, which is not importable here ({exc}). It runs on "
                         f"{PINS}; or use the default reader='arrow'.") from None


class PetastormShard:
    def __init__(self, spec: TrainSpec, pieces: Sequence[Piece], rank: int, world_size: int, training: bool):
        self.spec, self.rank, self.world_size, self.training = spec, rank, world_size, training
        # the committed files themselves, never the folder: a failed task attempt's leftovers are not read
        self.files = list(dict.fromkeys(piece.path for piece in pieces))
        self.total = total_rows(pieces)
        groups = range(rank, len(pieces), world_size)
        self.rows = sum(pieces[i].num_rows for i in groups)
        self.options = spec.reader
        self.workers = (self.options.train_workers if training else self.options.val_workers) or 1
        self.pool_type = "thread" if self.options.pool_type == "auto" else self.options.pool_type  # its readers'
        self.cache: Optional[ShardBatches] = None
        self.stream: Optional[Iterator[Dict[str, np.ndarray]]] = None
        self.readers: List[Any] = []

    def _reader(self, num_epochs: Optional[int], seed: int):
        from petastorm import make_batch_reader

        reader = make_batch_reader(
            [self.spec.data.store.url(path) for path in self.files], schema_fields=list(self.spec.data.columns),
            cur_shard=self.rank, shard_count=self.world_size, num_epochs=num_epochs,
            shuffle_row_groups=self.spec.shuffle and self.training, seed=seed,
            reader_pool_type=self.pool_type, workers_count=self.workers)
        self.readers.append(reader)
        return reader

    def _row_groups(self, num_epochs: Optional[int], seed: int) -> Iterator[Dict[str, np.ndarray]]:
        if self.rows == 0:
            return iter(())
        return (prepare_arrays(self.spec.data, batch._asdict()) for batch in self._reader(num_epochs, seed))

    def _cached(self) -> ShardBatches:
        if self.cache is None:
            chunks = list(self._row_groups(1, self.spec.seed))
            arrays = {k: np.concatenate([c[k] for c in chunks]) for k in chunks[0]} if chunks else {}
            self.cache = ShardBatches(arrays, self.rows)
        return self.cache

    def plan(self) -> EpochPlan:
        return plan_epoch(self.spec, self.total, self.rows, self.world_size, self.training)

    def epoch(self, epoch: int, skip: int = 0) -> Iterator[Dict[str, np.ndarray]]:
        if skip:  # petastorm's training stream runs across epochs: a position inside one cannot be replayed
            raise ValueError("reader='petastorm' cannot resume inside an epoch; use checkpoint_steps=None with it.")
        spec, plan = self.spec, self.plan()
        if self.options.inmemory_cache_all:
            seed = epoch_seed(spec.seed, epoch, self.rank).entropy if self.training else 0
            return self._cached().epoch(plan.batch_size, plan.steps, plan.items, plan.shuffle, seed,
                                        passes=self.training and leaves_out(spec))
        if not self.training:
            return rebatch(self._row_groups(1, 0), plan.batch_size, plan.steps, False, None)
        if self.stream is None:  # one endless reader for the whole run
            self.stream = self._row_groups(None, spec.seed + self.rank)
        return rebatch(self.stream, plan.batch_size, plan.steps, plan.shuffle,
                       np.random.default_rng(epoch_seed(spec.seed, epoch, self.rank)))

    def describe(self) -> str:
        cached = ", cached" if self.options.inmemory_cache_all else ""
        return f"petastorm({self.pool_type}, workers={self.workers}{cached})"

    def close(self) -> None:
        for reader in self.readers:
            reader.stop()
            reader.join()
        self.readers = []


def rebatch(chunks: Iterator[Dict[str, np.ndarray]], batch_size: int, steps: int, shuffle: bool,
            rng: Optional[np.random.Generator]) -> Iterator[Dict[str, np.ndarray]]:
    """Up to `steps` batches of `batch_size` rows from a stream of row groups (rows shuffled within
    each row group when asked). A finite stream ends with its last, possibly smaller, batch."""
    def permuted(chunk: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        order = rng.permutation(rows_in(chunk))
        return {k: v[order] for k, v in chunk.items()}

    rows = map(permuted, chunks) if shuffle and rng is not None else chunks
    return itertools.islice(in_order(rows, batch_size), steps)
