"""The store's budget for materialized data (store.budget), on memory:// and local stores: no Spark."""
import json
import posixpath

import pytest

from store import Store
from store.budget import copies, enforce, release, take_lease


def put_copy(store, shape, fp, nbytes, used):
    layout = store.data(shape)
    store.write_bytes_atomic(f"{layout.attempt(fp)}/part-0.parquet", b"x" * 10)
    store.write_bytes_atomic(layout.commit_marker(fp), json.dumps({"attempt": fp, "bytes": nbytes,
                                                                   "created": used}).encode())
    store.write_bytes_atomic(layout.used(fp), json.dumps({"used": used}).encode())
    return layout


def kept(store):
    return sorted(c.fingerprint for c in copies(store))


@pytest.fixture(params=["memory", "local"])
def make_store(request, tmp_path):
    def make(**kw):
        url = f"memory://budget-{tmp_path.name}" if request.param == "memory" else str(tmp_path / "s")
        return Store.create(url, **kw)

    return make


def test_least_recently_used_copies_go_first_until_the_data_fits(make_store):
    store = make_store(max_data_bytes=250, max_data_age=None)
    for i, fp in enumerate(["a", "b", "c", "d"]):
        put_copy(store, "shape1" if i % 2 else "shape2", fp, 100, used=1000.0 + (10 - i))  # a: newest, d: oldest
    removed = enforce(store, now=2000.0)
    assert sorted(c.fingerprint for c in removed) == ["c", "d"] and kept(store) == ["a", "b"]
    assert not store.exists(store.data("shape2").attempt("c"))  # the rows went with the marker


def test_copies_unused_for_longer_than_the_age_go(make_store):
    store = make_store(max_data_bytes=None, max_data_age=3600)
    put_copy(store, "s", "old", 1, used=1000.0)
    put_copy(store, "s", "new", 1, used=4000.0)
    enforce(store, now=5000.0)
    assert kept(store) == ["new"]


def test_a_copy_a_running_fit_holds_is_kept_and_its_use_is_recorded(make_store):
    store = make_store(max_data_bytes=150, max_data_age=None)
    layout = put_copy(store, "s", "held", 100, used=1000.0)
    put_copy(store, "s", "newer", 100, used=2000.0)
    lease = take_lease(store, layout, "held")  # now the most recent use, and leased
    put_copy(store, "s", "newest", 100, used=3000.0)
    enforce(store, now=3000.0)
    assert "held" in kept(store)
    release(store, lease)
    assert not store.exists(lease)
    enforce(store, now=3000.0)
    assert kept(store) == ["held"]  # released last: the most recently used


def test_a_stale_lease_does_not_hold_a_copy_forever(make_store):
    store = make_store(max_data_bytes=None, max_data_age=3600)
    layout = put_copy(store, "s", "dead", 1, used=1000.0)
    store.write_bytes_atomic(layout.lease("dead", "x"), json.dumps({"since": 1000.0}).encode())
    enforce(store, now=1000.0 + 2 * 86400)
    assert kept(store) == []


def test_budget_values_are_checked():
    with pytest.raises(ValueError, match=r"max_data_bytes must be a number > 0, or None for no limit. Got -1"):
        Store.create("/tmp/x", max_data_bytes=-1)
    assert Store.create("/tmp/x").max_data_bytes == 50 * 2**30 and Store.create("/tmp/x").max_data_age == 14 * 86400


def _run(store, run_id, nbytes, modified, alive=None):
    import os

    layout = store.run(run_id)
    store.write_bytes_atomic(layout.checkpoint, b"x" * nbytes)
    os.utime(layout.checkpoint, (modified, modified))
    if alive is not None:
        store.write_bytes_atomic(layout.alive, b"{}")
        os.utime(layout.alive, (alive, alive))


def test_run_folders_are_kept_within_the_budget_oldest_first_never_the_own_or_a_live_one(tmp_path):
    import time

    from store.runs import enforce_runs, run_folders

    now = time.time()
    store = Store.create(str(tmp_path / "store"), max_run_bytes=3100, max_run_age=10 * 86400)
    _run(store, "ancient", 100, now - 20 * 86400)  # older than max_run_age
    _run(store, "old", 1000, now - 5 * 86400)
    _run(store, "live", 1000, now - 4 * 86400, alive=now - 5)  # a launch beats it: kept
    _run(store, "mine", 1000, now - 3 * 86400)  # the fit's own: kept
    _run(store, "new", 1000, now - 60)
    assert {posixpath.basename(r.path): r.nbytes for r in run_folders(store, now)}["old"] == 1000
    removed = enforce_runs(store, keep={store.run("mine").root}, now=now)
    assert sorted(posixpath.basename(r.path) for r in removed) == ["ancient", "old"]  # 4,102 -> 3,002 bytes
    # within 3,100 now: the newest stays
    assert sorted(posixpath.basename(r.path) for r in run_folders(store, now)) == ["live", "mine", "new"]
    assert enforce_runs(Store.create(str(tmp_path / "store"), max_run_bytes=None, max_run_age=None)) == []
    with pytest.raises(ValueError, match="max_run_bytes must be a number > 0, or None"):
        Store.create(str(tmp_path / "x"), max_run_bytes=0)
