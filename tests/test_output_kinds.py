"""Adding an output kind of transform is one predictor class and one line in the registry (CONTRIBUTING.md
'Adding an output kind'). The kind here, 'norm', adds one double column: the length (L2 norm) of each row's first
output. Registered with one line, it transforms a real Spark DataFrame as a plain torch forward says."""
import sys
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pytest
import torch
from pyspark.sql.types import DoubleType, StructField, StructType

from estimator import TorchModel
from estimator.predict.inference import model_inputs, predict_numpy
from estimator.predict.kinds import PREDICTORS
from estimator.predict.predictor import Added, Predictor
from helpers import MLP, seeded

@dataclass(frozen=True, kw_only=True)
class Norm(Predictor):
    """output_kind 'norm': `<output>_norm`, the L2 norm of each row's first output (the forward's numbers)."""

    @classmethod
    def build(cls, p, outputs, torch_threads=None):
        return cls(feature_cols=tuple(p["feature_cols"]), batch_size=p["inference_batch_size"], use_gpu=p["use_gpu"],
                   torch_threads=torch_threads, added=(Added(f"{outputs[0]}_norm", "_norm"),))

    def arrow_type(self):
        return pa.struct([pa.field("_norm", pa.float64())])

    def predict(self, model, columns, device):
        outputs = predict_numpy(model, model_inputs(columns, self.feature_cols), self.batch_size, device)
        return [pa.array(np.linalg.norm(outputs[0], axis=1), pa.float64())] if outputs else []


@pytest.fixture
def norm_kind(monkeypatch):
    """The registry line. Spark's Python workers cannot import this test module (tests/ is on the driver's sys.path
    only): transform sends the predictor with its driver-only modules by value (estimator.core.pickling.dumps), as
    a fit sends a model, so a kind defined in a notebook or a driver's own file works as one in
    estimator/predict/kinds/ (which every executor has)."""
    from pyspark import cloudpickle

    monkeypatch.setitem(PREDICTORS, "norm", Norm)
    assert sys.modules[__name__].__name__ not in cloudpickle.cloudpickle._PICKLE_BY_VALUE_MODULES
    yield


@pytest.mark.spark
@pytest.mark.connect
def test_a_new_output_kind_is_a_predictor_class_and_a_registry_line(spark, digits, norm_kind):
    X = digits[0][:40]
    df = spark.createDataFrame([(i, x.tolist()) for i, x in enumerate(X)], "id long, features array<float>")
    model = seeded(MLP).eval()
    norms = TorchModel(model=model, feature_cols=["features"], label_cols=["label"], output_shapes=[[10]],
                       output_kind="norm", inference_batch_size=16)
    assert norms.output_schema() == StructType([StructField("label__output_norm", DoubleType(), False)])
    out = norms.transform(df)
    assert out.columns == ["id", "features", "label__output_norm"]
    got = [r["label__output_norm"] for r in sorted(out.collect(), key=lambda r: r["id"])]
    with torch.no_grad():
        expected = model(torch.from_numpy(X)).norm(dim=1).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_the_registry_names_the_output_kinds_an_unknown_one_is_refused_with(monkeypatch):
    model = TorchModel(model=seeded(MLP), feature_cols=["features"], output_shapes=[[10]], output_kind="nrom")
    with pytest.raises(ValueError, match=r"^The 'output_kind' parameter of TorchModel must be None, 'generate', "
                                         r"'embedding' or 'score'. Got 'nrom' instead.$"):
        model.output_schema()
    monkeypatch.setitem(PREDICTORS, "norm", Norm)
    with pytest.raises(ValueError, match=r"^The 'output_kind' parameter of TorchModel must be None, 'generate', "
                                         r"'embedding', 'score' or 'norm'. Got 'nrom' instead.$"):
        model.output_schema()
    with pytest.raises(ValueError, match=r"^The 'output_kind' parameter of TorchModel must be None, 'generate', "
                                         r"'embedding' or 'score'. Got \['norm'\] instead.$"):  # the param table: None or a str
        model.copy({model.output_kind: ["norm"]}).output_schema()
