"""Rendezvous: a rank that does not arrive is named, within the rendezvous timeout, and the Spark
session stays usable. Ranks are delayed with the failure-injection hook (estimator.core.faults)."""
import json
import time

import pytest
import torch
from torch import nn

from estimator import TorchEstimator
from estimator.core.faults import ENV
from estimator.failures import RendezvousFailed
from helpers import MLP, seeded
from spark_helpers import digits_frame

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def df(spark, digits):
    return digits_frame(spark, digits).cache()


def _est(store, **kw):
    model = seeded(MLP)
    return TorchEstimator(num_proc=2, store=store, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          loss=nn.CrossEntropyLoss(), feature_cols=["features"], label_cols=["label"], epochs=1,
                          **kw)


@pytest.mark.parametrize("point, message", [
    ("before_checkin", r"rank 1 \(host [\w.-]+\) did not arrive within rendezvous_timeout=4 s; 1 of 2 ranks did"),
    ("before_barrier", r"rank 1 \(host [\w.-]+\) did not reach the rendezvous within rendezvous_timeout=4 s; 1 of 2 "
                       r"ranks did. Their tasks started"),
])
def test_a_late_rank_is_named_within_the_timeout(spark, store, df, monkeypatch, point, message):
    _est(store).fit(df)  # warm Python workers: the timing below is the timeout's, not a cold start's
    monkeypatch.setenv(ENV, json.dumps([{"point": point, "rank": 1, "action": "sleep", "seconds": 90}]))
    started = time.monotonic()
    with pytest.raises(RendezvousFailed, match=message) as info:
        _est(store, rendezvous_timeout=4).fit(df)
    assert time.monotonic() - started < 40  # not TCPStore's or Spark's own minutes-to-a-year timeouts
    assert info.value.rank == 0
    assert str(info.value).startswith("rank 0: ")
    monkeypatch.delenv(ENV)
    assert len(_est(store).fit(df).getHistory()) == 1  # the session and its Python workers still work


def test_no_launch_files_are_left_behind_and_stages_are_reported(spark, store, df, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="estimator"):
        model = _est(store, run_id="tidy").fit(df)
    assert model.getRunId() == "tidy"
    stages = [json.loads(r.getMessage()[len("fit stages: "):]) for r in caplog.records
              if r.getMessage().startswith("fit stages: ")]
    assert len(stages) == 1 and stages[0]["train_rows"] == df.count()
    assert all(stages[0][k] >= 0 for k in ("materialize_s", "rank_setup_s", "train_s", "teardown_s"))
    assert stages[0]["launch_s"] >= stages[0]["rank_setup_s"] + stages[0]["train_s"]
    left = [p.rsplit("/", 1)[-1] for p in store.ls(store.run("tidy").root)]
    assert "checkpoint.pt" in left and not [name for name in left if name.startswith("launch-")], left
