"""The GPUs Spark assigned to a task, read where a rank or transform's batch runs (its TaskContext): shared by
train/ (a rank's device), launch/ and predict/ (an executor's device), which is why it lives here."""
from __future__ import annotations

from typing import Any, List, Optional


def task_gpus(task: Any) -> List[str]:
    """The GPU addresses Spark assigned to a task (spark.task.resource.gpu.amount), from its TaskContext;
    empty without a task or without GPUs."""
    gpu = task.resources().get("gpu") if task is not None else None
    return list(gpu.addresses) if gpu is not None and gpu.addresses else []


def assigned_gpu(task: Any) -> Optional[str]:
    """The first GPU address Spark assigned to a task; None without a task or without GPUs."""
    addresses = task_gpus(task)
    return addresses[0] if addresses else None
