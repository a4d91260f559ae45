import inspect

import pytest
import torch
from torch import nn

from estimator import TorchEstimator, TorchModel
from store import Store


def test_defaults_and_generated_accessors():
    est = TorchEstimator()
    assert est.getBatchSize() == 32 and est.getEpochs() == 1 and est.getShuffle() is True
    assert est.getNumProc() is None and est.getMetrics() == []
    assert est.setBatchSize(7) is est and est.getBatchSize() == 7
    assert TorchModel().getPredictionCol() == "prediction"


def test_constructor_only_records():
    model = nn.Linear(2, 1)
    est = TorchEstimator(model=model, batch_size=0)  # invalid, but nothing is checked yet
    assert est.getModel() is model and est.getBatchSize() == 0


def test_signature_lists_every_param():
    params = inspect.signature(TorchEstimator.__init__).parameters
    for name in ("num_proc", "store", "model", "optimizer", "loss", "loss_weights", "metrics", "feature_cols",
                 "label_cols", "input_shapes", "label_shapes", "sample_weight_col", "validation", "batch_size",
                 "val_batch_size", "epochs", "train_steps_per_epoch", "validation_steps_per_epoch", "shuffle",
                 "random_seed", "run_id", "use_gpu", "verbose"):
        assert name in params
        assert est_has_param(name)


def test_help_lists_every_param_with_its_default_and_what_it_allows():
    import pydoc

    from estimator.core.param_table import ESTIMATOR_PARAMS, MODEL_PARAMS

    for cls, specs in ((TorchEstimator, ESTIMATOR_PARAMS), (TorchModel, MODEL_PARAMS)):
        shown = pydoc.render_doc(cls, renderer=pydoc.plaintext)
        for spec in specs:
            assert f"{spec.name}: " in shown, (cls.__name__, spec.name)
        flat = " ".join(cls.__doc__.split())
        assert all(" ".join(spec.allowed.split()) in flat for spec in specs)
    assert "    batch_size: 32\n" in TorchEstimator.__doc__ and "    model: required\n" in TorchEstimator.__doc__
    assert TorchEstimator.__doc__.startswith("Distributed PyTorch training as a Spark ML Estimator")


def est_has_param(name):
    return TorchEstimator().hasParam(name)


def test_unknown_param_suggests_the_close_one():
    with pytest.raises(TypeError, match="unexpected parameter 'batchsize'. Did you mean 'batch_size'"):
        TorchEstimator(batchsize=3)


def test_horovods_train_minibatch_fn_is_told_what_does_its_work_here():
    """Not 'Did you mean train_fn?' (a whole loop): what a Horovod user used it for, by param."""
    with pytest.raises(TypeError, match=r"no parameter 'train_minibatch_fn': Horovod's per-batch .*"
                                        r"backward_passes_per_step.*gradient_compression.*terminate_on_nan.*train_step"):
        TorchEstimator(train_minibatch_fn=lambda: None)


def _valid(**overrides):
    model = nn.Linear(4, 2)
    kwargs = dict(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss=nn.MSELoss(),
                  feature_cols=["x"], label_cols=["y"])
    kwargs.update(overrides)
    return TorchEstimator(**kwargs)


@pytest.mark.parametrize("name, value, allowed", [
    ("batch_size", 0, "an int >= 1"),
    ("epochs", -1, "an int >= 1"),
    ("batch_size", True, "an int >= 1"),
    ("validation", 1.0, "a float in [0, 1), a column name, or None"),
    ("validation", -0.1, "a float in [0, 1), a column name, or None"),
    ("run_id", "../escape", "a name without"),
    ("run_id", "a/b", "a name without"),
    ("feature_cols", [], "a non-empty list of distinct column names"),
    ("feature_cols", ["a", "a"], "a non-empty list of distinct column names"),
    ("input_shapes", [[-1, -1, 3]], "a list of shapes"),
    ("model", "not a module", "a torch.nn.Module"),
    ("store", "/tmp/path", "a store.Store"),
    ("verbose", 3, "0, 1 or 2"),
    ("gradient_checkpointing", "all", "True, False or 'selective'"),
])
def test_validation_message_names_param_value_and_what_is_allowed(name, value, allowed):
    with pytest.raises(ValueError) as info:
        _valid(**{name: value}).validated()
    message = str(info.value)
    assert message.startswith(f"The {name!r} parameter of TorchEstimator must be")
    assert allowed in message and f"Got {value!r} instead." in message


def test_exact_message_form():
    with pytest.raises(ValueError) as info:
        _valid(batch_size=0).validated()
    assert str(info.value) == "The 'batch_size' parameter of TorchEstimator must be an int >= 1. Got 0 instead."


def test_copy_keeps_values_and_extra_overrides():
    est = _valid(epochs=3)
    other = est.copy({est.epochs: 5})
    assert other.getEpochs() == 5 and est.getEpochs() == 3
    assert other.getModel() is est.getModel()


def test_store_param_accepts_store():
    assert _valid(store=Store.create("memory://x")).validated()["store"].prefix == "memory://x"


def test_params_the_reader_does_not_use_are_named_with_why():
    import torch
    from torch import nn

    from estimator import TorchEstimator
    from estimator.fit.checks import ignored_params

    def ignored(**kw):
        model = nn.Linear(2, 2)
        est = TorchEstimator(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             loss=nn.CrossEntropyLoss(), feature_cols=["x"], label_cols=["y"], **kw)
        return [name for name, _ in ignored_params(est.validated())]

    assert ignored() == []
    assert ignored(reader_pool_type="process") == ["reader_pool_type"]  # processes only run transformation_fn
    assert ignored(reader_pool_type="process", transformation_fn=lambda df: df, mp_start_method="spawn") == []
    assert ignored(mp_start_method="spawn") == ["mp_start_method"]
    assert ignored(reader="petastorm", shuffle_buffer_size=10) == ["shuffle_buffer_size"]


