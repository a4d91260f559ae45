"""The reference model's log-probabilities of preference pairs, computed once and kept in the store
(estimator.train.objectives.reference computes them; DPO(reference='precomputed')). numpy and pyarrow, no torch: the
lookup runs where the rows are tokenized (estimator.data.lm).

A pair is keyed by its content: a 64-bit hash of its prompt, chosen and rejected values as the tokenizer is given
them (after transformation_fn), so the table holds for those rows however they are sharded, shuffled or resumed, on
any number of ranks. The table lies beside the materialized rows it was computed for, under the key of the model,
tokenizer and settings that computed it (estimator.train.objectives.reference.reference_key): a later fit of the same rows with
the same reference finds it, as does a retry. Each rank writes its part; a marker written after every part names
the table complete."""
from __future__ import annotations

import hashlib
import json
import posixpath
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from estimator.core.spec import DataSpec
from estimator.data.lm import plain_value

COMPLETE = "_COMPLETE.json"
FOLDER = "reference"


def pair_keys(batch: Dict[str, Any], pairs: Any) -> np.ndarray:
    """Each pair's key (int64): a hash of its prompt, chosen and rejected values (`pairs`: their format,
    estimator.data.rows.Pairs)."""
    keys = np.empty(len(batch[pairs.column]), dtype=np.int64)
    for i, values in enumerate(zip(*(batch[c] for c in pairs.read))):
        text = json.dumps([plain_value(v) for v in values], sort_keys=True, default=str, ensure_ascii=False)
        keys[i] = np.frombuffer(hashlib.blake2b(text.encode(), digest_size=8).digest(), dtype=np.int64)[0]
    return keys


def reference_folder(data: DataSpec) -> str:
    """Where the table of `data`'s pairs lies: beside the materialized rows (their attempt folder), under the key of
    the reference that computed it."""
    if data.lm is None or data.lm.rows.stored_key is None:
        raise ValueError("The rows are no preference pairs with a precomputed reference (estimator.data.rows.Pairs.reference).")
    if data.local is not None or not data.train:
        raise ValueError("Precomputed reference log-probabilities are kept beside the materialized rows in the store; "
                         "these rows are not materialized (data_mode='direct'). Set data_mode='materialize'.")
    attempt = posixpath.dirname(posixpath.dirname(data.train[0].path))
    return posixpath.join(attempt, FOLDER, data.lm.rows.stored_key)


def stored_reference(data: DataSpec) -> Optional["ReferenceTable"]:
    """The table a rank's training and validation batches read their reference from; None where the pairs' reference
    is computed live (or the rows are no pairs)."""
    if data.lm is None or data.lm.rows.stored_key is None:
        return None
    return ReferenceTable(data.store, reference_folder(data))


def part_path(folder: str, rank: int) -> str:
    return posixpath.join(folder, f"part-{rank:05d}.parquet")


def write_part(store: Any, folder: str, rank: int, keys: np.ndarray, chosen: np.ndarray, rejected: np.ndarray
               ) -> None:
    """One rank's pairs: key, the chosen answer's and the rejected one's summed log-probability (float64)."""
    table = pa.table({"key": pa.array(keys, pa.int64()), "chosen": pa.array(chosen, pa.float64()),
                      "rejected": pa.array(rejected, pa.float64())})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    store.write_bytes_atomic(part_path(folder, rank), sink.getvalue().to_pybytes())


def mark_complete(store: Any, folder: str, parts: int, pairs: int) -> None:
    store.write_bytes_atomic(posixpath.join(folder, COMPLETE), json.dumps({"parts": parts, "pairs": pairs}).encode())


def is_complete(store: Any, folder: str) -> bool:
    return store.exists(posixpath.join(folder, COMPLETE))


class ReferenceTable:
    """The table, read from the store at its first lookup (in whichever process tokenizes), sorted by key."""

    def __init__(self, store: Any, folder: str):
        self.store, self.folder = store, folder
        self._table: Optional[Tuple[np.ndarray, np.ndarray, np.ndarray]] = None

    def __getstate__(self) -> Dict[str, Any]:  # sent to decoding processes without what was read
        return {"store": self.store, "folder": self.folder, "_table": None}

    def table(self) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self._table is None:
            parts: List[pa.Table] = [pq.read_table(pa.BufferReader(self.store.read_bytes(path)))
                                     for path in self.store.find(self.folder, ".parquet")]
            whole = pa.concat_tables(parts) if parts else pa.table({"key": pa.array([], pa.int64()),
                                                                     "chosen": pa.array([], pa.float64()),
                                                                     "rejected": pa.array([], pa.float64())})
            keys = whole.column("key").to_numpy()
            order = np.argsort(keys, kind="stable")
            self._table = (keys[order], whole.column("chosen").to_numpy()[order],
                           whole.column("rejected").to_numpy()[order])
        return self._table

    def __call__(self, batch: Dict[str, Any], pairs: Any) -> np.ndarray:
        """The batch's pairs' reference log-probabilities as its tokenized rows hold them: the chosen answers',
        then the rejected ones' (2b,)."""
        return self.lookup(pair_keys(batch, pairs))

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        known, chosen, rejected = self.table()
        at = np.searchsorted(known, keys).clip(max=max(len(known) - 1, 0))
        found = (known[at] == keys) if len(known) else np.zeros(len(keys), dtype=bool)
        if not found.all():
            raise ValueError(f"{int((~found).sum())} of {len(keys)} preference pairs have no reference "
                             f"log-probabilities in {self.folder}: the table was computed for other rows (a "
                             "transformation_fn that changes them between epochs?). Remove that folder to compute "
                             "it again, or keep transformation_fn deterministic.")
        return np.concatenate([chosen[at], rejected[at]])
