"""Everything a batch passes through before the training loop: Parquet row groups and a rank's row range
(`parquet`), the cached and the streaming reader behind one `Shard` interface (`cached`, `streaming`,
`shards`; petastorm as a third in `petastorm`), the prefetching feed with decode workers (`feed`), and the
conversions to numpy and tensors (`arrays`). No pyspark here, and no import from `estimator.worker`.
"""
from estimator.data.arrays import (Arrays, Tensors, column_to_numpy, prepare_arrays, reshape, tensors_to, to_tensors,
                                   torch_dtype_array, transform_batch)
from estimator.data.cached import CachedShard, ShardBatches
from estimator.data.feed import Decoders, Feed, feed_workers
from estimator.data.parquet import (Span, list_pieces, parquet_columns, pieces_of_files, read_head, read_rows,
                                    read_span, shard_range, spans)
from estimator.data.plan import EpochPlan, epoch_seed, plan_epoch, plan_steps
from estimator.data.shards import EarlyRead, Shard, cache_decision, memory_budget, open_shards
from estimator.data.streaming import ShuffleBuffer, StreamingShard

__all__ = ["Arrays", "Tensors", "column_to_numpy", "prepare_arrays", "reshape", "tensors_to", "to_tensors",
           "torch_dtype_array", "transform_batch", "CachedShard", "ShardBatches", "Decoders", "Feed", "feed_workers", "Span",
           "list_pieces", "parquet_columns", "pieces_of_files", "read_head", "read_rows", "read_span", "shard_range",
           "spans", "EpochPlan", "epoch_seed", "plan_epoch", "plan_steps", "EarlyRead", "Shard", "cache_decision",
           "memory_budget", "open_shards", "ShuffleBuffer", "StreamingShard"]
