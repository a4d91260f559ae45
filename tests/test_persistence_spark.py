"""Save/load of TorchModel and TorchEstimator, alone and inside Pipeline/PipelineModel."""
import numpy as np
import pytest
import torch
from pyspark.ml import Pipeline, PipelineModel
from pyspark.ml.evaluation import MulticlassClassificationEvaluator
from pyspark.ml.feature import VectorAssembler
from torch import nn

from estimator import TorchEstimator, TorchModel
from helpers import MLP, seeded
from spark_helpers import digits_frame

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def pixel_frame(spark, digits):
    """64 scalar pixel columns, as a user would have before a VectorAssembler."""
    X, y = digits
    rows = [tuple(float(v) for v in x) + (int(t),) for x, t in zip(X[:900], y[:900])]
    return spark.createDataFrame(rows, [f"p{i}" for i in range(64)] + ["label"]).repartition(2).cache()


def _est(store, **kw):
    model = seeded(MLP)
    params = dict(num_proc=2, store=store, model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
                  loss=nn.CrossEntropyLoss(), metrics=["accuracy"], feature_cols=["features"], label_cols=["label"],
                  batch_size=32, epochs=3, validation=0.1, random_seed=5)
    params.update(kw)
    return TorchEstimator(**params)


def test_model_save_load_gives_identical_predictions(spark, store, digits, tmp_path):
    df = digits_frame(spark, digits)
    fitted = _est(store).fit(df)
    path = str(tmp_path / "model")
    fitted.write().overwrite().save(path)
    fitted.write().overwrite().save(path)  # overwrite an existing save
    loaded = TorchModel.load(path)
    assert loaded.uid == fitted.uid and loaded.getRunId() == fitted.getRunId()
    assert loaded.getHistory() == fitted.getHistory()
    assert loaded.getOutputShapes() == fitted.getOutputShapes()
    np.testing.assert_allclose(_scores(loaded, df), _scores(fitted, df), rtol=1e-6)
    with pytest.raises(Exception, match="already exists"):
        fitted.save(path)  # no silent overwrite of what the user had


def _scores(model, df):
    return np.array([r[0] for r in model.transform(df).orderBy("features").select("label__output").collect()])


@pytest.mark.connect
def test_pipeline_with_vector_assembler_fits_saves_and_loads(spark, store, pixel_frame, tmp_path):
    assembler = VectorAssembler(inputCols=[f"p{i}" for i in range(64)], outputCol="features")
    pipeline = Pipeline(stages=[assembler, _est(store, epochs=5)])
    fitted = pipeline.fit(pixel_frame)
    predictions = fitted.transform(pixel_frame)
    accuracy = MulticlassClassificationEvaluator(labelCol="label", metricName="accuracy").evaluate(predictions)
    assert accuracy > 0.8
    path = str(tmp_path / "pipeline")
    fitted.write().overwrite().save(path)
    reloaded = PipelineModel.load(path)
    assert isinstance(reloaded.stages[-1], TorchModel)
    again = MulticlassClassificationEvaluator(labelCol="label", metricName="accuracy").evaluate(
        reloaded.transform(pixel_frame))
    assert again == pytest.approx(accuracy)
    # the unfitted pipeline (with the estimator) saves and loads too
    pipeline.write().overwrite().save(str(tmp_path / "unfitted"))
    stages = Pipeline.load(str(tmp_path / "unfitted")).getStages()
    assert isinstance(stages[-1], TorchEstimator) and stages[-1].getEpochs() == 5


@pytest.mark.connect
def test_estimator_save_load_keeps_params_and_objects_without_credentials(spark, tmp_path):
    from store import Store

    store = Store.create(str(tmp_path / "s"), storage_options={"sas_token": "SECRET-TOKEN"})
    est = _est(store, epochs=4, input_shapes=[[-1, 64]])
    path = str(tmp_path / "est")
    est.save(path)
    loaded = TorchEstimator.load(path)
    assert loaded.getEpochs() == 4 and loaded.getInputShapes() == [[-1, 64]]
    assert loaded.getFeatureCols() == ["features"] and loaded.getMetrics() == ["accuracy"]
    assert isinstance(loaded.getOptimizer(), torch.optim.Adam)
    for key, value in est.getModel().state_dict().items():
        assert torch.equal(loaded.getModel().state_dict()[key], value)
    assert loaded.getStore().prefix == store.prefix and loaded.getStore().storage_options == {}
    for file in (tmp_path / "est").rglob("*"):
        if file.is_file():
            assert b"SECRET-TOKEN" not in file.read_bytes(), file
