"""DPO's reference log-probabilities computed once, before training, by the model as it is built (its weights
before any step, before a checkpoint is restored), on the ranks, over all the materialized pairs (training and
validation), and kept in the store (estimator.data.reference): the steps then read them with the rows, and only one
model is held. torch only, no pyspark.

The pairs are cut into batches of `batch_size` in the order of the stored row groups; rank r computes batches r,
r + k, ... of k ranks. Every rank runs as many forwards (fsdp's are collectives): one with fewer batches repeats
its last. A table already complete (a later fit of the same rows and reference, or a retry) is read instead; each
rank then checks it against a forward of its first batch, so that a model folder changed under the same name is
found, not trained against."""
from __future__ import annotations

import hashlib
import logging
import os
import time
from typing import Any, Iterator, List, Mapping, Tuple

import cloudpickle

import numpy as np
import torch
import torch.distributed as dist

from estimator.core.adapters import base_config
from estimator.core.spec import TrainSpec
from estimator.data.arrays import prepare_arrays, to_tensors, tensors_to
from estimator.data.frames import transform_batch
from estimator.data.lm import CausalLMTokenize
from estimator.data.parquet import Span, read_span
from estimator.train.precision import precision_of
from estimator.data.reference import (ReferenceTable, is_complete, mark_complete, pair_keys, reference_folder,
                                      write_part)

log = logging.getLogger("estimator")
REFERENCE_FORMAT = 1  # of the precomputed reference's table (estimator.data.reference)
CHECK_ATOL, CHECK_RTOL = 0.05, 1e-3  # a stored log-probability agrees with a forward of the same batch


def reference_key(p: Mapping[str, Any]) -> str:
    """What names a precomputed reference's table (estimator.data.reference): the model's factory as pickled (or a
    module's weights), the tokenizer, and what changes the log-probabilities (max_length, precision, a weights
    folder). A factory's model read from a local folder (its config's name_or_path) adds the folder's files, by
    name, size and modification time: a model saved again under the same name gets a table of its own. A change
    the key does not see (a hub model's new revision) is caught by the ranks, which check the table against a
    forward before using it."""
    digest = hashlib.blake2b(digest_size=12)
    if p["model_factory"] is not None:
        digest.update(cloudpickle.dumps(p["model_factory"]))
        digest.update(repr(_folder_files(p["model"])).encode())
    else:
        model = p["model"]
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        for name, tensor in base.state_dict().items():
            if "lora_" not in name:  # the adapters are new in each fit, and off in the reference
                digest.update(name.encode())
                digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    digest.update(cloudpickle.dumps(p["tokenizer"]))
    digest.update(repr((p["max_length"], p["precision"], p["weights_folder"], REFERENCE_FORMAT)).encode())
    return digest.hexdigest()


def _folder_files(model: Any) -> list:
    """(path, size, mtime) of each file of the local folder a Hugging Face model was read from; [] for none."""
    folder = getattr(base_config(model), "name_or_path", None)
    if not isinstance(folder, str) or not folder or not os.path.isdir(folder):
        return []
    found = []
    for root, dirs, names in os.walk(folder):
        dirs.sort()
        for name in sorted(names):
            path = os.path.join(root, name)
            stat = os.stat(path)
            found.append((os.path.relpath(path, folder), stat.st_size, stat.st_mtime_ns))
    return found


class ReferenceMismatch(ValueError):
    """A DPO fit's stored reference log-probabilities (`DPO(reference="precomputed")`, kept beside the rows in the
    store) differ from what the model computes for the same batch: the model changed in a way its table's name does
    not show (a model read from a local folder names its table by the folder's files too; a hub model's new
    revision does not). The fit is refused, not retried; remove the folder the message names to compute them
    again."""


