"""Stores Spark's own writer cannot reach, end to end against local servers that these tests start and
stop: S3 (s3fs) against moto, Azure Data Lake (adlfs, abfs://) against Azurite, and webhdfs:// (fsspec's
WebHDFS client) against the minimal WebHDFS endpoint in tests/webhdfs_server.py. Executors write the
Parquet through fsspec; ranks read it from the store and checkpoint there; credentials never leak."""
import sys
import io
import logging
import os
import subprocess
import time

import pytest
import torch
from torch import nn

from estimator import TorchEstimator, TorchModel
from helpers import MLP, seeded
from servers import free_port, wait_for_port
from spark_helpers import digits_frame, jobs_run_by
from store import AdlsStore, Store, StoreUnavailable

pytestmark = [pytest.mark.spark, pytest.mark.connect]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AZURITE = os.path.join(ROOT, ".cache", "azurite", "node_modules", ".bin", "azurite-blob")
S3_SECRET = "s3cr3t-ACCESS-value"
WEBHDFS_PASSWORD = "w3bhdfs-PASSWORD-value"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


@pytest.fixture(scope="module")
def s3_options():
    import boto3
    from moto.server import ThreadedMotoServer

    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="AKIDTEST", aws_secret_access_key=S3_SECRET,
                 region_name="us-east-1").create_bucket(Bucket="runs")
    yield lambda url=endpoint: {"key": "AKIDTEST", "secret": S3_SECRET,
                                "client_kwargs": {"endpoint_url": url, "region_name": "us-east-1"}}
    server.stop()


@pytest.fixture(scope="module")
def azure_options(tmp_path_factory):
    assert os.path.exists(AZURITE), "Azurite is not installed: run `bash .ci/test` (or npm install --prefix " \
                                    ".cache/azurite azurite) first"
    port = free_port()
    process = subprocess.Popen([AZURITE, "--disableTelemetry", "--inMemoryPersistence", "--blobHost", "127.0.0.1",
                                "--blobPort", str(port), "--skipApiVersionCheck", "--silent"],
                               cwd=str(tmp_path_factory.mktemp("azurite")),  # its debug/log files go here
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_port(port, process)  # adlfs retries for ~80 s against a dead endpoint: wait first

        def options(p=port):
            return {"account_name": "devstoreaccount1", "connection_string": (
                f"DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey={AZURITE_KEY};"
                f"BlobEndpoint=http://127.0.0.1:{p}/devstoreaccount1;")}

        from azure.storage.blob import BlobServiceClient

        BlobServiceClient.from_connection_string(options()["connection_string"]).create_container("runs")
        yield options
    finally:
        process.terminate()
        process.wait(10)


@pytest.fixture(scope="module")
def webhdfs_options(tmp_path_factory):
    port = free_port()
    process = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "webhdfs_server.py"), str(port),
                                str(tmp_path_factory.mktemp("webhdfs"))])
    try:
        wait_for_port(port, process)
        yield lambda p=port: {"port": p, "user": "tester", "password": WEBHDFS_PASSWORD}
    finally:
        process.terminate()
        process.wait(10)


@pytest.fixture(params=["s3", "abfs", "webhdfs"])
def kind(request):
    return request.param


@pytest.fixture
def remote(kind, request):
    options = request.getfixturevalue({"s3": "s3_options", "abfs": "azure_options", "webhdfs": "webhdfs_options"}[kind])
    return kind, options


def _secret(kind):
    return {"s3": S3_SECRET, "abfs": AZURITE_KEY, "webhdfs": WEBHDFS_PASSWORD}[kind]


def _make_store(kind, options, dead=False):
    probe = {"probe_timeout": 5} if dead else {}  # the clients retry a closed port for longer; the default cut is 30 s
    if kind == "s3":
        opts = options("http://127.0.0.1:9") if dead else options()
        return Store.create("s3://runs/experiments", storage_options=opts, **probe)
    if kind == "webhdfs":
        opts = options(9) if dead else options()
        return Store.create("webhdfs://127.0.0.1/runs/experiments", storage_options=opts, probe_timeout=10)
    opts = options(9) if dead else options()
    return AdlsStore.create("abfs://runs@devstoreaccount1.dfs.core.windows.net/experiments", storage_options=opts,
                            **probe)


def _est(store, **kw):
    model = seeded(MLP)
    return TorchEstimator(num_proc=2, store=store, model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
                          loss=nn.CrossEntropyLoss(), metrics=["accuracy"], feature_cols=["features"],
                          label_cols=["label"], batch_size=64, epochs=3, validation=0.1, random_seed=4, **kw)


