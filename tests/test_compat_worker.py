"""Horovod-compatible training options, checked on the per-rank loop (LocalLauncher, no Spark)."""
import io

import numpy as np
import pytest
import torch
from torch import nn

from estimator.failures import RankFailed
from estimator.launch.local import LocalLauncher
from helpers import MLP, make_spec, seeded


def _weights(store, run="r"):
    return torch.load(io.BytesIO(store.read_bytes(store.run(run).checkpoint)), weights_only=True)["model"]


def _run(store, digits, world=2, optimizer=torch.optim.SGD, **fields):
    model = seeded(MLP)
    spec = make_spec(store, digits, model, optimizer(model.parameters(), lr=0.05), train_rows=600, val_rows=100,
                     batch=50, epochs=2, shuffle=False, **fields)
    return LocalLauncher().run(spec, world)


def test_fp16_gradient_compression_changes_the_allreduce_and_still_trains(store, digits):
    _run(store, digits)
    plain = _weights(store)
    _run(store, digits)
    assert all(torch.equal(plain[k], v) for k, v in _weights(store).items()), "training is deterministic"
    results = _run(store, digits, compression="fp16")
    compressed = _weights(store)
    differs = [k for k in plain if not torch.equal(plain[k], compressed[k])]
    assert differs, "fp16 allreduce should round the averaged gradients"
    assert all(torch.allclose(plain[k], compressed[k], atol=1e-2) for k in plain)
    assert results[0].history[-1]["loss"] < results[0].history[0]["loss"]


def test_backward_passes_per_step_accumulates_gradients(store, digits):
    # 600 rows / 2 ranks / batch 50 = 6 batches per epoch: steps after batches 4 and 6 -> 2 per epoch
    results = _run(store, digits, optimizer=torch.optim.Adam, backward_passes_per_step=4)
    assert results[0].optimizer_steps == 4
    assert _run(store, digits, optimizer=torch.optim.Adam)[0].optimizer_steps == 12


def test_terminate_on_nan_stops_with_epoch_and_step(store, digits):
    calls = {"n": 0}

    def explodes(output, target):
        calls["n"] += 1
        loss = nn.functional.cross_entropy(output, target)
        return loss * float("nan") if calls["n"] == 3 else loss

    model = seeded(MLP)
    spec = make_spec(store, digits, model, torch.optim.SGD(model.parameters(), lr=0.1), train_rows=400, val_rows=50,
                     losses=[explodes], terminate_on_nan=True)
    with pytest.raises(RankFailed, match=r"The training loss is nan at epoch 1, step 3 on rank 0; stopping before "
                                         r"this step's gradients are applied"):
        LocalLauncher().run(spec, 1)
    calls["n"] = 0
    spec = make_spec(store, digits, model, torch.optim.SGD(model.parameters(), lr=0.1), train_rows=400, val_rows=50,
                     losses=[explodes], terminate_on_nan=False)
    assert LocalLauncher().run(spec, 1)[0].history  # without it, training carries on


def test_a_loss_made_nan_by_the_data_names_the_column_not_the_learning_rate(store, digits):
    """A row of infinite features gives a NaN loss at its step: the failure names the column and its rows (a wheel
    trial was told to lower the lr), looked at only once the loss is not finite."""
    X, y = digits[0].copy(), digits[1]
    X[130] = float("inf")  # in the third batch of 64, shuffle=False
    model = seeded(MLP)
    spec = make_spec(store, (X, y), model, torch.optim.SGD(model.parameters(), lr=0.1), train_rows=400, val_rows=50,
                     shuffle=False, terminate_on_nan=True)
    with pytest.raises(RankFailed, match=r"loss is nan at epoch 1, step 3 on rank 0.*holds NaN or infinite values in "
                                         r"'features' \(1 of its rows\): drop or fix those rows"):
        LocalLauncher().run(spec, 1)


def test_class_labels_past_the_first_rows_that_are_not_whole_numbers_fail_the_rank_as_bad_rows(store, digits):
    """The dry run sees the first rows only; each batch a rank reads is looked at on the host (the feed's thread,
    so that a GPU step never waits for it): a 0.5 among later rows fails the fit as BadRows, not retried, instead
    of training as class 0."""
    from estimator.failures import FailureKind

    X, y = digits[0], digits[1].astype(np.float64)
    y[300] = 0.5
    model = seeded(MLP)
    spec = make_spec(store, (X, y), model, torch.optim.SGD(model.parameters(), lr=0.1), train_rows=400, val_rows=50,
                     shuffle=False)
    with pytest.raises(RankFailed, match=r"BadRows: Label column 'label' holds 0\.5, which is not a class index") as info:
        LocalLauncher().run(spec, 1)
    assert info.value.kind is FailureKind.DATA


def own_loop_reporting(ctx):  # a TorchDistributor port's loop: range(epochs) with a report each
    for _ in range(3):
        for batch in ctx.train_batches():
            ctx.optimizer.zero_grad()
            nn.functional.cross_entropy(ctx.model(*batch.features), batch["label"]).backward()
            ctx.optimizer.step()
        ctx.report({"lr": 0.005})


def ends_its_process_group(ctx):
    import torch.distributed as dist

    for _ in ctx.epochs_to_run():
        ctx.report({"loss": 1.0}, rows=1)
    dist.destroy_process_group()


@pytest.mark.parametrize("fn, message", [
    (own_loop_reporting, r"ctx.report was called outside `for epoch in ctx.epochs_to_run\(\):`.*range\(2\)\) would "
                         r"report epochs the run does not train"),
    (ends_its_process_group, r"train_fn called torch.distributed.destroy_process_group.*remove the call")])
def test_a_train_fn_reporting_epochs_of_its_own_or_ending_the_group_is_refused_by_name(store, digits, fn, message):
    """A wheel trial's port looped range(5) with epochs=2: five history rows, and after a retry six epochs trained
    of four, silently; ending the process group failed in the estimator's teardown as a retried AssertionError."""
    from estimator.failures import FailureKind

    model = seeded(MLP)
    spec = make_spec(store, digits, model, torch.optim.SGD(model.parameters(), lr=0.1), train_rows=200, val_rows=50,
                     train_fn=fn)
    with pytest.raises(RankFailed, match=message) as failed:
        LocalLauncher().run(spec, 2)
    assert failed.value.kind is FailureKind.USAGE and "TrainFnMisuse" in failed.value.summary


def test_a_train_fns_reported_numbers_keep_their_float64_value(store, digits):
    def fn(ctx):
        for _ in ctx.epochs_to_run():
            ctx.report({"lr": 0.005, "loss": torch.tensor(0.25, dtype=torch.float64)}, rows=1)

    model = seeded(MLP)
    spec = make_spec(store, digits, model, torch.optim.SGD(model.parameters(), lr=0.1), train_rows=200, val_rows=50,
                     train_fn=fn, epochs=1)
    row = LocalLauncher().run(spec, 1)[0].history[0]
    assert row["lr"] == 0.005 and row["loss"] == 0.25  # not float32's 0.004999999888
