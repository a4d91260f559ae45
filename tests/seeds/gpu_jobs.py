"""What the GPU job scripts share (they run as their own processes, from this folder): a local-cluster session
whose one executor gets the GPU addresses a discovery script reports, as pyspark's own TorchDistributor tests
do, and the estimator's log lines kept for the test to read."""
import logging

from pyspark.sql import SparkSession


def gpu_session(app, script, executor_gpus, task_gpus, cores=2, memory_mb=1024):
    return (SparkSession.builder.master(f"local-cluster[1,{cores},{memory_mb}]").appName(app)
            .config("spark.worker.resource.gpu.amount", str(executor_gpus))
            .config("spark.worker.resource.gpu.discoveryScript", script)
            .config("spark.executor.resource.gpu.amount", str(executor_gpus))
            .config("spark.task.resource.gpu.amount", str(task_gpus))
            .config("spark.ui.showConsoleProgress", "false").getOrCreate())


def kept_log_lines():
    """The estimator's log messages from here on, in a list that grows."""
    records = []
    logging.basicConfig(level=logging.INFO)
    logging.getLogger("estimator").addHandler(type("Keep", (logging.Handler,), {
        "emit": lambda self, r: records.append(r.getMessage())})())
    return records
