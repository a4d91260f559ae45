"""What the driver asks of the SparkSession, the same way on classic and Spark Connect sessions.

A Spark Connect session (Databricks serverless, standard-access clusters, `SparkSession.builder.remote`)
has no SparkContext, RDDs or JVM handles, so everything here reads public, Connect-safe APIs:
`spark.conf`, job tags. Where a classic session can tell more (the executors' task slots), that is an
optional refinement, used only when it is there.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
from typing import Any, Callable, Iterator, Optional

log = logging.getLogger("estimator")
_LOCAL = re.compile(r"local(?:\[\s*(\*|\d+)\s*(?:,\s*(\d+)\s*)?\])?")


def is_connect(spark: Any) -> bool:
    """A Spark Connect session (pyspark.sql.connect), not a classic one."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def metadata_session(io: Any) -> Any:
    """What pyspark's params metadata writer and reader take, for an MLWriter or MLReader `io`: the session on Spark
    Connect (pyspark 4 writes the metadata with a DataFrame then), else the SparkContext (pyspark 3.5 takes only
    that)."""
    return io.sparkSession if is_connect(io.sparkSession) else io.sc


def conf(spark: Any, key: str) -> Optional[str]:
    """A Spark conf value, or None when it is unset or the session may not read it."""
    try:
        value = spark.conf.get(key, None)
    except Exception:  # noqa: BLE001 - a Connect server may refuse to show some confs
        log.debug("could not read %s from the session", key, exc_info=True)
        return None
    return None if value is None else str(value)


def task_slots(spark: Any) -> Optional[int]:
    """Tasks the application can run at once, when it can be known: local[N] masters, fixed executor counts
    (spark.executor.instances x spark.executor.cores), or, on a classic session, the registered executors.
    None when unknown (e.g. dynamic allocation on a Connect session), and 0 while no executor has registered."""
    cpus = int(conf(spark, "spark.task.cpus") or 1)
    master = conf(spark, "spark.master") or ""
    local = _LOCAL.fullmatch(master)
    if local:
        cores = local.group(1) or "1"
        return max(1, (os.cpu_count() or 1) if cores == "*" else int(cores)) // cpus
    classic = _classic_slots(spark)
    if classic is not None:
        return classic
    instances, cores = conf(spark, "spark.executor.instances"), conf(spark, "spark.executor.cores")
    dynamic = (conf(spark, "spark.dynamicAllocation.enabled") or "false").lower() == "true"
    if instances and cores and not dynamic:
        return int(instances) * int(cores) // cpus
    return None


def _classic_slots(spark: Any) -> Optional[int]:
    """The optional refinement of a classic session: Spark's own count of concurrent task slots now."""
    if is_connect(spark):
        return None
    try:
        jsc = spark.sparkContext._jsc.sc()
        return int(jsc.maxNumConcurrentTasks(jsc.resourceProfileManager().defaultResourceProfile()))
    except Exception:  # noqa: BLE001 - a refinement only
        log.debug("could not count the task slots of this classic session", exc_info=True)
        return None


def default_num_proc(spark: Any) -> int:
    """num_proc when the user gave none: every task slot (times the GPUs per task: a rank per GPU)."""
    slots = task_slots(spark)
    if not slots:
        raise ValueError("The 'num_proc' parameter of TorchEstimator is needed on this session: its task slots "
                         "cannot be read (a Spark Connect session with dynamic allocation, or no executor yet). "
                         "Set num_proc to the number of training processes, at most the cluster's task slots.")
    gpus = task_gpus(spark)
    return slots * int(gpus) if gpus >= 1 else slots


def check_slots(spark: Any, num_proc: int, per_task: int = 1) -> None:
    """A barrier stage needs all its tasks at once; Spark would otherwise retry for minutes."""
    slots = task_slots(spark)
    if slots and slots < num_proc // per_task:
        if per_task > 1:
            raise ValueError(f"num_proc={num_proc} with {per_task} GPUs per task (spark.task.resource.gpu.amount) "
                             f"needs {num_proc // per_task} Spark tasks at once; this application runs at most "
                             f"{slots}. Lower num_proc or add executors/GPUs.")
        raise ValueError(f"The 'num_proc' parameter of TorchEstimator must be at most the {slots} task slots this "
                         f"Spark application has. Got {num_proc} instead. Lower num_proc or add executors/cores.")


def task_gpus(spark: Any) -> float:
    """spark.task.resource.gpu.amount: the GPUs Spark gives each task (0 when unset)."""
    value = conf(spark, "spark.task.resource.gpu.amount")
    return float(value) if value else 0.0


def ranks_per_task(spark: Any, num_proc: int) -> int:
    """How many ranks each barrier task runs: one per GPU Spark gives a task (spark.task.resource.gpu.amount
    >= 1), else one. num_proc counts ranks (as Horovod and TorchDistributor count processes), so it must be a
    multiple of the GPUs per task."""
    gpus = task_gpus(spark)
    if gpus < 1:
        return 1
    if gpus != int(gpus):
        raise ValueError(f"spark.task.resource.gpu.amount={gpus:g}: Spark gives a task a whole number of GPUs, or a "
                         "fraction below 1 (GPUs shared by tasks); this value is neither.")
    per_task = int(gpus)
    if num_proc % per_task:
        raise ValueError(f"The 'num_proc' parameter of TorchEstimator counts training processes, one per GPU: with "
                         f"spark.task.resource.gpu.amount={per_task} each Spark task runs {per_task} of them, so "
                         f"num_proc must be a multiple of {per_task}. Got {num_proc}; use "
                         f"{max(per_task, num_proc - num_proc % per_task)} or {num_proc + per_task - num_proc % per_task}.")
    return per_task


def default_retries(spark: Any) -> int:
    """Spark's own task retry budget: spark.task.maxFailures - 1, or local[N, F]'s F - 1 (local[N]: 0)."""
    local = _LOCAL.fullmatch(conf(spark, "spark.master") or "")
    if local:
        return int(local.group(2)) - 1 if local.group(2) else 0
    return max(0, int(conf(spark, "spark.task.maxFailures") or 4) - 1)


@contextlib.contextmanager
def job_tag(spark: Any, text: str) -> Iterator[Callable[[], None]]:
    """Tag the Spark jobs this thread starts inside (the Spark UI lists them by tag); yields a function that
    cancels them from any thread (`tag_canceller`). Classic sessions tag through the SparkContext (the session's
    own addTag is thread-local: another thread's interruptTag finds nothing), Connect sessions through the
    session."""
    tag = _tag(text)
    if is_connect(spark):
        add, remove = spark.addTag, spark.removeTag
    else:
        add, remove = spark.sparkContext.addJobTag, spark.sparkContext.removeJobTag
    add(tag)
    try:
        yield tag_canceller(spark, text)
    finally:
        remove(tag)


def tag_canceller(spark: Any, text: str) -> Callable[[], None]:
    """A function that cancels the jobs `job_tag(spark, text)` tagged, from any thread."""
    tag = _tag(text)
    if is_connect(spark):
        return lambda: spark.interruptTag(tag)
    return lambda: spark.sparkContext.cancelJobsWithTag(tag)


def _tag(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.:-]+", "-", text).strip("-")


def executor_python(spark: Any) -> str:
    """The Python the session's executors run, as far as the driver can tell (Spark's default: python3 on the
    executors' PATH)."""
    if not is_connect(spark):
        return str(spark.sparkContext.pythonExec)
    return conf(spark, "spark.pyspark.python") or os.environ.get("PYSPARK_PYTHON") or "python3 (Spark's default)"
