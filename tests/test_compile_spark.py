"""compile=: the module is compiled on every rank before DDP wraps it; the fit trains the same weights as an
uncompiled fit (to a float tolerance), and the checkpoint and the TorchModel hold the plain module's weights."""
import io

import pytest
import torch
from torch import nn

from estimator import TorchEstimator
from estimator.fit.checks import check_compile
from helpers import MLP, BreakingMLP, metrics, seeded
from spark_helpers import digits_frame

pytestmark = pytest.mark.spark


def _est(store, **kw):
    model = seeded(MLP)
    params = dict(num_proc=2, store=store, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                  loss=nn.CrossEntropyLoss(), metrics=["accuracy"], feature_cols=["features"], label_cols=["label"],
                  batch_size=64, epochs=2, validation=0.2, random_seed=5)
    params.update(kw)
    return TorchEstimator(**params)


@pytest.fixture(scope="module")
def df(spark, digits):
    return digits_frame(spark, digits).cache()


@pytest.mark.parametrize("setting, atol", [({"backend": "aot_eager"}, 1e-6), (True, 1e-4)],
                         ids=["aot_eager", "inductor"])
def test_a_compiled_fit_trains_the_weights_of_an_uncompiled_one(spark, store, df, setting, atol):
    plain = _est(store, run_id="plain").fit(df)
    fast = _est(store, run_id="compiled", compile=setting).fit(df)
    for a, b in zip(fast.getModel().state_dict().values(), plain.getModel().state_dict().values()):
        assert torch.allclose(a, b, atol=atol), (a - b).abs().max()
    for x, y in zip(fast.getHistory(), plain.getHistory()):
        assert metrics(x) == pytest.approx(metrics(y), rel=1e-3, abs=1e-4)
    state = torch.load(io.BytesIO(store.read_bytes(store.run("compiled").checkpoint)), weights_only=True)
    assert list(state["model"]) == list(plain.getModel().state_dict())  # no "_orig_mod." keys
    assert fast.getCompile() == setting


def test_the_ranks_really_compile(spark, store, df):
    from estimator.failures import RankFailed

    model = seeded(BreakingMLP)
    assert len(_est(store, run_id="eager", model=model, epochs=1).fit(df).getHistory()) == 1  # eager runs it
    with pytest.raises(RankFailed, match=r"graph_break|graph break"):
        _est(store, run_id="full", model=model, epochs=1, compile={"fullgraph": True}, max_retries=0).fit(df)


def test_torch_compile_refusals_are_named_on_the_driver():
    check_compile(False, nn.Linear(2, 2))
    check_compile({"mode": "reduce-overhead"}, nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"The 'compile' parameter of TorchEstimator was refused by torch.compile: "
                                         r"RuntimeError: Unrecognized mode=fastest"):
        check_compile({"mode": "fastest"}, nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"unexpected keyword argument 'modee'"):
        check_compile({"modee": "default"}, nn.Linear(2, 2))
