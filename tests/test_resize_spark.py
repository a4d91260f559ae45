"""A run checkpointed inside an epoch continues on another number of ranks: the rest of that epoch trains each
row not yet trained on exactly once, dealt to the new ranks, and the next epochs are the new world's. Every
row's visits are counted by the step itself (a train_step that records the rows it trains on)."""
import json
import os
import re
from collections import Counter

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from estimator import TorchEstimator
from estimator.core.faults import ENV
from estimator.failures import RankFailed
from helpers import MLP, seeded

pytestmark = pytest.mark.spark
ROWS = 1600  # 1600 / 2 ranks / 16 rows a batch: whole batches, no row drawn twice in an epoch


class IdMLP(MLP):
    def forward(self, x, row_id=None):  # transform's forward gets every feature column; the row id is not one
        return super().forward(x)


def recording_step(path):
    def step(model, batch, ctx):
        if ctx.training:
            with open(path, "a") as log:
                log.write(json.dumps([os.getpid(), ctx.world_size, ctx.epoch, ctx.global_step,
                                      batch["row_id"].long().tolist()]) + "\n")
        return F.cross_entropy(model(batch["features"]), batch["label"])
    return step


@pytest.mark.parametrize("before, after, cached", [(2, 1, (True, True)), (1, 2, (True, True)), (2, 1, (False, False)),
                                                   (1, 2, (True, False))])
def test_an_epoch_interrupted_on_one_rank_count_ends_on_another_with_each_row_once(spark, store, digits, tmp_path,
                                                                                  monkeypatch, caplog, before, after,
                                                                                  cached):
    """In memory on both sides, streamed on both (the streaming reader's order replayed over row ids), in memory
    then streamed."""
    X, y = digits
    rows = [(x.tolist(), int(t), float(i)) for i, (x, t) in enumerate(zip(X[:ROWS], y[:ROWS]))]
    df = spark.createDataFrame(rows, "features array<float>, label long, row_id double").repartition(2)
    path = str(tmp_path / "visits.jsonl")
    run_id = f"resize-{before}-{after}-{cached[0]}-{cached[1]}"

    def fit(num_proc, cache):
        model = seeded(IdMLP)
        return TorchEstimator(num_proc=num_proc, store=store, model=model, run_id=run_id,
                              optimizer=torch.optim.Adam(model.parameters(), lr=0.01), train_step=recording_step(path),
                              feature_cols=["features", "row_id"], label_cols=["label"], batch_size=16, epochs=2,
                              checkpoint_steps=10, random_seed=11, max_retries=0, inmemory_cache_all=cache,
                              shuffle_buffer_size=200).fit(df)

    # killed before optimizer step 23 of epoch 1, after the checkpoint of step 20
    monkeypatch.setenv(ENV, json.dumps([{"point": "step", "rank": 0, "action": "exit", "step": 23}]))
    with pytest.raises(RankFailed):
        fit(before, cached[0])
    monkeypatch.delenv(ENV)
    with caplog.at_level("INFO", logger="estimator"):
        model = fit(after, cached[1])  # the same run_id: continues from its checkpoint, on `after` ranks
    assert "the rest of the epoch trains each row not yet trained on once" in caplog.text
    assert [row["epoch"] for row in model.getHistory()] == [1, 2]
    # the last checkpoint written before the kill (step 20, or step 10 if step 20's background write was cut)
    resumed_at = int(re.search(r"continues from its checkpoint after epoch 0 and step (\d+) of epoch 1",
                               caplog.text).group(1))
    visits = {1: Counter(), 2: Counter()}
    for pid, world, epoch, global_step, ids in map(json.loads, open(path)):
        if pid == os.getpid():
            continue  # the driver's dry run of the step, on a few rows
        if world == before and global_step >= resumed_at:
            continue  # trained after the last checkpoint by the killed run: its weights were lost with it
        visits[epoch].update(ids)
    for epoch in (1, 2):
        assert sorted(visits[epoch]) == list(range(ROWS)), epoch  # every row of the epoch...
        assert set(visits[epoch].values()) == {1}, epoch  # ...exactly once
    assert np.isfinite(model.getHistory()[-1]["loss"])
