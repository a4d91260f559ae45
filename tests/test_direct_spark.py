"""data_mode='direct' with real Spark: the ranks are the barrier tasks of the DataFrame's own stage and train on
the rows they receive, spilled to local disk. No copy in the store; the same split as a materialized fit; a
killed rank's retry computes the DataFrame again and continues exactly; bad rows are refused like a
materialized fit refuses them."""
import json
import logging
import re

import pytest
import torch
from torch import nn

from estimator import TorchEstimator
from estimator.core.faults import ENV
from helpers import MLP, metrics, seeded
from spark_helpers import digits_frame

pytestmark = pytest.mark.spark


def _est(store, **kw):
    model = seeded(MLP)
    params = dict(num_proc=2, store=store, model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
                  loss=nn.CrossEntropyLoss(), metrics=["accuracy"], feature_cols=["features"], label_cols=["label"],
                  batch_size=32, epochs=5, validation=0.2, random_seed=3, data_mode="direct")
    params.update(kw)
    return TorchEstimator(**params)


def _stages(text):
    return json.loads(re.findall(r"fit stages: (\{.*\})", text)[-1])


def _same_history(a, b):
    assert [row["epoch"] for row in a] == [row["epoch"] for row in b]
    for x, y in zip(a, b):
        x, y = metrics(x), metrics(y)
        for key in x:
            assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-7), (key, x, y)


@pytest.mark.connect
def test_direct_trains_digits_on_two_ranks_and_leaves_no_copy_in_the_store(spark, store, digits, caplog):
    df = digits_frame(spark, digits, partitions=3)
    with caplog.at_level(logging.INFO, logger="estimator"):
        model = _est(store).fit(df)
    assert model.getHistory()[-1]["val_accuracy"] >= 0.90
    stages = _stages(caplog.text)
    assert stages["materialize_s"] == 0 and stages["direct_spill_s"] > 0
    assert not store.exists(store.path("data")) or not store.ls(store.path("data"))  # nothing materialized
    # the same rows train as a materialized fit would: the split is the same hash of each row
    with caplog.at_level(logging.INFO, logger="estimator"):
        _est(store, data_mode="materialize", epochs=1).fit(df)
    assert _stages(caplog.text)["train_rows"] == stages["train_rows"]
    predicted = model.transform(df).select("prediction").count()
    assert predicted == len(digits[1])


def test_validation_metrics_are_exact_over_the_same_rows_as_a_materialized_fit(spark, store, digits):
    """With lr=1e-30 the weights do not move: both modes then score the untrained model on the validation rows.
    The rows are split over the ranks differently (by hash vs by position), so equal numbers mean the same rows
    and sums that are exact over rows, not means of per-rank means."""
    df = digits_frame(spark, digits, partitions=3)
    tiny = dict(epochs=1, optimizer=torch.optim.SGD(seeded(MLP).parameters(), lr=1e-30))
    direct = _est(store, run_id="d", **tiny).fit(df).getHistory()[-1]
    saved = _est(store, run_id="m", data_mode="materialize", **tiny).fit(df).getHistory()[-1]
    assert direct["val_loss"] == pytest.approx(saved["val_loss"], rel=1e-6)  # float32 sums in another order
    assert direct["val_accuracy"] == saved["val_accuracy"]
    assert 0.02 < direct["val_accuracy"] < 0.5  # an untrained model: the numbers are not trivially equal


def test_a_killed_rank_is_retried_from_the_dataframe_and_continues_exactly(spark, store, digits, monkeypatch,
                                                                        caplog):
    """Rank 1 dies inside epoch 2 (before optimizer step 30; 23 steps per epoch, a checkpoint every 4 steps);
    the retry computes the DataFrame again, every rank receives the same rows in the same order, and the run
    ends exactly as an uninterrupted one."""
    df = digits_frame(spark, digits, partitions=3)  # not cached: the retry computes it again
    clean = _est(store, run_id="clean", epochs=2, checkpoint_steps=4).fit(df)
    monkeypatch.setenv(ENV, json.dumps([{"point": "step", "rank": 1, "action": "exit", "step": 30, "attempt": 0}]))
    with caplog.at_level(logging.INFO, logger="estimator"):
        resumed = _est(store, run_id="killed", epochs=2, checkpoint_steps=4, max_retries=1).fit(df)
    assert "Run killed failed on attempt 1 of 2; retrying from its last checkpoint" in caplog.text
    assert re.search(r"Run killed continues from its checkpoint after epoch 1 and step \d+ of epoch 2", caplog.text)
    _same_history(resumed.getHistory(), clean.getHistory())
    for a, b in zip(resumed.getModel().state_dict().values(), clean.getModel().state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6)


def test_streaming_from_the_spill_trains_as_the_in_memory_shard(spark, store, digits, caplog):
    df = digits_frame(spark, digits, partitions=2)
    with caplog.at_level(logging.INFO, logger="estimator"):
        streamed = _est(store, run_id="s", shuffle=False, epochs=2, inmemory_cache_all=False).fit(df)
    assert "Ranks read their data: arrow streaming (inmemory_cache_all=False); val arrow streaming" in caplog.text
    cached = _est(store, run_id="c", shuffle=False, epochs=2, inmemory_cache_all=True).fit(df)
    _same_history(streamed.getHistory(), cached.getHistory())


def test_bad_rows_are_refused_on_the_ranks_as_a_materialized_fit_refuses_them(spark, store, caplog):
    rows = [([float(i), 1.0], i % 2) for i in range(40)] + [([1.0, None], 0)]
    df = spark.createDataFrame(rows, "features array<float>, label long").repartition(2)
    small = dict(model=nn.Linear(2, 2), optimizer=torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1),
                 metrics=[], epochs=1, validation=None, max_retries=2)
    with caplog.at_level(logging.INFO, logger="estimator"), \
            pytest.raises(ValueError, match=r"Column 'features' has 1 rows with null values \(of 41 rows\)"):
        _est(store, **small).fit(df)
    assert "retrying" not in caplog.text  # the same rows would fail again
    # the short arrays lie in the second partition: the driver's head (16 rows) does not see them, the ranks do
    ragged = spark.createDataFrame([([1.0, 2.0], 0)] * 20 + [([1.0], 1)] * 20, "features array<float>, label long")
    with pytest.raises(ValueError, match=r"Column 'features' holds arrays of different lengths \(1 to 2 values"):
        _est(store, **small).fit(ragged)
    kept = _est(store, drop_nulls=True, **small).fit(df)  # filtered in Spark before the ranks
    assert len(kept.getHistory()) == 1


def test_direct_refuses_petastorm_and_warns_about_partitions_per_process(spark, store, digits):
    with pytest.raises(ValueError, match=r"reader='petastorm' reads Parquet files from the store, and "
                                         r"data_mode='direct' writes none"):
        _est(store, reader="petastorm").fit(digits_frame(spark, digits))
    with pytest.raises(ValueError, match=r"The 'data_mode' parameter of TorchEstimator must be 'materialize' or "
                                         r"'direct'\. Got 'disk' instead\."):
        _est(store, data_mode="disk").fit(digits_frame(spark, digits))
    with pytest.warns(UserWarning, match=r"TorchEstimator ignores partitions_per_process=3: .*data_mode='direct' "
                                         r"writes none"):
        _est(store, partitions_per_process=3, epochs=1).fit(digits_frame(spark, digits))
