"""What the driver and the ranks share: the params (declared once, in param_table), the frozen spec the driver
sends to every rank, how the user's objects are pickled for the executors, numbers made plain, the monitor rule
(the best epoch, early stopping) and fault injection for tests. Imports nothing of estimator's other folders
(store, and pyspark's Param for the params' declaration, only)."""
