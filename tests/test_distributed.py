import pytest

from estimator.train.distributed import RankContext, choose_device


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

    from estimator.failures import RendezvousFailed
    from estimator.launch.rendezvous import check_in

    hosts = ["hostA", "hostB", "hostC"]
    server = TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    client = TCPStore("127.0.0.1", server.port, 3, is_master=False, timeout=timedelta(seconds=10))
    seen = {}
    waiter = threading.Thread(target=lambda: seen.setdefault("r1", _raised(lambda: check_in(client, 1, hosts, 1.0))))
    waiter.start()
    started = time.monotonic()
    with pytest.raises(RendezvousFailed, match=r"^rank 0: rank 2 \(host hostC\) did not arrive "
                                               r"within rendezvous_timeout=1 s; 2 of 3 ranks did"):
        check_in(server, 0, hosts, 1.0)
    assert time.monotonic() - started < 5
    waiter.join(10)
    assert "rank 2 (host hostC) did not arrive" in seen["r1"]  # rank 1 hears rank 0's verdict


def test_a_rank_that_cannot_reach_rank_0s_store_names_the_address_and_the_timeout(store):
    """An address nobody listens at (left by an earlier attempt of a retried stage): find_rank0 reads it again
    until the timeout, then names it; connect (the address known beforehand) names it at once."""
    import socket
    import time
    from datetime import timedelta

    from torch.distributed import TCPStore

    from estimator.failures import RendezvousFailed
    from estimator.launch.rendezvous import connect, find_rank0, publish

    with socket.socket() as probe:  # a port free now, and nobody listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    where = store.path("launch-x", "rendezvous.json")  # in the test's store, not the working directory
    publish(store, where, "127.0.0.1", port)
    started = time.monotonic()
    with pytest.raises(RendezvousFailed, match=rf"^rank 1: rank 1 could not connect to rank 0's rendezvous store at "
                                               rf"127\.0\.0\.1:{port} within rendezvous_timeout=1\.5 s \("):
        find_rank0(store, where, 1, ["127.0.0.1", "127.0.0.1"], 1.5)
    assert 1.5 <= time.monotonic() - started < 15
    with pytest.raises(RendezvousFailed, match=rf"could not connect to rank 0's rendezvous store at 127\.0\.0\.1:"
                                               rf"{port} within rendezvous_timeout=1 s"):
        connect(2, "127.0.0.1", port, 3, 1.0)
    server = TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    publish(store, where, "127.0.0.1", server.port)  # rank 0 there now: found and connected
    found, client = find_rank0(store, where, 1, ["127.0.0.1", "127.0.0.1"], 5.0)
    client.set("k", "v")
    assert found == server.port and server.get("k") == b"v"


def test_check_in_passes_when_everyone_arrives():
    import threading
    from datetime import timedelta

    from torch.distributed import TCPStore

    from estimator.launch.rendezvous import check_in

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


def _spark_text(failure):
    """What Spark's job failure says when a barrier task raised `failure` (the shape pyspark gives it)."""
    return ("An error occurred while calling o91.collectAndServe.\n: org.apache.spark.SparkException: Job aborted due "
            "to stage failure: Could not recover from a failed barrier ResultStage. Most recent failure reason: Stage "
            "failed because barrier task ResultTask(3, 1) finished unsuccessfully.\norg.apache.spark.api.python."
            "PythonException: Traceback (most recent call last):\n  File \"/x/pyspark/worker.py\", line 1247, in main\n"
            "    process()\n  File \"/x/estimator/distributed.py\", line 160, in run_rank\n    raise RankFailed(ctx.rank, "
            f"failure, summary)\n{type(failure).__module__}.{type(failure).__name__}: {failure}\n\n"
            "\tat org.apache.spark.api.python.BasePythonRunner$ReaderIterator.handlePythonException(PythonRunner.scala:"
            "572)\n\tat org.apache.spark.scheduler.Task.run(Task.scala:147)\n" * 3 + "Driver stacktrace:\n\tat x.y\n")


