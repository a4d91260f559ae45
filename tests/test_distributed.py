import pytest

from estimator.distributed import RankContext, choose_device


def test_cpu_unless_every_rank_has_a_gpu():
    assert choose_device(None, [0, 0], 0, None) == "cpu"
    assert choose_device(None, [1, 0], 0, None) == "cpu"  # all ranks must agree on the device type
    assert choose_device(False, [1, 1], 0, None) == "cpu"


def test_spark_assigned_gpu_wins_over_local_rank():
    assert choose_device(None, [2, 2], 1, "1") == "cuda:1"
    assert choose_device(True, [4, 4], 0, "3") == "cuda:3"


def test_use_gpu_true_without_gpus_names_the_ranks():
    with pytest.raises(RuntimeError, match=r"use_gpu=True but ranks \[1\] see no CUDA device"):
        choose_device(True, [1, 0], 0, None)


def test_backend_follows_device():
    assert RankContext(0, 1, 0, "cpu").backend == "gloo"
    assert RankContext(0, 1, 0, "cuda:0").backend == "nccl"
