"""Starting the ranks: Spark barrier tasks (spark: classic and Connect sessions) or local processes (local), the
rendezvous (rank 0's TCPStore, every rank checked in), several ranks in one task (task_ranks), a rank's setup
inside its task (rank_setup), a launch's heartbeat and its failure watch, and the driver's view of the
SparkSession and of the executors' Python (session, shipping). Imports train, data and core; never fit."""