def _raised_in_user_code():
    import traceback

    def forward():
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (16x64 and 32x10)")

    try:
        forward()
    except RuntimeError as exc:
        return traceback.format_exc(), f"{type(exc).__name__}: {exc}"


def test_a_rank_failure_reads_as_the_rank_and_its_own_exception_then_its_traceback_once():
    from estimator.failures import RankFailed

    formatted, summary = _raised_in_user_code()
    failure = RankFailed(1, formatted, summary)
    lines = str(failure).splitlines()
    assert lines[0] == "rank 1: RuntimeError: mat1 and mat2 shapes cannot be multiplied (16x64 and 32x10)"
    assert lines[1] == "Traceback (most recent call last):" and "in forward" in str(failure)
    assert RankFailed(1, formatted).summary == summary  # read back from the traceback when not given
    assert str(RankFailed(2, "its Python worker exited unexpectedly")) == "rank 2: its Python worker exited unexpectedly"


@pytest.mark.parametrize("kind", ["RankFailed", "RendezvousFailed"])
def test_the_driver_rebuilds_the_rank_failure_from_sparks_text_without_java_frames(kind):
    import estimator.failures as failures
    from estimator.launch.spark import rank_failure

    formatted, summary = _raised_in_user_code()
    rebuilt = rank_failure(_spark_text(getattr(failures, kind)(1, formatted, summary)))
    assert type(rebuilt).__name__ == kind and rebuilt.rank == 1
    assert rebuilt.summary == summary and rebuilt.formatted == formatted.rstrip()
    assert "\tat " not in str(rebuilt) and "org.apache" not in str(rebuilt)
    assert str(rebuilt).count("Traceback (most recent call last)") == 1


def test_a_one_line_rank_failure_keeps_sparks_sqlstate_out():
    from estimator.launch.spark import rank_failure

    text = ("Job aborted.\norg.apache.spark.api.python.PythonException: Traceback (most recent call last):\n  File "
            "\"x.py\", line 1, in f\nestimator.distributed.RankFailed: rank 0: use_gpu=True but ranks [0, 1] see no "
            "CUDA device.\n SQLSTATE: 38000\n\tat org.apache.spark.x(X.scala:1)\n")
    failure = rank_failure(text)
    assert str(failure) == "rank 0: use_gpu=True but ranks [0, 1] see no CUDA device."


def test_a_rank_whose_worker_died_is_named_from_sparks_text():
    from estimator.launch.spark import rank_failure

    text = ("Job aborted due to stage failure: Could not recover from a failed barrier ResultStage. Most recent "
            "failure reason: Stage failed because barrier task ResultTask(5, 0) finished unsuccessfully.\n"
            "org.apache.spark.SparkException: Python worker exited unexpectedly (crashed)\n\tat x.y")
    failure = rank_failure(text)
    assert failure.rank == 0 and str(failure).startswith("rank 0: its Python worker exited unexpectedly (crashed)")
    assert rank_failure("some other Spark error") is None
    assert failure.kind.value == "worker_death" and failure.kind.retryable
    of_a_task = rank_failure(text.replace("ResultTask(5, 0)", "ResultTask(5, 1)"), per_task=2)  # 2 GPUs per task
    assert of_a_task.rank == 2 and str(of_a_task).startswith(
        "rank 2: the Spark task of ranks 2-3: its Python worker exited unexpectedly (crashed)")


def _raise(exc):
    try:
        raise exc
    except BaseException as caught:  # noqa: BLE001 - the test looks at what was caught
        return caught


