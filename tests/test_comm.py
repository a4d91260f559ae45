"""The gloo comm hook: DDP's gradients with it are the mean of every rank's gradients, the same bits on
every rank, through the all-gather path (small buckets) and the allreduce path (large ones)."""
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from estimator import comm

WORLD = 2


def _model(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 3))


def _grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _data(rank: int, width: int):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(32, width, generator=g), torch.randint(0, 3, (32,), generator=g)


def _rank(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    results = {}
    for width in (8, 300):  # 8: 107 parameters (all-gather); 300: 91k parameters, 364 KB (allreduce)
        ddp = nn.parallel.DistributedDataParallel(_model(width))
        comm.register(ddp, "gloo", "none")
        x, y = _data(rank, width)
        nn.functional.cross_entropy(ddp(x), y).backward()
        gathered = [torch.empty_like(_grads(ddp.module)) for _ in range(WORLD)]
        dist.all_gather(gathered, _grads(ddp.module))
        results[width] = gathered
        del ddp
    torch.save(results, f"{out}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def test_hook_gives_every_rank_the_mean_gradient(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port, str(tmp_path)), nprocs=WORLD)
    for width in (8, 300):
        small = width * width * 4 * WORLD <= comm.GATHER_LIMIT_BYTES
        assert small == (width == 8)  # both paths are exercised
        expected = []
        for rank in range(WORLD):  # each rank's own gradient, computed here without any communication
            model = _model(width)
            x, y = _data(rank, width)
            nn.functional.cross_entropy(model(x), y).backward()
            expected.append(_grads(model))
        mean = torch.stack(expected).mean(dim=0)
        seen = [torch.load(f"{tmp_path}/rank{r}.pt")[width] for r in range(WORLD)]
        for rank in range(WORLD):
            assert torch.equal(seen[rank][0], seen[rank][1]), f"ranks disagree on the gradient (width {width})"
            torch.testing.assert_close(seen[rank][0], mean, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(expected[0], expected[1])  # the ranks' own gradients really differed
