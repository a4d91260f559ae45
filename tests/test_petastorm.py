"""reader='petastorm': real petastorm 0.12.1 on the Spark 3.5 stack; a clear error elsewhere."""
import io

import numpy as np
import pyarrow
import pytest
import torch
from torch import nn

from estimator.core.spec import ReaderSpec
from estimator.launch.local import LocalLauncher
from helpers import MLP, make_spec, seeded

PETASTORM_STACK = int(pyarrow.__version__.split(".")[0]) < 15
needs_petastorm = pytest.mark.skipif(not PETASTORM_STACK, reason="petastorm runs on the pyarrow<15 stack only "
                                                                 "(CI runs this file there too)")


@pytest.mark.skipif(PETASTORM_STACK, reason="on the petastorm stack the reader works")
def test_petastorm_on_an_incompatible_stack_names_the_pins():
    from estimator import TorchEstimator

    model = MLP()
    est = TorchEstimator(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss=nn.CrossEntropyLoss(),
                         feature_cols=["features"], label_cols=["label"], reader="petastorm")
    with pytest.raises(ValueError, match=r"reader='petastorm' needs (petastorm|pyarrow < 15).*pyspark 3\.5\.9, "
                                         r"pyarrow 14\.0\.2, numpy 1\.26\.4, pandas 2\.2\.3 and petastorm 0\.12\.1"):
        est._checked()


def _spec(store, digits, reader, train_rows=1001, **fields):
    model = seeded(MLP)
    return make_spec(store, digits, model, torch.optim.Adam(model.parameters(), lr=0.01), train_rows=train_rows,
                     val_rows=151, epochs=2, reader=reader, **fields)


@needs_petastorm
def test_petastorm_shards_train_with_equal_steps_and_exact_validation(store, digits):
    # train: row groups of 300, 300, 300, 101 -> ranks hold 600 and 401 rows, yet take the same steps
    results = LocalLauncher().run(_spec(store, digits, ReaderSpec("petastorm", 2, 1, "thread")), 2)
    assert [r.reader for r in results] == ["petastorm(thread, workers=2); val petastorm(thread, workers=1)"] * 2
    assert results[0].history == results[1].history
    trained = MLP()
    trained.load_state_dict(torch.load(io.BytesIO(store.read_bytes(store.run("r").checkpoint)),
                                       weights_only=True)["model"])
    X, y = digits
    with torch.no_grad():
        logits = trained(torch.from_numpy(X[-151:]))
    last = results[0].history[-1]
    assert last["val_loss"] == pytest.approx(nn.CrossEntropyLoss()(logits, torch.from_numpy(y[-151:])).item(),
                                             rel=1e-5)
    assert last["val_accuracy"] == pytest.approx((logits.argmax(1).numpy() == y[-151:]).mean(), abs=1e-9)
    assert last["accuracy"] > 0.6


@needs_petastorm
def test_petastorm_in_memory_cache_and_dummy_pool(store, digits):
    results = LocalLauncher().run(_spec(store, digits, ReaderSpec("petastorm", None, None, "dummy",
                                                                  inmemory_cache_all=True)), 2)
    assert results[0].reader == "petastorm(dummy, workers=1, cached); val petastorm(dummy, workers=1, cached)"
    assert results[0].history[-1]["val_accuracy"] > 0.6


@needs_petastorm
def test_petastorm_applies_the_transformation_fn(store, digits):
    def all_zero(frame):
        frame["label"] = 0
        return frame

    from estimator.core.pickling import dumps, user_objects
    from estimator.train.objectives.classic import Objective

    spec = _spec(store, digits, ReaderSpec("petastorm", 1, 1, "thread"), train_rows=600)
    objs = user_objects(seeded(MLP), torch.optim.Adam(seeded(MLP).parameters(), lr=0.05), [nn.CrossEntropyLoss()],
                        [1.0], ["accuracy"], transformation_fn=all_zero, objective=Objective)
    import dataclasses

    spec = dataclasses.replace(spec, payload=dumps(objs, "model", roots=[objs.model, all_zero]))
    history = LocalLauncher().run(spec, 1)[0].history
    assert history[-1]["val_accuracy"] == 1.0  # every (transformed) validation label is 0, and it learned that
    assert np.isfinite(history[-1]["val_loss"])


@needs_petastorm
def test_petastorm_reads_only_the_committed_files(store, digits):
    """A failed task attempt can leave a partial file beside the committed ones (remote stores are
    written by executors): the reader must read the files the commit names, not the folder."""
    spec = _spec(store, digits, ReaderSpec("petastorm", 1, 1, "dummy"))
    store.fs.pipe_file(store.path("train", "part-leftover-of-a-failed-attempt.parquet"), b"PAR1 truncated")
    results = LocalLauncher().run(spec, 2)
    assert sum(r.train_rows for r in results) == 1001 and results[0].history[-1]["accuracy"] > 0.6
