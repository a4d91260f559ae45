"""Rank 0's checkpoint writes in the background: training goes on while a write is in flight, one write at a
time, the state written is the state when it was submitted, and a failed write fails the run (a WRITE failure)
instead of leaving a silent gap. No Spark: the writer alone (tests/test_recovery_spark.py: in a fit)."""
import threading

import pytest
import torch
from torch import nn

from estimator.failures import FailureKind, failure_kind
from estimator.train.checkpoint import CheckpointWriteFailed, CheckpointWriter, Position, checkpoint_state


def test_submit_returns_while_the_write_is_still_going():
    release, done = threading.Event(), threading.Event()

    def slow_write():
        release.wait(30)
        done.set()

    writer = CheckpointWriter(background=True)
    writer.submit("epoch 1", slow_write)
    assert not done.is_set()  # a foreground writer would have waited for the whole write (and then 30 s)
    release.set()
    writer.wait()
    assert done.is_set() and writer.written == 1


def test_one_write_at_a_time_in_the_order_submitted():
    release, order = threading.Event(), []
    writer = CheckpointWriter(background=True)
    writer.submit("epoch 1", lambda: (release.wait(30), order.append(1)))
    second = threading.Thread(target=writer.submit, args=("epoch 2", lambda: order.append(2)))
    second.start()
    second.join(0.5)
    assert second.is_alive() and order == []  # the second submit waits for the first write
    release.set()
    second.join(30)
    writer.wait()
    assert order == [1, 2] and writer.written == 2 and writer.stalled > 0


def test_a_failed_write_fails_the_next_submit_or_wait_as_a_write_failure():
    def broken():
        raise OSError("the store went away")

    writer = CheckpointWriter(background=True)
    writer.submit("epoch 2", broken)
    with pytest.raises(CheckpointWriteFailed, match=r"could not write the checkpoint of epoch 2 to the store: "
                                                    r"OSError: the store went away") as info:
        writer.submit("epoch 3", lambda: None)
    assert failure_kind(info.value) is FailureKind.WRITE and FailureKind.WRITE.retryable
    foreground = CheckpointWriter(background=False)
    with pytest.raises(CheckpointWriteFailed):
        foreground.submit("epoch 1", broken)


def test_the_state_written_is_a_copy_taken_at_submit():
    model = nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(4, 3)).sum().backward()
    optimizer.step()
    state = checkpoint_state(model, optimizer, [{"loss": 1.0}], Position(1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moments = optimizer.state_dict()["state"][0]["exp_avg"].clone()
    with torch.no_grad():
        model.weight.add_(1.0)  # training goes on, in place
    optimizer.step()
    for key, value in before.items():
        assert torch.equal(state["model"][key], value)
    assert torch.equal(state["optimizer"]["state"][0]["exp_avg"], moments)


def test_an_optimizer_built_with_numpy_numbers_checkpoints_and_loads(store):
    """Adam(lr=np.float64(...)) and a scheduler putting numpy numbers in the groups: the checkpoint holds Python
    numbers and loads with weights_only=True; a checkpoint written with numpy numbers in it (by 0.2.0) loads too."""
    import io

    import numpy as np

    from estimator.core.pickling import user_objects
    from estimator.train.checkpoint import Position, checkpoint_state, load_checkpoint, write_checkpoint
    from estimator.train.worker import build_optimizer

    model = torch.nn.Linear(3, 2)
    adam = torch.optim.Adam(model.parameters(), lr=np.float64(0.01), betas=(np.float64(0.9), np.float64(0.99)))
    objs = user_objects(model, adam, [torch.nn.MSELoss()], [1.0], [])
    rebuilt = build_optimizer(objs, objs.model)
    assert type(rebuilt.param_groups[0]["lr"]) is float and type(rebuilt.param_groups[0]["betas"][1]) is float
    rebuilt.param_groups[0]["lr"] = np.float64(0.005)  # what LambdaLR with a numpy lambda leaves
    for copy in (True, False):
        state = checkpoint_state(objs.model, rebuilt, [{"loss": np.float32(0.5)}], Position(1), copy=copy)
        write_checkpoint(store, state, [store.path("ckpt.pt")])
        loaded = load_checkpoint(store, store.path("ckpt.pt"))
        assert loaded["optimizer"]["param_groups"][0]["lr"] == 0.005 and loaded["history"] == [{"loss": 0.5}]
    old = {"optimizer": {"param_groups": [{"lr": np.float64(0.01)}]}, "epoch": 1}
    buffer = io.BytesIO()
    torch.save(old, buffer)
    store.write_bytes_atomic(store.path("old.pt"), buffer.getvalue())
    assert load_checkpoint(store, store.path("old.pt"))["optimizer"]["param_groups"][0]["lr"] == 0.01


def test_a_checkpoint_is_streamed_into_the_store_and_a_failed_write_leaves_the_last_one(store, monkeypatch):
    """write_checkpoint never holds the serialized checkpoint whole: the store's file gets it in pieces no larger
    than its largest tensor (a 1B model's full fine-tune is 15 GB); each target is a copy of it. A write that fails
    half-way leaves the checkpoint that was there, and no temporary file."""
    from estimator.train.checkpoint import load_checkpoint, write_checkpoint

    tensors = {f"w{i}": torch.full((256, 256), float(i)) for i in range(8)}  # 256 KB each, 2 MB in all
    target, best = store.path("run", "ckpt.pt"), store.path("run", "best.pt")
    opened, real_open = [], store.fs.open

    def recording_open(path, mode="rb", **kwargs):
        f = real_open(path, mode, **kwargs)
        if "w" in mode:
            sizes, write = [], f.write
            opened.append(sizes)
            f.write = lambda data: sizes.append(len(data)) or write(data)
        return f

    monkeypatch.setattr(store.fs, "open", recording_open)
    write_checkpoint(store, {"model": tensors, "epoch": 1}, [target, best])
    assert len(opened) == 2 and all(max(sizes) <= 256 * 256 * 4 < sum(sizes) for sizes in opened)
    for path in (target, best):
        assert torch.equal(load_checkpoint(store, path)["model"]["w7"], tensors["w7"])

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle this")

    with pytest.raises(RuntimeError, match="cannot pickle"):
        write_checkpoint(store, {"model": tensors, "epoch": 2, "extra": Unpicklable()}, [target])
    assert load_checkpoint(store, target)["epoch"] == 1
    assert sorted(store.fs.ls(store.path("run"), detail=False)) == sorted([target, best])