def test_failure_kinds_come_from_the_exception_types_not_their_text():
    import torch.distributed as dist

    from estimator.data.parquet import ReadFailed
    from estimator.failures import FailureKind, RankFailed, RendezvousFailed, failure_kind
    from estimator.train.finite import NonFiniteLoss
    from estimator.train.host_allreduce import PeerFailed

    assert failure_kind(NonFiniteLoss("Loss is nan")) is FailureKind.NAN
    assert not FailureKind.NAN.retryable
    assert failure_kind(PeerFailed("rank 1 died")) is FailureKind.PEER
    assert failure_kind(dist.DistBackendError("Connection closed by peer")) is FailureKind.PEER
    assert failure_kind(ReadFailed("could not read x")) is FailureKind.READ
    assert failure_kind(RuntimeError("PeerFailed FloatingPointError")) is FailureKind.USER  # text means nothing
    assert failure_kind(RendezvousFailed(1, "late")) is FailureKind.RENDEZVOUS
    assert failure_kind(RankFailed(1, "x", kind=FailureKind.NAN)) is FailureKind.NAN
    try:  # a read error re-raised by the user's code (or a feeding thread) keeps its kind
        raise ValueError("while decoding") from ReadFailed("could not read x")
    except ValueError as exc:
        assert failure_kind(exc) is FailureKind.READ


def test_the_driver_takes_the_failing_ranks_record_not_a_peers_echo(store):
    import json
    import time

    from estimator.failures import FailureKind, RankFailed, RendezvousFailed, as_rank_failure
    from estimator.launch.spark import launch_failure
    from estimator.train.host_allreduce import PeerFailed

    run, launch = store.run("r"), "abc"
    echo = as_rank_failure(0, _raise(PeerFailed("rank 1 failed during training")))
    cause = RankFailed(1, *_raised_in_user_code())
    store.write_bytes_atomic(run.failure(launch, 0), json.dumps(echo.record()).encode())  # written first
    time.sleep(0.01)
    store.write_bytes_atomic(run.failure(launch, 1), json.dumps(cause.record()).encode())
    found = launch_failure(store, run, launch, 2, "Spark's text, not read when records exist")
    assert found.rank == 1 and found.kind is FailureKind.USER and str(found) == str(cause)
    assert echo.kind is FailureKind.PEER and "PeerFailed: rank 1 failed" in str(echo)
    store.rm(run.failure(launch, 1))  # only the echo left: it is what there is
    assert launch_failure(store, run, launch, 2, "").rank == 0
    died = ("Job aborted due to stage failure: Could not recover from a failed barrier ResultStage. Most recent "
            "failure reason: Stage failed because barrier task ResultTask(5, 1) finished unsuccessfully.\n"
            "org.apache.spark.SparkException: Python worker exited unexpectedly (crashed)\n\tat x.y")
    killed = launch_failure(store, run, launch, 2, died)  # rank 1's worker died without a record; rank 0 echoed
    assert killed.rank == 1 and killed.kind is FailureKind.WORKER_DEATH and "exited unexpectedly" in str(killed)
    store.rm(run.failure(launch, 0))
    store.write_bytes_atomic(run.failure(launch, 1), json.dumps(RendezvousFailed(1, "late").record()).encode())
    late = launch_failure(store, run, launch, 2, "")
    assert isinstance(late, RendezvousFailed) and late.kind is FailureKind.RENDEZVOUS
    assert launch_failure(store, store.run("other"), launch, 2, "some other Spark error") is None


def test_a_module_the_executors_lack_before_our_code_ran_is_an_environment_failure_naming_their_python():
    """pyspark's worker failed to unpickle the task (the executors' Python is not the driver's): not retried, and
    the message names the module and the Python the driver configured for them."""
    from estimator.failures import FailureKind
    from estimator.launch.spark import rank_failure

    text = ("Job aborted due to stage failure: ... org.apache.spark.api.python.PythonException: [PYTHON_EXCEPTION] "
            "An exception was thrown from the Python worker: Traceback (most recent call last):\n  File "
            "\"pyspark/serializers.py\", line 483, in loads\nModuleNotFoundError: No module named 'torch'\n"
            " SQLSTATE: 38000\n\tat org.apache.spark...")
    failure = rank_failure(text, 1, "python3")
    assert failure.kind is FailureKind.ENVIRONMENT and not failure.kind.retryable
    assert failure.summary.startswith("ModuleNotFoundError: No module named 'torch' in the executors' Python "
                                      "(python3), before the training code ran")
    assert "PYSPARK_PYTHON" in failure.summary and "\tat " not in str(failure)
