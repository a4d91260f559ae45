"""strategy='auto': fsdp's checkpoints (folders of shards, so that a run resumes whatever is decided at another
number of ranks) and fsdp's limits on the driver; on the ranks, the model sharded only where its training state
would not fit (estimator.train.sharding.auto_shards: GPU ranks that could not hold its parameters, gradients and
Adam's state in half their memory), else trained whole as with ddp. The decision is said in rank 0's log and in
how the gradients are averaged. torch only, no pyspark."""
from __future__ import annotations

import logging

from torch import nn

from estimator.train.sharding import auto_shards
from estimator.train.strategies.fsdp import FSDP

log = logging.getLogger("estimator")


class Auto(FSDP):
    """FSDP where sharding pays: the same decision on every rank (auto_shards reduces over them)."""

    writes_as = "fsdp"  # its checkpoints are fsdp's, whatever it decides
    chosen = ""

    def shards(self, model: nn.Module) -> bool:
        sharded, why = auto_shards(model, self.device, self.ctx.world_size)
        self.chosen = f"strategy={self.name!r}: {why}"
        if self.ctx.rank == 0:
            log.info("%s", self.chosen)
        return sharded

    def describe(self) -> str:
        return f"{super().describe()}; {self.chosen}"
