"""The reader choices in real fits: streaming (forced) against the in-memory shard, binary image columns
decoded by transformation_fn, and the error for a binary column without one."""
import io
import logging

import numpy as np
import pytest
import torch
from torch import nn

from estimator import TorchEstimator
from helpers import MLP, metrics, seeded
from spark_helpers import digits_frame, jobs_run_by

pytestmark = pytest.mark.spark


def _est(store, **kw):
    model = seeded(MLP)
    params = dict(num_proc=2, store=store, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                  loss=nn.CrossEntropyLoss(), metrics=["accuracy"], feature_cols=["features"], label_cols=["label"],
                  batch_size=32, epochs=2, validation=0.2, random_seed=11)
    params.update(kw)
    return TorchEstimator(**params)


def test_streaming_trains_exactly_as_the_in_memory_shard_without_shuffle(spark, store, digits, caplog):
    df = digits_frame(spark, digits, partitions=4)
    with caplog.at_level(logging.INFO, logger="estimator"):
        streamed = _est(store, run_id="s", shuffle=False, inmemory_cache_all=False).fit(df)
    assert "Ranks read their data: arrow streaming (inmemory_cache_all=False); val arrow streaming" in caplog.text
    assert '"data_wait_fraction"' in caplog.text
    cached = _est(store, run_id="c", shuffle=False, inmemory_cache_all=True).fit(df)
    for a, b in zip(streamed.getHistory(), cached.getHistory()):
        assert metrics(a) == pytest.approx(metrics(b), rel=1e-6)
        assert 0 <= a["data_wait"] < 1
    for a, b in zip(streamed.getModel().state_dict().values(), cached.getModel().state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6)
    model = seeded(MLP)  # shuffled through the buffer, it learns (rows and labels stay together)
    shuffled = _est(store, run_id="sh", epochs=4, optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
                    model=model, inmemory_cache_all=False, shuffle_buffer_size=200).fit(df)
    assert shuffled.getHistory()[-1]["val_accuracy"] > 0.85


def _png_frame(spark, digits):
    from PIL import Image

    X, y = digits
    rows = []
    for x, label in zip(X, y):
        buffer = io.BytesIO()
        Image.fromarray((x.reshape(8, 8) * 255).astype(np.uint8)).save(buffer, format="PNG")
        rows.append((bytearray(buffer.getvalue()), int(label)))
    return spark.createDataFrame(rows, "image binary, label long").repartition(2)


def decode_png(frame):
    from PIL import Image

    frame["image"] = [np.asarray(Image.open(io.BytesIO(b)), dtype=np.float32).reshape(-1) / 255.0
                      for b in frame["image"]]
    return frame


def test_png_bytes_decoded_by_transformation_fn_in_worker_processes(spark, store, digits, caplog):
    df = _png_frame(spark, digits)
    with caplog.at_level(logging.INFO, logger="estimator"):
        model = seeded(MLP)
        fitted = _est(store, feature_cols=["image"], transformation_fn=decode_png, epochs=4, model=model,
                      optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
                      train_reader_num_workers=2, reader_pool_type="process", inmemory_cache_all=False).fit(df)
    assert fitted.getHistory()[-1]["val_accuracy"] > 0.85  # decoded in 2 spawned processes per rank
    assert "arrow streaming" in caplog.text
    with pytest.raises(ValueError, match="'image' .* holds bytes: TorchModel.transform feeds numbers .* Decode"):
        fitted.transform(df)


def test_a_binary_column_without_transformation_fn_says_what_to_pass(spark, store, digits):
    df = _png_frame(spark, digits)
    with pytest.raises(ValueError, match=r"Column 'image' \(from feature_cols\) holds bytes .* set transformation_fn"):
        _est(store, feature_cols=["image"]).fit(df)
    assert jobs_run_by(spark, lambda: pytest.raises(ValueError, _est(store, feature_cols=["image"]).fit, df)) == []
