"""Gradient averaging through shared memory (estimator.train.host_allreduce), in real spawned processes."""
import glob
import multiprocessing
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from estimator.failures import RankFailed
from estimator.launch.local import LocalLauncher
from estimator.train import host_allreduce
from helpers import MLP, make_spec, seeded, metrics

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")


def _ours():
    return set(glob.glob("/dev/shm/spark-torch-estimator-*"))


def _group(rank, world, port):
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))


def _rank_values(rank, numel, dtype):
    generator = torch.Generator().manual_seed(rank)
    return torch.randn(numel, generator=generator, dtype=torch.float64).to(dtype)


def _mean_job(rank, world, port, slot_bytes, queue):
    torch.set_num_threads(1)
    host_allreduce.MAX_SLOT_BYTES = slot_bytes
    _group(rank, world, port)
    comm = host_allreduce.HostAllreduce.connect(rank, world, 4 * 10_000, timeout=30)
    out = {"connected": comm is not None}
    if comm is not None:
        out["slot_bytes"] = comm.slot_bytes
        out["results"] = []
        for numel, dtype in ((10_000, torch.float32), (7, torch.float32), (3_001, torch.float64),
                             (2_500, torch.bfloat16), (10_000, torch.float32)):
            tensor = _rank_values(rank, numel, dtype)
            out["results"].append(comm.mean_(tensor).tolist())  # no tensors through the queue
        comm.close()
    dist.destroy_process_group()
    queue.put((rank, out))


def _spawn(target, world, *args, timeout=120):
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=target, args=(rank, world, port, *args, queue)) for rank in range(world)]
    for p in procs:
        p.start()
    outputs = {}
    deadline = time.monotonic() + timeout
    while len(outputs) < world and time.monotonic() < deadline:
        try:
            rank, out = queue.get(timeout=1)
            outputs[rank] = out
        except Exception:  # noqa: BLE001 - queue.Empty: keep waiting unless every process has exited
            if all(not p.is_alive() for p in procs) and queue.empty():
                break
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
    return outputs


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("slot_bytes", [host_allreduce.MAX_SLOT_BYTES, 1024])
def test_three_ranks_get_the_exact_same_mean_of_every_dtype_and_leave_no_file(slot_bytes):
    """1024-byte slots force buckets through in chunks (10,000 floats = 40 chunks)."""
    before = _ours()
    outputs = _spawn(_mean_job, 3, slot_bytes)
    assert sorted(outputs) == [0, 1, 2] and all(o["connected"] for o in outputs.values())
    assert outputs[0]["slot_bytes"] == min(slot_bytes, 40_000)
    for i, (numel, dtype) in enumerate(((10_000, torch.float32), (7, torch.float32), (3_001, torch.float64),
                                        (2_500, torch.bfloat16), (10_000, torch.float32))):
        values = [_rank_values(r, numel, dtype) for r in range(3)]
        expected = (values[0].clone().add_(values[1]).add_(values[2])).div_(3)  # rank order, in the dtype
        for rank in range(3):
            got = torch.tensor(outputs[rank]["results"][i], dtype=dtype)
            assert torch.equal(got, expected), (rank, i)  # bit-identical on every rank
    # unlinked once every rank had mapped it (a test beside this one, in the other xdist worker, may come and go)
    assert not _ours() - before


def _failing_peer_job(rank, world, port, how, queue):
    host_allreduce.ECHO_DELAY = 1.0
    _group(rank, world, port)
    comm = host_allreduce.HostAllreduce.connect(rank, world, 400, timeout=3)
    tensor = torch.ones(100)
    comm.mean_(tensor)  # one step together
    if rank == 1:
        if how == "raise":
            comm.abort()
        elif how == "exit":
            os._exit(3)
        else:  # "late": stays away longer than the timeout
            time.sleep(8)
        queue.put((rank, {"error": None}))
        return
    started = time.monotonic()
    try:
        comm.mean_(tensor)
        error = None
    except host_allreduce.PeerFailed as exc:
        error = str(exc)
    queue.put((rank, {"error": error, "seconds": time.monotonic() - started}))


@pytest.mark.parametrize("how, expected, within", [("raise", "rank 1 failed", 4.0), ("exit", "rank 1 .* died", 4.5),
                                                   ("late", "collective_timeout=3 s", 5.0)])
def test_a_waiting_rank_stops_when_its_peer_fails_dies_or_is_late(how, expected, within):
    outputs = _spawn(_failing_peer_job, 2, how, timeout=60)
    assert 0 in outputs, outputs
    import re

    assert outputs[0]["error"] is not None and re.search(expected, outputs[0]["error"]), outputs[0]
    assert outputs[0]["seconds"] < within


def _fallback_job(rank, world, port, queue):
    if rank == 0:
        host_allreduce.SHM_DIR = "/nonexistent-shm-dir"
    _group(rank, world, port)
    comm = host_allreduce.HostAllreduce.connect(rank, world, 400, timeout=3)
    tensor = torch.full((4,), float(rank))
    dist.all_reduce(tensor)  # the group still works after the attempt
    dist.destroy_process_group()
    queue.put((rank, {"connected": comm is not None, "sum": tensor.tolist()}))


def test_every_rank_falls_back_to_gloo_when_rank_0_cannot_create_the_file():
    outputs = _spawn(_fallback_job, 2)
    assert outputs == {r: {"connected": False, "sum": [1.0] * 4} for r in (0, 1)}


def test_training_with_shared_memory_matches_gloo(store, digits):
    histories = {}
    for shared in (True, False):
        model = seeded(MLP)
        spec = make_spec(store, digits, model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                         train_rows=1000, val_rows=200, epochs=2, run=f"shm-{shared}",
                         shared_memory_allreduce=shared)
        results = LocalLauncher().run(spec, 2)
        assert {r.allreduce for r in results} == {"shared memory" if shared else "gloo"}
        histories[shared] = results[0].history
    assert histories[True][-1]["val_accuracy"] > 0.6  # it learns (10 classes)
    for ours, gloo in zip(histories[True], histories[False]):
        assert metrics(ours) == pytest.approx(metrics(gloo), rel=1e-5)


def test_a_rank_that_raises_mid_epoch_does_not_leave_its_peer_waiting(store, digits):
    class FailsOnRank1:
        def __call__(self, output, target):
            if dist.get_rank() == 1:
                raise ArithmeticError("boom on rank 1")
            return nn.functional.cross_entropy(output, target)

    model = seeded(MLP)
    spec = make_spec(store, digits, model, torch.optim.SGD(model.parameters(), lr=0.1), train_rows=400,
                     val_rows=50, losses=[FailsOnRank1()], collective_timeout=600.0)
    started = time.monotonic()
    with pytest.raises(RankFailed, match="boom on rank 1"):
        LocalLauncher().run(spec, 2)
    assert time.monotonic() - started < 60  # not collective_timeout
