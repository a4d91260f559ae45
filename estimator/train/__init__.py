"""One rank's training: setup (worker: the objects built whole, rank), the epochs and their history (epochs), the
step loop (loop), the strategies that place, wrap and checkpoint the model (strategies: ddp, fsdp, auto; sharding
and sharded_checkpoint do FSDP2's and DCP's work), the objectives that give a batch's loss and its named sums
(objectives, sums, weighting, losses), the user's own step or loop (steps, train_fn), a LightningModule's hooks
(lightning), checkpoints and which of them stay (checkpoint, retention), NaN checks, the process group
(distributed, host_allreduce) and TensorBoard. Runs on the executors: torch, data and core only, never pyspark."""
