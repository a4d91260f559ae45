"""Everything a batch passes through before the training loop: Parquet row groups and a rank's row range
(`parquet`), the cached and the streaming reader behind one `Shard` interface (`cached`, `streaming`,
`shards`; petastorm as a third in `petastorm`), the prefetching feed with decode workers (`feed`), and the
conversions to numpy and tensors (`arrays`; `frames` for transformation_fn, without torch). No pyspark here,
and no import from `estimator.worker`. Names are imported on first use, so that a decoding process that
imports `estimator.data.frames` does not import torch.
"""
import importlib as _importlib
from typing import Any as _Any

_MODULES = {
    "arrays": "Arrays Tensors column_to_numpy prepare_arrays reshape tensors_to to_tensors",
    "frames": "torch_dtype_array transform_batch",
    "cached": "CachedShard ShardBatches",
    "feed": "Decoders Feed feed_workers",
    "parquet": "ReadFailed Span column_max list_pieces parquet_columns pieces_of_files read_head read_rows read_span "
               "shard_range spans",
    "plan": "EpochPlan epoch_seed plan_epoch plan_steps",
    "shards": "EarlyRead Shard cache_decision memory_budget open_shards",
    "streaming": "ShuffleBuffer StreamingShard",
}
_WHERE = {name: module for module, names in _MODULES.items() for name in names.split()}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> _Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'estimator.data' has no attribute {name!r}")
    value = getattr(_importlib.import_module(f"estimator.data.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(list(globals()) + __all__)
