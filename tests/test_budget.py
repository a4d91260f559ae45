"""The store's budget for materialized data (store.budget), on memory:// and local stores: no Spark."""
import json

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
