"""The `strategy` param on the driver, before any Spark job: a name of the registry (estimator.train.strategies),
whose class says what it refuses, with the reason and the way out (its strategy module does the work on the
ranks)."""
from __future__ import annotations

from typing import Any, Mapping

from estimator.core.params import one_of, param_error
from estimator.train.strategies import STRATEGIES

OWNER = "TorchEstimator"


def strategy_class(p: Mapping[str, Any]) -> Any:
    """The class the `strategy` param names; a name the registry does not hold is refused in the params' form."""
    name = p["strategy"]
    if name not in STRATEGIES:
        raise ValueError(param_error(OWNER, "strategy", one_of(list(STRATEGIES)), name))
    return STRATEGIES[name]


def check_strategy(p: Mapping[str, Any]) -> None:
    strategy_class(p).check(p["strategy"], p)


def check_shared_gpus(p: Mapping[str, Any], gpus_per_task: float) -> None:
    """What the tasks' share of a GPU (spark.task.resource.gpu.amount) allows the strategy."""
    strategy_class(p).check_gpus(p["strategy"], p, gpus_per_task)
