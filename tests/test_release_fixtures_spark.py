"""What users saved with release 0.2.0 loads and predicts as it did (tests/fixtures/release_0_2_0, written once by
that release's code: see make.py there). A later release that moves or renames a class these files name (their
metadata names estimator.model.TorchModel and estimator.estimator.TorchEstimator; a saved estimator's objects.pkl
names estimator.compression and store.store) fails here."""
import json
import os
import shutil

import numpy as np
import pytest
import torch
from pyspark.ml import Pipeline, PipelineModel

from estimator import TorchEstimator, TorchModel

pytestmark = [pytest.mark.spark, pytest.mark.connect]
FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "release_0_2_0")


@pytest.fixture(scope="module")
def expected():
    with open(os.path.join(FIXTURES, "expected.json")) as handle:
        return json.load(handle)


@pytest.fixture
def saved(tmp_path):
    """A copy of the fixtures: loading must not write into the repository's files, and a copy shows it need not."""
    folder = tmp_path / "saved"
    shutil.copytree(FIXTURES, folder)
    return folder


def _pixels(spark, expected):
    names = [f"p{i}" for i in range(64)]
    return spark.createDataFrame([tuple(row) + (label,) for row, label in zip(expected["pixels"], expected["labels"])],
                                 names + ["label"])


def _assert_predicts_as_saved(frame, expected):
    rows = frame.collect()
    assert len(rows) == len(expected["labels"])
    np.testing.assert_allclose([list(r["label__output"]) for r in rows], expected["output"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose([list(r["probability"]) for r in rows], expected["probability"], rtol=1e-5,
                               atol=1e-6)
    assert [float(r["prediction"]) for r in rows] == expected["prediction"]


def test_a_pipeline_model_saved_by_0_2_0_loads_and_predicts_as_it_did(spark, saved, expected):
    loaded = PipelineModel.load(str(saved / "pipeline"))
    assert isinstance(loaded.stages[-1], TorchModel)
    assert loaded.stages[-1].getHistory() == expected["history"]
    _assert_predicts_as_saved(loaded.transform(_pixels(spark, expected)), expected)


def test_a_torch_model_saved_by_0_2_0_loads_and_predicts_as_it_did(spark, saved, expected):
    from pyspark.ml.feature import VectorAssembler

    model = TorchModel.load(str(saved / "model"))
    assert model.getRunId() == "release-0.2.0" and model.getFeatureColumns() == ["features"]
    assembled = VectorAssembler(inputCols=[f"p{i}" for i in range(64)], outputCol="features").transform(
        _pixels(spark, expected))
    _assert_predicts_as_saved(model.transform(assembled), expected)


def test_a_pipeline_holding_an_estimator_saved_by_0_2_0_loads_with_its_objects(spark, saved):
    from estimator.compression import Compression

    stages = Pipeline.load(str(saved / "unfitted")).getStages()
    est = stages[-1]
    assert isinstance(est, TorchEstimator)
    assert est.getEpochs() == 3 and est.getBatchSize() == 32 and est.getRunId() == "release-0.2.0"
    assert est.getOrDefault("gradient_compression") in ("fp16", Compression.fp16)
    assert est.getOrDefault("loss_weights") == [1.0]
    model = est.getModel()
    scheduler = est.getOrDefault("lr_scheduler_fn")(torch.optim.SGD(model.parameters(), lr=0.1))
    assert isinstance(scheduler, torch.optim.lr_scheduler.StepLR) and scheduler.step_size == 2


def test_a_checkpoint_written_by_0_2_0_loads_and_holds_the_saved_models_weights(saved, tmp_path):
    from estimator.train.checkpoint import load_checkpoint
    from store import Store

    store = Store.create(str(tmp_path / "store"))
    state = load_checkpoint(store, str(saved / "checkpoint.pt"))
    weights = torch.load(str(saved / "model" / "weights.pt"), weights_only=True)
    assert state["epoch"] == 3 and len(state["history"]) == 3
    assert state["model"].keys() == weights.keys()
    assert all(torch.equal(state["model"][k], weights[k]) for k in weights)
