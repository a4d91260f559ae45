"""One rank's training: setup (worker: model, optimizer, checkpoint restored, DDP or one rank's stand-in), the
epochs and their history (epochs), the step loop (loop), the user's own step or loop (steps, train_fn), a
LightningModule's hooks (lightning), losses and metrics, checkpoints, NaN checks, the process group
(distributed, host_allreduce) and TensorBoard. Runs on the executors: torch, data and core only, never pyspark."""
