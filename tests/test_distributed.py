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


def test_check_in_names_the_rank_that_did_not_arrive():
    import threading
    import time
    from datetime import timedelta

    from torch.distributed import TCPStore

    from estimator.distributed import RendezvousFailed, check_in

    hosts = ["hostA", "hostB", "hostC"]
    server = TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    client = TCPStore("127.0.0.1", server.port, 3, is_master=False, timeout=timedelta(seconds=10))
    seen = {}
    waiter = threading.Thread(target=lambda: seen.setdefault("r1", _raised(lambda: check_in(client, 1, hosts, 1.0))))
    waiter.start()
    started = time.monotonic()
    with pytest.raises(RendezvousFailed, match=r"^Rendezvous failed on rank 0:\nrank 2 \(host hostC\) did not arrive "
                                               r"within rendezvous_timeout=1 s; 2 of 3 ranks did"):
        check_in(server, 0, hosts, 1.0)
    assert time.monotonic() - started < 5
    waiter.join(10)
    assert "rank 2 (host hostC) did not arrive" in seen["r1"]  # rank 1 hears rank 0's verdict


def test_check_in_passes_when_everyone_arrives():
    import threading
    from datetime import timedelta

    from torch.distributed import TCPStore

    from estimator.distributed import check_in

    server = TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    client = TCPStore("127.0.0.1", server.port, 2, is_master=False, timeout=timedelta(seconds=10))
    other = threading.Thread(target=check_in, args=(client, 1, ["a", "b"], 5.0))
    other.start()
    check_in(server, 0, ["a", "b"], 5.0)
    other.join(10)
    assert server.get("checkin/verdict") == b"ok"


def _raised(action):
    try:
        action()
    except Exception as exc:  # noqa: BLE001
        return str(exc)
    return ""
