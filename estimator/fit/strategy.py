"""strategy='fsdp' checked on the driver, before any Spark job: what sharding serves, and what it refuses with
the reason and the way out (estimator.train.sharding does the sharding on the ranks)."""
from __future__ import annotations

from typing import Any, Dict

import torch

OWNER = "TorchEstimator"
PAGE = "docs/gpus.md 'Large models'"


def check_strategy(p: Dict[str, Any]) -> None:
    if p["strategy"] not in ("fsdp", "auto"):
        if p["shard_units"] is not None:
            raise ValueError(f"{OWNER}: shard_units says what strategy='fsdp' shards; with strategy="
                             f"{p['strategy']!r} nothing is sharded. Set strategy='fsdp', or leave shard_units None.")
        if p["reshard_after_forward"] is not True:
            raise ValueError(f"{OWNER}: reshard_after_forward={p['reshard_after_forward']!r} is strategy='fsdp''s "
                             f"choice; with strategy={p['strategy']!r} nothing is sharded. Set strategy='fsdp', or "
                             "leave reshard_after_forward at True.")
        return
    refused = {
        "precision": (p["precision"] == "16-mixed", "float16 with a GradScaler is DDP's; FSDP2 trains in "
                      "precision='bf16-mixed' (bfloat16 compute, float32 reduction and master weights)"),
        "gradient_compression": (getattr(p["gradient_compression"], "name", p["gradient_compression"])
                                 not in (None, "none"), "FSDP reduce-scatters the gradients itself; "
                                 "precision='bf16-mixed' halves what it gathers"),
    }
    for param, (bad, why) in refused.items():
        if bad:
            raise ValueError(f"{OWNER} with strategy={p['strategy']!r} takes no {param}={p[param]!r}: {why} ({PAGE}).")
    model, optimizer = p["model"], p["optimizer"]
    if not any(True for _ in model.parameters()):
        raise ValueError(f"{OWNER} with strategy={p['strategy']!r}: the model {type(model).__name__} has no parameters to "
                         "shard. Use strategy='ddp'.")
    if isinstance(optimizer, torch.optim.Optimizer) and optimizer.state:
        raise ValueError(f"{OWNER} with strategy={p['strategy']!r} builds the optimizer over each rank's shards, and the "
                         f"optimizer given ({type(optimizer).__name__}) has taken steps already: its state cannot be "
                         "dealt to the shards. Pass a new optimizer, or functools.partial(torch.optim.AdamW, "
                         "lr=...), to continue a run, refit its run_id.")


def check_shared_gpus(p: Dict[str, Any], gpus_per_task: float) -> None:
    """Tasks given a fraction of a GPU share it: nccl refuses two ranks on one device, and fsdp is not served over
    gloo on GPUs here (the ranks would refuse it after the rendezvous; refused here first)."""
    if p["strategy"] in ("fsdp", "auto") and 0 < gpus_per_task < 1 and p["use_gpu"] is not False:
        raise ValueError(f"{OWNER} with strategy={p['strategy']!r} needs a GPU per rank; spark.task.resource.gpu.amount="
                         f"{gpus_per_task:g} puts several tasks on one GPU. Give each task a whole GPU, set "
                         f"use_gpu=False, or use strategy='ddp' ({PAGE}).")
