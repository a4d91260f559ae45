"""Several ranks in one Spark task, without Spark: the ranks per task from the Spark conf, every rank's device
and the shared-GPU decision from gathered facts, and the spawned rank processes (results, failures, deaths)."""
import os
import time

import pytest
import torch

from estimator.failures import FailureKind, RankFailed
from estimator.launch.session import default_num_proc, ranks_per_task
from estimator.launch.task_ranks import run_ranks
from estimator.train.distributed import RankContext, plan_devices, shared_gpus


class FakeSpark:
    def __init__(self, **conf):
        self.conf = self
        self.values = {"spark.master": "local[2]", **{k.replace("_", "."): v for k, v in conf.items()}}

    def get(self, key, default=None):
        return self.values.get(key, default)


def gpus(amount):
    return FakeSpark(spark_task_resource_gpu_amount=amount)


def test_ranks_per_task_follow_the_gpus_each_task_is_given():
    assert ranks_per_task(FakeSpark(), 3) == 1
    assert ranks_per_task(gpus("0.5"), 3) == 1  # tasks share GPUs: one rank each
    assert ranks_per_task(gpus("1"), 3) == 1
    assert ranks_per_task(gpus("4"), 8) == 4
    with pytest.raises(ValueError, match=r"spark.task.resource.gpu.amount=4 each Spark task runs 4 of them, so "
                                         r"num_proc must be a multiple of 4. Got 6; use 4 or 8"):
        ranks_per_task(gpus("4"), 6)
    with pytest.raises(ValueError, match=r"spark.task.resource.gpu.amount=1.5: .* neither"):
        ranks_per_task(gpus("1.5"), 6)
    assert default_num_proc(gpus("2")) == 2 * 2  # local[2]: two task slots of two GPUs each


def test_every_rank_computes_every_device_and_ranks_sharing_a_gpu_use_gloo():
    hosts = ["a", "a", "b", "b"]
    devices = plan_devices(None, hosts, [4, 4, 4, 4], ["0", "1", "0", "1"])
    assert devices == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"] and shared_gpus(hosts, devices) == {}
    assert RankContext(0, 4, 0, devices[0]).backend == "nccl"
    devices = plan_devices(None, ["a", "a"], [1, 1], ["0", "0"])  # gpu.amount=0.5: two tasks on GPU 0
    assert shared_gpus(["a", "a"], devices) == {("a", "cuda:0"): [0, 1]}
    assert RankContext(0, 2, 0, devices[0], shared_gpus=True).backend == "gloo"
    assert plan_devices(None, ["a", "a"], [0, 0], ["0", "0"]) == ["cpu", "cpu"]  # no CUDA: the CPU, gloo
    assert shared_gpus(["a", "a"], ["cpu", "cpu"]) == {}
    assert plan_devices(None, ["a", "a", "b"], [2, 2, 2], [None, None, None]) == ["cuda:0", "cuda:1", "cuda:0"]
    with pytest.raises(RuntimeError, match=r"use_gpu=True but ranks \[1\] see no CUDA device"):
        plan_devices(True, ["a", "b"], [1, 0], ["0", None])


def square(x):
    return x * x


def fail_or_wait(rank, fail, seconds):
    if rank == fail:
        raise ValueError(f"bad value on rank {rank}")
    time.sleep(seconds)
    raise RuntimeError("the peer went away")  # what a peer's collective raises after the failure (a PEER echo)


def die(code):
    os._exit(code)


def test_ranks_run_in_their_own_processes_and_return_in_rank_order():
    assert run_ranks(square, [(3,), (4,)], [6, 7], on_failure=lambda f: None) == [9, 16]


def test_the_failing_rank_is_reported_not_a_peer_echoing_it():
    seen = []
    with pytest.raises(RankFailed) as caught:
        # the echo 3 s after its own start: a rank process can start 0.5 s after the other on a busy machine (CI)
        run_ranks(fail_or_wait, [(4, 5, 3.0), (5, 5, 3.0)], [4, 5], on_failure=seen.append)
    assert caught.value.rank == 5 and caught.value.summary == "ValueError: bad value on rank 5"
    assert seen[0].rank == 5  # reported at once, before the peer ended


def test_a_rank_process_that_dies_is_a_worker_death_of_its_rank():
    with pytest.raises(RankFailed) as caught:
        run_ranks(die, [(17,)], [3], on_failure=lambda f: None)
    assert caught.value.rank == 3 and caught.value.kind is FailureKind.WORKER_DEATH
    assert "exited (code 17) without a result or an error" in str(caught.value)


def test_ranks_still_running_after_a_failure_are_terminated_after_the_grace():
    started = time.monotonic()
    with pytest.raises(RankFailed) as caught:
        run_ranks(fail_then_hang, [(0,), (1,)], [0, 1], on_failure=lambda f: None, grace=1.0)
    assert caught.value.rank == 0 and caught.value.summary == "ValueError: rank 0 fails"
    assert time.monotonic() - started < 30  # the hanging rank did not hold the task for its 600 s


def fail_then_hang(rank):
    if rank == 0:
        raise ValueError("rank 0 fails")
    time.sleep(600)


def test_use_gpu_true_without_cuda_in_local_processes_names_no_spark_setting(store, digits):
    """LocalLauncher's ranks were not placed by Spark: the error says what is missing, not Spark's addresses."""
    from estimator.launch.local import LocalLauncher
    from helpers import MLP, make_spec, seeded

    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    model = seeded(MLP)
    spec = make_spec(store, digits, model, torch.optim.SGD(model.parameters(), lr=0.1), train_rows=200, val_rows=50,
                     use_gpu=True)
    with pytest.raises(RankFailed) as caught:
        LocalLauncher().run(spec, 1)
    assert str(caught.value) == ("rank 0: use_gpu=True but ranks [0] see no CUDA device. Set use_gpu=False (or leave "
                                 "it None to use GPUs only when every rank has one).")