def test_what_the_ranks_get_is_named_and_defaulted_as_the_params_are():
    """TrainSpec and ReaderSpec are filled from the params by name (ReaderSpec: READER_PARAMS renames four); a
    field named as a param defaults to the param's default, so a spec built without the estimator (tests,
    LocalLauncher) trains as a fit with default params does."""
    import dataclasses

    from estimator.core.param_table import ESTIMATOR_PARAMS
    from estimator.core.spec import READER_PARAMS, ReaderSpec, TrainSpec

    defaults = {spec.name: spec.default for spec in ESTIMATOR_PARAMS}
    named = {f.name: f for f in dataclasses.fields(TrainSpec) if f.name in defaults}
    named.update({READER_PARAMS.get(f.name, f.name): f for f in dataclasses.fields(ReaderSpec)
                  if READER_PARAMS.get(f.name, f.name) in defaults})
    assert len(named) >= 25 and set(READER_PARAMS.values()) <= set(named)
    derived = {"rendezvous_timeout", "collective_timeout", "val_batch_size", "monitor",  # made from params
               "gradient_clip_val"}  # 'auto': the objective's (estimator.fit.checks.gradient_clip)
    for name, f in named.items():
        if f.default is dataclasses.MISSING or name in derived:
            continue
        assert f.default == defaults[name], f"{name}: the spec defaults to {f.default!r}, the param to {defaults[name]!r}"
    p = dict(defaults, reader="petastorm", train_reader_num_workers=3, reader_pool_type="process")
    assert ReaderSpec.from_params(p, 512.0) == ReaderSpec("petastorm", 3, None, "process", None, None, None, 512.0)


def test_numbers_are_converted_when_set_as_pyspark_does():
    """numpy's numbers (a ParamGridBuilder over np.logspace) become Python's when set, whatever sets them: the
    constructor, a setter, copy(extra); an int param takes a whole float; a number param refuses a string at once."""
    import numpy as np

    est = TorchEstimator(lr=np.float64(0.01), batch_size=np.int64(8), epochs=5.0, loss_weights=np.array([0.5, 0.5]))
    assert type(est.getLr()) is float and est.getLr() == 0.01
    assert type(est.getBatchSize()) is int and est.getBatchSize() == 8 and type(est.getEpochs()) is int
    assert est.getLossWeights() == [0.5, 0.5] and type(est.getLossWeights()[0]) is float
    grid_value = np.logspace(-3, -1, 3)[1]
    copied = est.copy({est.lr: grid_value})
    assert type(copied.getLr()) is float and copied.getLr() == pytest.approx(0.01)
    assert type(est.setMinDelta(np.float32(0.5)).getMinDelta()) is float
    with pytest.raises(TypeError, match=r"The 'batch_size' parameter of TorchEstimator must be an int >= 1. Got 'x'"):
        TorchEstimator(batch_size="x")
    with pytest.raises(TypeError, match=r"The 'lr' parameter of TorchEstimator must be a number > 0 or None"):
        est.setLr("0.1")
    assert TorchEstimator(batch_size=5.5).getBatchSize() == 5.5  # not whole: refused at fit, by the range check
    with pytest.raises(ValueError, match="must be an int >= 1. Got 5.5 instead"):
        _valid(batch_size=5.5).validated()


def test_a_loss_class_and_a_list_of_optimizers_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"Got <class '.*CrossEntropyLoss'> instead. CrossEntropyLoss is a class: "
                                         r"pass an instance, CrossEntropyLoss\(\)"):
        _valid(loss=nn.CrossEntropyLoss).validated()
    with pytest.raises(ValueError, match=r"Got \[CrossEntropyLoss\(\), <class"):
        _valid(loss=[nn.CrossEntropyLoss(), nn.MSELoss]).validated()
    _valid(loss=None, loss_constructors=[nn.MSELoss]).validated()  # a class builds a loss: a constructor
    model = nn.Linear(4, 2)
    two = [torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.Adam(model.parameters())]
    with pytest.raises(ValueError, match=r"write your own loop with train_fn and keep each extra optimizer with "
                                         r"ctx.keep\(name, optimizer\)"):
        _valid(model=model, optimizer=two).validated()


def test_fit_of_a_pandas_frame_says_how_to_make_a_spark_one():
    import pandas as pd

    with pytest.raises(TypeError, match=r"TorchEstimator.fit takes a Spark DataFrame; got a "
                                        r"pandas.core.frame.DataFrame: spark.createDataFrame\(pdf\)"):
        _valid().fit(pd.DataFrame({"x": [1.0], "y": [0.0]}))


def test_label_cols_are_optional_only_for_loops_that_compute_their_own_loss():
    with pytest.raises(ValueError, match=r"The 'label_cols' parameter of TorchEstimator must be a non-empty list of "
                                         r"distinct column names with the built-in loop \(loss=...\)"):
        _valid(label_cols=None)._checked()
    assert _valid(label_cols=None, loss=None, train_step=lambda model, batch, ctx: model(batch.features[0]).sum()
                  )._checked()[0]["label_cols"] == []