def precompute(spec: TrainSpec, ctx: Any, objs: Any, model: Any, logps: Any) -> None:
    """The table of the fit's pairs in the store, complete on every rank's return. `logps(model, features, labels)`:
    the rows' answer log-probabilities (the objective's)."""
    data, device = spec.data, torch.device(ctx.device)
    folder = reference_folder(data)
    store = data.store
    every = list(spans(data.train + data.val, spec.batch_size))
    batches = every[ctx.rank::ctx.world_size]
    spare = batches[0] if batches else every[0]  # a rank with no batch of its own joins the forwards with this one
    done = agreed(is_complete(store, folder), device, dist.ReduceOp.MIN)
    score = Scorer(spec, objs, model, logps, device)
    if done:
        mismatch = score.check(spare, ReferenceTable(store, folder))
        if agreed(mismatch, device, dist.ReduceOp.MAX):
            raise ReferenceMismatch(
                f"The reference log-probabilities stored in {folder} are not what this model computes for the same "
                "pairs (checked on each rank's first batch): the model, or its folder, changed under the same name. "
                "Remove that folder to compute them again.")
        log.info("rank %d: DPO's reference log-probabilities read from %s", ctx.rank, folder)
        return
    started = time.perf_counter()
    forwards = int(agreed(len(batches), device, dist.ReduceOp.MAX, torch.int64))
    keys: List[np.ndarray] = []
    values: List[np.ndarray] = []
    for index in range(forwards):
        found = score(batches[index] if index < len(batches) else spare)
        if index < len(batches):  # else a forward that counts for nothing, for the ranks' collectives
            keys.append(found[0])
            values.append(found[1])
    pairs = np.concatenate(keys) if keys else np.zeros(0, dtype=np.int64)
    logps_all = np.concatenate(values, axis=1) if values else np.zeros((2, 0))
    write_part(store, folder, ctx.rank, pairs, logps_all[0], logps_all[1])
    total = int(agreed(len(pairs), device, dist.ReduceOp.SUM, torch.int64))  # every part is written
    if ctx.rank == 0:
        mark_complete(store, folder, ctx.world_size, total)
    agreed(True, device, dist.ReduceOp.MIN)  # the marker is there before any rank goes on
    log.info("rank %d: DPO's reference log-probabilities of %d pairs (%d here) in %.1f s, kept in %s", ctx.rank,
             total, len(pairs), time.perf_counter() - started, folder)


def agreed(value: Any, device: torch.device, op: Any, dtype: torch.dtype = torch.float64) -> Any:
    """`value` reduced over the ranks by `op` (a bool or a number)."""
    tensor = torch.tensor([float(value)], dtype=dtype, device=device)
    dist.all_reduce(tensor, op=op)
    result = tensor.item()
    return bool(result) if isinstance(value, bool) else result


def spans(pieces: Any, rows: int) -> Iterator[Span]:
    """The stored rows in batches of `rows`, row group by row group (a row group's last batch may be shorter)."""
    for piece in pieces:
        for lo in range(0, piece.num_rows, rows):
            yield Span(piece, lo, min(lo + rows, piece.num_rows))


class Scorer:
    """A batch of stored pairs read, transformed and tokenized as the training steps will be, and scored by
    `logps` (in eval mode: DPO's reference_scores) without gradients, under the fit's autocast."""

    def __init__(self, spec: TrainSpec, objs: Any, model: Any, logps: Any, device: torch.device):
        self.spec, self.objs, self.model, self.logps, self.device = spec, objs, model, logps, device
        self.tokenize = CausalLMTokenize(objs.tokenizer, spec.data.lm, spec.data.max_length)
        self.precision = precision_of(spec.precision)(device, scaler_state=None)  # its autocast, built once

    def __call__(self, span: Span) -> Tuple[np.ndarray, np.ndarray]:
        """The pairs' keys and their (chosen, rejected) log-probabilities, (2, pairs)."""
        data = self.spec.data
        chunks = list(read_span(data.store, span, data.columns, span.rows))
        batch = {c: np.concatenate([chunk[c] for chunk in chunks]) for c in data.columns}
        arrays = prepare_arrays(data, batch)
        if self.objs.transformation_fn is not None:
            arrays = transform_batch(self.objs.transformation_fn, arrays)
        keys = pair_keys(arrays, data.lm.rows)
        return keys, self.scored(arrays).reshape(2, -1)

    def scored(self, arrays: Any) -> np.ndarray:
        tensors = tensors_to(to_tensors(self.tokenize(arrays), self.spec.data), self.device)
        with torch.no_grad(), self.precision.autocast():
            out = self.logps(self.model, tensors.features, tensors.labels[0])
        return out.double().cpu().numpy()

    def check(self, span: Span, table: ReferenceTable) -> bool:
        """Whether the stored values disagree with this model's on `span`."""
        keys, live = self(span)
        stored = table.lookup(keys).reshape(2, -1)
        return not bool(np.allclose(stored, live, atol=CHECK_ATOL, rtol=CHECK_RTOL))

