"""Stores Spark's own writer cannot reach: S3 through s3fs against a moto server on loopback that this
test starts and stops. Executors write the Parquet through fsspec; ranks read it and checkpoint there."""
import io
import logging
import time

import pytest
import torch
from torch import nn

from estimator import TorchEstimator, TorchModel
from helpers import MLP, seeded
from spark_helpers import digits_frame, jobs_run_by
from store import Store, StoreUnavailable

pytestmark = pytest.mark.spark
moto_server = pytest.importorskip("moto.server")
pytest.importorskip("s3fs")
SECRET = "s3cr3t-ACCESS-value"


@pytest.fixture(scope="module")
def s3(monkeypatch_module):
    monkeypatch_module.setenv("AWS_EC2_METADATA_DISABLED", "true")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    import boto3

    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="AKIDTEST", aws_secret_access_key=SECRET,
                 region_name="us-east-1").create_bucket(Bucket="runs")
    yield endpoint
    server.stop()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def _options(endpoint):
    return {"key": "AKIDTEST", "secret": SECRET, "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}


def _est(store, **kw):
    model = seeded(MLP)
    return TorchEstimator(num_proc=2, store=store, model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
                          loss=nn.CrossEntropyLoss(), metrics=["accuracy"], feature_cols=["features"],
                          label_cols=["label"], batch_size=64, epochs=3, validation=0.1, random_seed=4, **kw)


def test_fit_transform_with_an_s3_store(spark, digits, s3, caplog, tmp_path):
    store = Store.create("s3://runs/experiments", storage_options=_options(s3))
    df = digits_frame(spark, digits)
    with caplog.at_level(logging.DEBUG, logger="estimator"):
        fitted = _est(store).fit(df)
    assert fitted.getHistory()[-1]["val_accuracy"] > 0.8
    parquet = list(store.find(store.path("data"), suffix=".parquet"))
    assert len(parquet) >= 2 and all(p.startswith("runs/experiments/data/") for p in parquet)
    assert store.exists(store.run(fitted.getRunId()).checkpoint)
    checkpoint = torch.load(io.BytesIO(store.read_bytes(store.run(fitted.getRunId()).checkpoint)), weights_only=True)
    assert checkpoint["epoch"] == 3
    assert fitted.transform(df).filter("prediction = label").count() > 0.8 * df.count()
    # a second fit reuses the committed files (the marker lists exactly the files of successful tasks)
    assert len(jobs_run_by(spark, lambda: _est(store).fit(df))) == 1
    assert SECRET not in caplog.text
    fitted.write().overwrite().save(str(tmp_path / "model"))
    est_path = tmp_path / "estimator"
    _est(store).save(str(est_path))
    for file in tmp_path.rglob("*"):
        if file.is_file():
            assert SECRET.encode() not in file.read_bytes(), file
    assert TorchModel.load(str(tmp_path / "model")).getRunId() == fitted.getRunId()


def test_unreachable_store_fails_in_seconds_before_any_job(spark, digits):
    dead = Store.create("s3://runs/x", storage_options=_options("http://127.0.0.1:9"))
    df = digits_frame(spark, digits)
    errors = []

    def fit():
        started = time.perf_counter()
        with pytest.raises(StoreUnavailable) as info:
            _est(dead).fit(df)
        errors.append((str(info.value), time.perf_counter() - started))

    assert jobs_run_by(spark, fit) == []
    message, seconds = errors[0]
    assert "s3://runs/x" in message and SECRET not in message and "***" in message
    assert seconds < 45  # the probe is cut off at 30 s; botocore alone would retry longer
