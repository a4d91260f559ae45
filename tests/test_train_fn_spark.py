"""train_fn=fn: your whole loop on every rank, over the estimator's data, checkpoints and history. Two optimizers
(the estimator's over the body, a second one over the head, kept in the checkpoint with ctx.keep) train digits
on 2 ranks; a rank killed in the second epoch is retried from the first epoch's checkpoint and ends with the
weights of an uninterrupted run (both optimizers' momentum restored)."""
import json

import pytest
import torch
import torch.nn.functional as F

from estimator import TorchEstimator
from helpers import MLP, metrics, seeded
from spark_helpers import digits_frame

pytestmark = pytest.mark.spark
FAULTS = "SPARK_TORCH_ESTIMATOR_FAULTS"


def two_optimizers(ctx):
    head = ctx.keep("head", torch.optim.SGD(ctx.module.net[2].parameters(), lr=0.05, momentum=0.9))
    for _ in ctx.epochs_to_run():
        ctx.model.train()
        loss_sum = correct = 0.0
        for batch in ctx.train_batches():
            ctx.optimizer.zero_grad()
            head.zero_grad()
            logits = ctx.model(*batch.features)
            loss = F.cross_entropy(logits, batch["label"])
            loss.backward()
            ctx.optimizer.step()
            head.step()
            loss_sum += float(loss.detach()) * batch.rows
            correct += float((logits.argmax(1) == batch["label"]).sum())
        trained = max(1, ctx.rows)
        ctx.module.eval()
        val_correct = val_rows = 0.0
        with torch.no_grad():
            for batch in ctx.val_batches():
                val_correct += float((ctx.module(*batch.features).argmax(1) == batch["label"]).sum())
                val_rows += batch.rows
        ctx.report({"loss": loss_sum / trained, "accuracy": correct / trained,
                    "val_accuracy": (val_correct / max(val_rows, 1), val_rows)})


class EpochEnds:
    """A callback that appends each epoch's end to a file (local mode: the executors share this disk)."""

    def __init__(self, path):
        self.path = path

    def on_epoch_end(self, epoch, logs):
        with open(self.path, "a") as handle:
            handle.write(json.dumps({"epoch": epoch, "loss": logs["loss"]}) + "\n")


def _est(store, **kw):
    model = seeded(MLP)
    params = dict(num_proc=2, store=store, model=model, feature_cols=["features"], label_cols=["label"],
                  optimizer=torch.optim.SGD(model.net[0].parameters(), lr=0.05, momentum=0.9), train_fn=two_optimizers,
                  batch_size=32, epochs=5, validation=0.2, random_seed=7, monitor="val_accuracy", max_retries=1)
    params.update(kw)
    return TorchEstimator(**params)


def test_a_train_fn_with_two_optimizers_trains_digits_and_resumes_a_killed_rank_exactly(spark, store, digits,
                                                                                      monkeypatch, tmp_path):
    df = digits_frame(spark, digits)
    ends = tmp_path / "epoch_ends.jsonl"
    straight = _est(store, run_id="straight", callbacks=[EpochEnds(str(ends))]).fit(df)
    history = straight.getHistory()
    assert [row["epoch"] for row in history] == [1, 2, 3, 4, 5]
    records = [json.loads(line) for line in ends.read_text().splitlines()]  # each report ends an epoch, rank 0
    assert [r["epoch"] for r in records] == [0, 1, 2, 3, 4]
    assert [r["loss"] for r in records] == pytest.approx([row["loss"] for row in history])
    assert history[-1]["val_accuracy"] >= 0.90 and set(history[-1]) == {"epoch", "loss", "accuracy", "val_accuracy"}
    monkeypatch.setenv(FAULTS, json.dumps([{"point": "step", "rank": 1, "action": "exit", "step": 40,
                                            "attempt": 0}]))  # in epoch 2 (23 batches an epoch)
    resumed = _est(store, run_id="killed").fit(df)
    monkeypatch.delenv(FAULTS)
    for a, b in zip(resumed.getModel().state_dict().values(), straight.getModel().state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), (a - b).abs().max()
    assert len(resumed.getHistory()) == len(history)
    for x, y in zip(resumed.getHistory(), history):
        assert metrics(x) == pytest.approx(metrics(y), rel=1e-6)


def without_report(ctx):
    for _ in ctx.epochs_to_run():
        for _ in ctx.train_batches():
            pass


def own_epoch_loop(ctx):  # a TorchDistributor script's loop: its own range, no report
    for _ in range(3):
        for batch in ctx.train_batches():
            ctx.optimizer.zero_grad()
            F.cross_entropy(ctx.model(*batch.features), batch["label"]).backward()
            ctx.optimizer.step()
    return ctx.module


def own_process_group(ctx):
    import torch.distributed as dist

    dist.init_process_group("gloo")


@pytest.mark.connect
def test_a_train_fn_that_breaks_its_contract_fails_once_naming_the_fix(spark, store, digits, caplog):
    """Not reporting an epoch, an epoch loop of its own, a process group of its own: each would recur, so none is
    retried (max_retries=1 here); each names what to do instead."""
    from estimator.failures import FailureKind, RankFailed

    df = digits_frame(spark, digits)
    for fn, message in [(without_report, r"train_fn finished epoch 1 without ctx.report\(metrics\)"),
                        (own_epoch_loop, r"train_fn returned without reporting an epoch \(5 to train\): loop over "
                                         r"`for epoch in ctx.epochs_to_run\(\):`"),
                        (own_process_group, "train_fn called torch.distributed.init_process_group.*remove the call")]:
        caplog.clear()
        with caplog.at_level("WARNING", logger="estimator"), pytest.raises(RankFailed, match=message) as failed:
            _est(store, train_fn=fn).fit(df)
        assert failed.value.kind is FailureKind.USAGE and "TrainFnMisuse" in failed.value.summary
        assert not [r for r in caplog.records if "retrying" in r.getMessage()], fn.__name__
