"""verbose=2's step progress: rank 0's steps.json, and the driver's tqdm bar fed from it (no Spark)."""
import io
import json
import time

import pytest
import torch

from estimator.fit.progress import ProgressWatcher, StepBar
from estimator.launch.local import LocalLauncher
from estimator.train.loop import StepReport
from helpers import MLP, make_spec, seeded


def test_rank_0_leaves_where_the_epoch_stands(store, digits, monkeypatch):
    monkeypatch.setattr(StepReport, "INTERVAL", 0.0)  # every batch, not once a second
    model = seeded(MLP)
    spec = make_spec(store, digits, model, torch.optim.SGD(model.parameters(), lr=0.1), train_rows=640, val_rows=64,
                     epochs=2, verbose=2)
    LocalLauncher().run(spec, 1)
    state = json.loads(store.read_bytes(spec.run.steps))
    assert state["epoch"] == 2 and state["step"] == state["steps"] == 10  # 640 rows in batches of 64
    assert state["loss"] > 0 and state["rows_per_second"] > 0
    rows = json.loads(store.read_bytes(spec.run.progress))  # the epoch line's seconds ride beside the history
    assert [row["epoch"] for row in rows] == [1.0, 2.0] and all(row["_epoch_seconds"] > 0 for row in rows)
    quiet = make_spec(store, digits, model, torch.optim.SGD(model.parameters(), lr=0.1), train_rows=640,
                      val_rows=64, epochs=1, run="quiet", verbose=1)
    LocalLauncher().run(quiet, 1)
    assert not store.exists(quiet.run.steps)  # only verbose=2 writes it


def test_the_driver_bar_shows_the_running_epoch_and_gives_way_to_the_epoch_line(store):
    pytest.importorskip("tqdm")
    run = store.run("bar")
    out, lines = io.StringIO(), []
    bar = StepBar(file=out)
    watcher = ProgressWatcher(store, run, lambda row: (bar.close(), lines.append(row["epoch"])), steps=bar.update)
    store.write_bytes_atomic(run.steps, json.dumps({"epoch": 1, "step": 4, "steps": 10, "loss": 0.5,
                                                    "rows_per_second": 1234.0}).encode())
    watcher.poll()
    text = out.getvalue()
    assert "epoch 1" in text and "4/10" in text and "loss=0.5000" in text and "rows/s=1234" in text
    store.write_bytes_atomic(run.progress, json.dumps([{"epoch": 1.0, "loss": 0.4}]).encode())
    watcher.poll()
    assert lines == [1.0] and bar.bar is None  # the bar closed before the epoch's line
    watcher.poll()  # the step state of a reported epoch does not reopen a bar
    assert bar.bar is None
    assert StepBar.open(1) is None and isinstance(StepBar.open(2), StepBar)


def test_the_bar_counts_batches_per_second_from_the_reads_it_saw():
    """A bar opened in the middle of an epoch (step 5000) measures its rate over the steps it saw arrive, not
    as 5000 steps done in no time (a rate of millions of batches per second)."""
    pytest.importorskip("tqdm")
    bar = StepBar(file=io.StringIO())
    state = {"epoch": 1, "step": 5000, "steps": 10000, "loss": 0.5, "rows_per_second": 1.0}
    bar.update(state)
    for step in (5010, 5020, 5030):
        time.sleep(0.2)
        bar.update({**state, "step": step})
    rate = bar.bar.format_dict["rate"]
    assert bar.bar.n == 5030 and rate is not None and 20 < rate < 100, rate  # 10 steps each 0.2 s: 50 batch/s
    bar.close()
