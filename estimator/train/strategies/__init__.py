"""How the ranks hold and train the model: one class per strategy, one module each, behind one interface
(estimator.train.strategies.base.Strategy: place the model, wrap it, no_sync, clip, the gradients, validation in
lockstep or not, what a checkpoint holds and who writes it, teardown), and STRATEGIES, the registry the `strategy`
param names. The driver looks the class up (and asks it to check the params) and sends it to the ranks in the
launch's payload (estimator.core.spec.UserObjects.strategy), so that a class added here reaches the ranks whether
or not they can import it; each rank builds one and trains through it (estimator.train.worker). Nothing outside
this package compares a strategy's name or tests a wrapper's type (tests/test_architecture.py).

Adding one is a module with its class (usually deriving from DDP or FSDP) and a line in STRATEGIES
(CONTRIBUTING.md, 'Adding a strategy'). torch only, no pyspark."""
from __future__ import annotations

from typing import Any, Dict, Mapping

from estimator.train.strategies.auto import Auto
from estimator.train.strategies.base import Strategy
from estimator.train.strategies.ddp import DDP
from estimator.train.strategies.fsdp import FSDP

STRATEGIES: Dict[str, Any] = {
    "ddp": DDP,  # the whole model on every rank, DistributedDataParallel
    "fsdp": FSDP,  # sharded with FSDP2, checkpointed in shards
    "auto": Auto,  # fsdp's checkpoints; sharded only where the model would not fit
}


def writer_of(state: Mapping[str, Any], shards: bool) -> str:
    """The name of the strategy that wrote a checkpoint: the name it holds, or (a file that holds none, before
    0.3.0) the first registered strategy whose checkpoints take its form (`shards`: it names a folder of shards)."""
    return state.get("strategy") or next(name for name, cls in STRATEGIES.items() if cls.shards_checkpoints == shards)


__all__ = ["STRATEGIES", "Strategy", "writer_of"]