def test_fit_transform_save_with_a_remote_store(spark, digits, remote, caplog, tmp_path):
    kind, options = remote
    store = _make_store(kind, options)
    df = digits_frame(spark, digits)
    with caplog.at_level(logging.DEBUG, logger="estimator"):
        fitted = _est(store, inmemory_cache_all=False).fit(df)  # ranks stream their rows from the remote store
    assert fitted.getHistory()[-1]["val_accuracy"] > 0.8
    assert "Ranks read their data: arrow streaming (inmemory_cache_all=False" in caplog.text
    parquet = list(store.find(store.path("data"), suffix=".parquet"))
    assert len(parquet) >= 2 and all(p.lstrip("/").startswith("runs/experiments/data/") for p in parquet)
    checkpoint = torch.load(io.BytesIO(store.read_bytes(store.run(fitted.getRunId()).checkpoint)), weights_only=True)
    assert checkpoint["epoch"] == 3
    assert fitted.transform(df).filter("prediction = label").count() > 0.8 * df.count()
    # a second fit reuses the committed files (the marker lists exactly the files of successful tasks)
    assert len(jobs_run_by(spark, lambda: _est(store).fit(df))) == 1
    assert _secret(kind) not in caplog.text
    stored = list(store.find(store.root))  # data, checkpoints, progress, run metadata: nothing holds the secret
    assert any(p.endswith("metadata.json") for p in stored) and any(p.endswith("checkpoint.pt") for p in stored)
    for path in stored:
        assert _secret(kind).encode() not in store.read_bytes(path), path
    fitted.write().overwrite().save(str(tmp_path / "model"))
    _est(store).save(str(tmp_path / "estimator"))
    for file in tmp_path.rglob("*"):
        if file.is_file():
            assert _secret(kind).encode() not in file.read_bytes(), file
    assert TorchModel.load(str(tmp_path / "model")).getRunId() == fitted.getRunId()


def test_unreachable_remote_store_fails_in_seconds_before_any_job(spark, digits, remote):
    kind, options = remote
    dead = _make_store(kind, options, dead=True)
    df = digits_frame(spark, digits)
    errors = []

    def fit():
        started = time.perf_counter()
        with pytest.raises(StoreUnavailable) as info:
            _est(dead).fit(df)
        errors.append((str(info.value), time.perf_counter() - started))

    assert jobs_run_by(spark, fit) == []
    message, seconds = errors[0]
    assert "runs" in message and _secret(kind) not in message and "***" in message
    assert seconds < 20  # the probe is cut off at 5 s here (10 s for webhdfs); the clients alone retry for longer


def test_a_full_fine_tune_saved_on_s3_is_built_by_a_fresh_process_from_the_handle_alone(s3_options, tmp_path):
    """A Hugging Face model saved at an s3:// URL (moto) and loaded: the driver holds a skeleton and a handle; a
    new process (an executor's Python worker: no fsspec config of the driver's, its own temporary folder) given
    only the pickled handle builds the saved weights, the storage options having travelled with it; the save
    of the loaded model keeps none of them."""
    import cloudpickle
    import s3fs
    from transformers import AutoModelForCausalLM

    from estimator.core.meta import meta_tensors
    from estimator.predict.weights import held_saved, save_module
    from lm_helpers import color_facts, save_pretrained_llama

    folder = save_pretrained_llama(str(tmp_path / "tiny"), [p + r for p, r in color_facts()])
    model = AutoModelForCausalLM.from_pretrained(folder)
    fs = s3fs.S3FileSystem(**s3_options())
    save_module(model, None, None, fs, "runs/held-model")
    skeleton, _, handle = held_saved(fs, "runs/held-model")
    assert meta_tensors(skeleton)
    (tmp_path / "handle.pkl").write_bytes(cloudpickle.dumps(handle))
    (tmp_path / "executor-tmp").mkdir()
    executor = ("import pickle, sys, torch; handle = pickle.load(open(sys.argv[1], 'rb')); "
                "torch.save(handle.build().state_dict(), sys.argv[2])")
    done = subprocess.run([sys.executable, "-c", executor, str(tmp_path / "handle.pkl"), str(tmp_path / "built.pt")],
                          capture_output=True, text=True, timeout=120, cwd=str(tmp_path),
                          env=dict(os.environ, TMPDIR=str(tmp_path / "executor-tmp"), PYTHONPATH=ROOT))
    assert done.returncode == 0, done.stderr[-3000:]
    built = torch.load(str(tmp_path / "built.pt"), weights_only=True)
    for name, value in model.state_dict().items():
        assert torch.equal(built[name], value), name
    assert any((tmp_path / "executor-tmp").rglob("model.safetensors"))  # its own copy, on its machine
    assert S3_SECRET.encode() not in cloudpickle.dumps(handle.factory.without_credentials())
    assert S3_SECRET.encode() in (tmp_path / "handle.pkl").read_bytes()  # what transform sends: the options travel
    from transformers import AutoTokenizer

    held = TorchModel(model=skeleton, model_handle=handle, tokenizer=AutoTokenizer.from_pretrained(folder),
                      feature_cols=["prompt"], output_kind="generate", max_new_tokens=4)
    pyfunc = held.as_pyfunc()  # what MLflow would keep in its files: the URL, no storage option
    assert S3_SECRET.encode() not in cloudpickle.dumps(pyfunc) and b"held-model" in cloudpickle.dumps(pyfunc)
