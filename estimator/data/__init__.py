"""Everything a batch passes through before the training loop: Parquet row groups and a rank's row range
(`parquet`), the cached and the streaming reader behind one `Shard` interface (`cached`, `streaming`,
`shards`; petastorm as a third in `petastorm`), the draws a short rank takes again, marked so that the loop
leaves them out (`repeats`), the prefetching feed with decode workers (`feed`), and the
conversions to numpy and tensors (`arrays`; `frames` for transformation_fn, without torch). No pyspark here,
and no import from `estimator.train.worker`. Import each name from its module (`from estimator.data.shards import
EarlyRead`): this package imports nothing itself, so that a decoding process that imports
`estimator.data.frames` does not import torch.
"""
