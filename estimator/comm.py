"""How DDP averages gradients on CPU (gloo): a comm hook that picks the cheaper collective per bucket.

Gloo's allreduce has a high fixed cost: on the 2-core benchmark machine a 10-float allreduce between
two idle ranks takes ~1.8 ms, an all-gather of the same tensor ~0.6 ms. For small buckets (the whole
gradient of a small model) gathering every rank's bucket and summing locally is cheaper; for large
buckets the ring allreduce's lower traffic wins (at 2 ranks, 100k floats: all-gather 3.5 ms, allreduce
2.6 ms). Every rank sums the gathered buckets in rank order, so all ranks get bit-identical gradients.
Measurements: benchmarks/RESULTS.md.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

# Gathered bytes (bucket bytes x world size) up to which all-gather is used instead of allreduce.
GATHER_LIMIT_BYTES = 256 * 1024

_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def small_bucket_hook(group, bucket):  # no annotations: DDP compares them with its own classes
    """DDP comm hook (process group or None, dist.GradBucket) -> Future[Tensor]: the bucket's mean over
    all ranks, by all-gather for small buckets and by allreduce for large ones."""
    group = group if group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    tensor = bucket.buffer()
    if tensor.numel() * tensor.element_size() * world > GATHER_LIMIT_BYTES:
        tensor.div_(world)
        return dist.all_reduce(tensor, group=group, async_op=True).get_future().then(lambda f: f.value()[0])
    gathered = torch.empty(world * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    future = _gather(gathered, tensor, group=group, async_op=True).get_future()
    return future.then(lambda _: gathered.view(world, -1).sum(dim=0).div_(world))


def register(ddp: torch.nn.parallel.DistributedDataParallel, backend: str, compression: str) -> None:
    """This run's comm hook: fp16 compression when asked for, else the small-bucket hook on gloo."""
    if compression == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif backend == "gloo" and dist.get_world_size() > 1:
        ddp.register_comm_hook(None, small_bucket_hook)
