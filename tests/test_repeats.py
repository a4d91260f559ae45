"""Rows not divisible by num_proc: a rank one row short draws a row again so that the ranks take the same steps,
and the built-in loop trains none of those repeats (estimator.data.repeats). Two ranks of batch b then take the
steps of one plain loop over the same rows, each once an epoch, in batches of every rank's rows together, with
the history exact over the rows - also when a rank's last batch is nothing but its repeat (forwarded, counted
as none), with gradient accumulation, and from the streaming reader. No Spark: LocalLauncher's processes."""
import copy
import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

from estimator.core.spec import ReaderSpec
from estimator.data.arrays import Tensors
from estimator.data.parquet import shard_range
from estimator.data.repeats import REPEAT, without_repeats
from estimator.launch.local import LocalLauncher
from estimator.train.checkpoint import restore
from estimator.train.sums import LOSS, ROWS, WEIGHT, Sums
from estimator.train.weighting import PerBatch, PerWeight
from helpers import MLP, make_spec, seeded

BATCH = 8


def plain_loop(model, X, y, rows, epochs, every, lr):
    """One process: step t's batch is batch t of each rank's shard (without repeats), together."""
    plain = copy.deepcopy(model)
    optimizer = torch.optim.SGD(plain.parameters(), lr=lr, momentum=0.9)
    features, labels = torch.from_numpy(X[:rows]), torch.from_numpy(y[:rows])
    shards = [shard_range(rows, r, 2) for r in range(2)]
    steps = -(-(shards[0][1] - shards[0][0]) // BATCH)
    losses = []
    for _ in range(epochs):
        total = 0.0
        for first in range(0, steps, every):  # a window: one batch of its batches' rows (the last may be short)
            idx = np.concatenate([np.arange(start + step * BATCH, min(start + (step + 1) * BATCH, stop))
                                  for step in range(first, min(first + every, steps)) for start, stop in shards])
            optimizer.zero_grad()
            loss = nn.CrossEntropyLoss()(plain(features[idx]), labels[idx])
            loss.backward()
            optimizer.step()
            total += loss.item() * len(idx)
        losses.append(total / rows)
    return plain, losses


@pytest.mark.parametrize("rows,every,cached", [(49, 1, True), (59, 2, True), (59, 1, False), (42, 2, True)],
                         ids=["last-batch-void", "accumulated", "streaming", "even-short-last-window"])
def test_two_ranks_train_what_one_plain_loop_trains_over_each_row_once(store, digits, rows, every, cached):
    """49 rows: rank 0 holds 25 (batches 8, 8, 8, 1), rank 1 24, whose fourth batch is only its repeat. 59 rows:
    30 and 29, whose last batches are 6 and 5 rows (its repeat left out). With backward_passes_per_step a window
    is one batch of its rows: 42 rows, 21 a rank, batches 8, 8, 5: the epoch's last window is one short batch,
    whose mean counts whole (not halved, nor as much as a full batch's)."""
    X, y = digits
    model = seeded(MLP)
    spec = make_spec(store, digits, model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                     train_rows=rows, val_rows=40, batch=BATCH, epochs=2, run=f"uneven-{rows}-{every}-{cached}",
                     shuffle=False, backward_passes_per_step=every, reader=ReaderSpec(inmemory_cache_all=cached))
    results = LocalLauncher().run(spec, 2)
    assert ("in memory" in results[0].reader) == cached
    plain, losses = plain_loop(model, X, y, rows, 2, every, 0.1)

    trained = MLP()
    restore(store, store.run(f"uneven-{rows}-{every}-{cached}"),
            store.run(f"uneven-{rows}-{every}-{cached}").checkpoint, trained, None)
    for name, value in plain.state_dict().items():
        assert torch.allclose(trained.state_dict()[name], value, atol=1e-5), (
            name, (trained.state_dict()[name] - value).abs().max())
    assert [row["loss"] for row in results[0].history] == pytest.approx(losses, rel=1e-5)  # each row once


def test_a_batch_of_repeats_only_is_one_void_row_and_others_lose_their_repeats():
    batch = {"x": np.arange(4), REPEAT: np.array([False, False, True, True])}
    kept, void = without_repeats(batch, drop=True)
    assert kept["x"].tolist() == [0, 1] and not void and REPEAT not in kept
    kept, void = without_repeats({"x": np.arange(2), REPEAT: np.array([True, True])}, drop=True)
    assert kept["x"].tolist() == [0, 1] and void  # whole: a BatchNorm layer needs more than one row
    kept, void = without_repeats(batch, drop=False)  # a train_fn's feed: the repeats stay
    assert kept["x"].tolist() == [0, 1, 2, 3] and not void


def test_a_void_batch_weighs_nothing_under_either_weighting():
    class Summed:
        def weight_of(self, tensors):
            return tensors.weights.sum()

    batch = Tensors([torch.ones(3, 2)], [torch.zeros(3)], torch.full((3,), 2.0))
    loss = torch.tensor(5.0)
    sums = Sums((LOSS, WEIGHT, ROWS))
    for weighting in (PerBatch(1, 1, sums), PerBatch(2, 1, sums), PerWeight(1, 1, sums), PerWeight(2, 1, sums)):
        weighting.begin(Summed(), batch, 3)
        assert float(weighting.scale(loss)) > 0
        weighting.begin(Summed(), batch, 0)
        assert float(weighting.scale(loss)) == 0.0, type(weighting).__name__


@pytest.mark.parametrize("cache", [True, False], ids=["in-memory", "streaming"])
@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_takes_the_same_steps_and_the_rows_left_without_repeats_are_each_row_once(store, cache, world):
    """1003 shuffled rows (row groups of 97, a shuffle buffer smaller than the shard): each rank's epoch takes the
    same number of batches; its batches without the rows marked as repeats hold its shard, each row once (the
    streaming reader's repeats, from its second pass, are marked before they enter the shuffle buffer)."""
    from test_streaming import _spec

    from estimator.data.shards import open_shards

    spec = _spec(store, rows=1003, batch=32, cache=cache, buffer=100)
    lengths, seen = set(), []
    for rank in range(world):
        shard = open_shards(spec, rank, world)[0]
        batches = list(shard.epoch(1))
        lengths.add(len(batches))
        short = shard.rows < shard.plan().items
        assert all((REPEAT in b) == short for b in batches)  # every batch of a rank with a repeat, no other
        rows = []
        for b in batches:
            kept, void = without_repeats(b, drop=True)
            rows += [] if void else kept["label"].tolist()
        assert len(rows) == shard.rows and sum(len(b["label"]) for b in batches) == shard.plan().items
        seen += rows
    assert len(lengths) == 1 and sorted(seen) == list(range(1003))
    full = dataclasses.replace(spec, drop_last=True)  # batches kept full: the repeat trained, none marked
    assert not any(REPEAT in b for rank in range(world) for b in open_shards(full, rank, world)[0].epoch(1))


def test_a_run_cut_inside_an_uneven_epoch_goes_on_at_another_rank_count_to_the_uninterrupted_weights(store, digits):
    """97 shuffled rows on 3 ranks of batch 8 (33, 32, 32: the epoch's last global batch is rank 0's one row, the
    others' batches their repeats), cut after the checkpoint of step 2 and continued on 2 ranks of batch 12 (the
    global batch of 24 kept): the rest of the epoch is the old ranks' global batches without their repeats, dealt
    in parts that differ by a row at most (a shorter part's repeat left out too), and the run ends with the
    uninterrupted run's weights and loss."""
    from estimator.core.faults import Fault
    from estimator.failures import RankFailed
    from estimator.train.checkpoint import load_checkpoint

    model = seeded(MLP)

    def make(run):
        return make_spec(store, digits, model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                         train_rows=97, val_rows=40, batch=8, epochs=1, run=run, checkpoint_steps=2,
                         shared_memory_allreduce=False, collective_timeout=8.0)

    whole = LocalLauncher().run(make("whole"), 3)
    cut = make("cut")
    with pytest.raises(RankFailed):
        LocalLauncher(faults=(Fault("step", 0, "raise", step=4),)).run(cut, 3)
    assert load_checkpoint(store, cut.run.checkpoint)["position"]["step"] == 2
    again = dataclasses.replace(cut, resume_from=cut.run.checkpoint, batch_size=12, attempt=1, launch_id="again")
    resumed = LocalLauncher().run(again, 2)

    def weights(run):
        module = MLP()
        restore(store, store.run(run), store.run(run).checkpoint, module, None)
        return module.state_dict()

    expected, got = weights("whole"), weights("cut")
    for name, value in expected.items():
        assert torch.allclose(got[name], value, atol=1e-5), (name, (got[name] - value).abs().max())
    assert resumed[0].history[0]["loss"] == pytest.approx(whole[0].history[0]["loss"], rel=1e-5)
