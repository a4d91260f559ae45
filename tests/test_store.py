import pickle

import pytest

from store import LocalStore, RunLayout, Store


def test_local_path_store(tmp_path):
    store = Store.create(str(tmp_path / "runs"))
    assert store.is_local and store.root == str(tmp_path / "runs")
    assert store.url(store.path("a")) == f"file://{tmp_path}/runs/a"
    path = store.path("x", "y.bin")
    store.write_bytes_atomic(path, b"hello")
    assert store.read_bytes(path) == b"hello"
    assert [p for p in store.ls(store.path("x"))] == [path]  # no temporary file left behind


def test_relative_and_file_url(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert Store.create("rel").root == str(tmp_path / "rel")
    assert Store.create(f"file://{tmp_path}/u").root == f"{tmp_path}/u"
    assert isinstance(LocalStore(str(tmp_path)), Store)


def test_memory_store_and_layout():
    store = Store.create("memory://bucket/prefix")
    assert not store.is_local
    run = store.run("r1")
    assert isinstance(run, RunLayout)
    assert run.checkpoint == "/bucket/prefix/runs/r1/checkpoint.pt"
    assert store.url(run.checkpoint) == "memory:///bucket/prefix/runs/r1/checkpoint.pt"
    data = store.data("key")
    assert data.train("a1") == "/bucket/prefix/data/key/attempt-a1/train"
    assert data.commit_marker("fp") == "/bucket/prefix/data/key/fp_COMMITTED.json"
    store.write_bytes_atomic(run.checkpoint, b"x")
    assert store.exists(run.checkpoint)
    store.rm(store.path("runs"))
    assert not store.exists(run.checkpoint)


def test_credentials_never_in_repr_or_without_credentials():
    store = Store.create("memory://b", storage_options={"sas_token": "sv=SECRET", "account_key": "KEY"})
    assert "SECRET" not in repr(store) and "KEY" not in repr(store)
    assert store.without_credentials().storage_options == {}


def test_pickles_without_the_filesystem_client(tmp_path):
    store = Store.create(str(tmp_path))
    store.fs  # resolve
    clone = pickle.loads(pickle.dumps(store))
    assert clone._fs is None and clone.root == store.root


def test_unknown_scheme_is_a_clear_error():
    with pytest.raises(ValueError, match="Store cannot open 'nosuchfs://x'"):
        Store.create("nosuchfs://x").fs


def test_a_scheme_whose_filesystem_is_missing_names_the_extra_that_installs_it(monkeypatch):
    import store.store as module

    def missing(url, **kwargs):  # fsspec's own words when s3fs is not installed
        raise ImportError("Install s3fs to access S3")

    monkeypatch.setattr(module, "url_to_fs", missing)
    with pytest.raises(ValueError, match=r"Install s3fs to access S3 \(pip install 'spark-torch-estimator\[s3\]'"):
        Store.create("s3://bucket/runs").fs
    with pytest.raises(ValueError, match=r"access S3 \(pip install 'spark-torch-estimator\[azure\]'"):
        Store.create("abfss://container@account.dfs.core.windows.net/runs").fs


def test_empty_prefix_rejected():
    with pytest.raises(ValueError, match="non-empty URL"):
        Store.create("")


def test_horovod_store_names_resolve_like_horovod():
    from store import AdlsStore, DBFSLocalStore, HDFSStore

    dbfs = Store.create("dbfs:/ml/runs")
    assert isinstance(dbfs, DBFSLocalStore) and dbfs.prefix == "/dbfs/ml/runs"
    assert DBFSLocalStore("/dbfs/x").prefix == "/dbfs/x"
    hdfs = Store.create("hdfs://namenode:8020/user/me/runs")
    assert isinstance(hdfs, HDFSStore) and hdfs.prefix == "hdfs://namenode:8020/user/me/runs"
    assert HDFSStore("/user/me", host="nn", port=8020, user="me", kerb_ticket="/tmp/krb").prefix == \
        "hdfs://nn:8020/user/me"
    assert HDFSStore("/user/me", user="me").storage_options == {"user": "me"}
    assert HDFSStore("user/me").prefix == "hdfs://default/user/me"
    adls = AdlsStore.create("abfs://c@acct.dfs.core.windows.net/p", storage_options={"account_name": "acct",
                                                                                     "sas_token": "sv=SECRET"},
                            save_runs=False)
    assert isinstance(adls, AdlsStore) and adls.save_runs is False and "SECRET" not in repr(adls)


def test_horovod_getters_and_checkpoint_filename(tmp_path):
    store = Store.create(str(tmp_path), checkpoint_filename="model.ckpt")
    assert store.get_checkpoint_filename() == "model.ckpt"
    assert store.run("r1").checkpoint.endswith("/runs/r1/model.ckpt")
    assert store.get_run_path("r1") == f"file://{tmp_path}/runs/r1"
    assert store.get_checkpoint_path("r1") == f"file://{tmp_path}/runs/r1/model.ckpt"  # the file, as in Horovod
    with pytest.raises(ValueError, match="checkpoint_filename must be a file name"):
        Store.create(str(tmp_path), checkpoint_filename="a/b.pt")


def test_redaction_covers_nested_options_and_the_probe(tmp_path):
    from store import StoreUnavailable

    store = Store.create(str(tmp_path / "missing" / "deeper"), storage_options={"client_kwargs": {"token": "TOKEN123"}})
    assert store.redact("auth TOKEN123 failed") == "auth *** failed"
    store.check_writable()  # a local prefix that does not exist yet is created
    with pytest.raises(StoreUnavailable, match="is not reachable or not writable: .*Error"):
        Store.create("/proc/cannot-write-here").check_writable()


@pytest.mark.parametrize("url, root, full", [
    ("hdfs://namenode:8020/user/me/runs", "/user/me/runs", "hdfs://namenode:8020/user/me/runs/runs/r1"),
    ("hdfs://nameservice1/user/me", "/user/me", "hdfs://nameservice1/user/me/runs/r1"),  # HA nameservice
    ("viewfs://cluster/user/me/", "/user/me", "viewfs://cluster/user/me/runs/r1"),
    ("webhdfs://namenode:9870/data", "/data", "webhdfs://namenode:9870/data/runs/r1"),
    ("swebhdfs://namenode:9871/data", "/data", "swebhdfs://namenode:9871/data/runs/r1"),
])
def test_hadoop_urls_keep_their_namenode_and_need_no_connection(url, root, full):
    store = Store.create(url)
    assert store.root == root and store.get_run_path("r1") == full
    assert store.protocol == url.split(":")[0] and not store.is_local
    assert store._fs is None  # naming paths did not connect (no libhdfs needed on the driver for this)


def test_probe_timeout_is_the_users(tmp_path, monkeypatch):
    import threading

    from store import StoreUnavailable

    store = Store.create(str(tmp_path), probe_timeout=0.5)
    release = threading.Event()
    # an endpoint that hangs (fsspec shares one LocalFileSystem: monkeypatch puts it back afterwards)
    monkeypatch.setattr(store.fs, "makedirs", lambda *a, **k: release.wait(10))
    with pytest.raises(StoreUnavailable, match=r"did not answer within 0.5 s.*probe_timeout"):
        store.check_writable()
    release.set()
    with pytest.raises(ValueError, match="probe_timeout must be a number of seconds > 0. Got 0 instead."):
        Store.create(str(tmp_path), probe_timeout=0)


def test_cleanup_removes_orphaned_attempts_and_old_or_surplus_runs(tmp_path):
    import json
    import os
    import time

    store = Store.create(str(tmp_path / "store"))
    day = 86400

    def touch(path, age):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write("x")
        os.utime(path, (time.time() - age, time.time() - age))

    data = store.path("data", "k1")
    touch(os.path.join(data, "attempt-good", "train", "part-0.parquet"), 2 * day)
    touch(os.path.join(data, "attempt-lost", "train", "part-0.parquet"), 2 * day)  # interrupted, long ago
    touch(os.path.join(data, "attempt-busy", "train", "part-0.parquet"), 60)  # another fit writing right now
    with open(os.path.join(data, "_COMMITTED.json"), "w") as f:
        json.dump({"attempt": "good"}, f)
    for run, age in (("old", 30 * day), ("mid", 2 * day), ("new", 60)):
        touch(store.path("runs", run, "checkpoint.pt"), age)
    touch(store.path("mine", "notes.txt"), 90 * day)  # not the estimator's: never touched

    assert store.cleanup(dry_run=True) == [store.url(os.path.join(data, "attempt-lost"))]
    assert os.path.exists(os.path.join(data, "attempt-lost"))  # a dry run removes nothing
    store.cleanup()
    assert sorted(os.listdir(data)) == ["_COMMITTED.json", "attempt-busy", "attempt-good"]
    assert store.cleanup(keep_runs=2) == [store.url(store.path("runs", "old"))]
    assert sorted(os.listdir(store.path("runs"))) == ["mid", "new"]
    removed = store.cleanup(older_than=day)
    assert store.url(store.path("runs", "mid")) in removed and store.url(data) not in removed  # data: 60 s ago
    assert os.listdir(store.path("runs")) == ["new"] and os.path.exists(store.path("mine", "notes.txt"))
