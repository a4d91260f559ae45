"""TorchEstimator inside pyspark.ml.tuning.CrossValidator."""
import numpy as np
import pytest
import torch
from pyspark.ml.evaluation import MulticlassClassificationEvaluator
from pyspark.ml.tuning import CrossValidator, ParamGridBuilder
from torch import nn

from estimator import TorchEstimator, TorchModel
from helpers import MLP, seeded
from spark_helpers import digits_frame

pytestmark = [pytest.mark.spark, pytest.mark.connect]


def test_cross_validator_picks_the_better_learning_setup(spark, store, digits):
    """With numpy values where people put them (an optimizer's lr, the grid's np.logspace and np.array): the
    checkpoints hold Python numbers, which the driver reads back with weights_only=True."""
    df = digits_frame(spark, digits).limit(800).cache()
    model = seeded(MLP)
    est = TorchEstimator(num_proc=2, store=store, model=model, optimizer=torch.optim.Adam(model.parameters(), lr=np.float64(0.01)),
                         loss=nn.CrossEntropyLoss(), feature_cols=["features"], label_cols=["label"], batch_size=32,
                         random_seed=3, verbose=0)
    grid = ParamGridBuilder().addGrid(est.epochs, np.array([1, 6])).addGrid(est.lr, np.logspace(-5, -2, 2)).build()
    evaluator = MulticlassClassificationEvaluator(labelCol="label", metricName="accuracy")
    cv = CrossValidator(estimator=est, estimatorParamMaps=grid, evaluator=evaluator, numFolds=2, seed=1)
    best = cv.fit(df)
    assert isinstance(best.bestModel, TorchModel)
    assert len(best.bestModel.getHistory()) == 6  # the 6-epoch setting won...
    assert best.bestModel.getEpochs() == 6 and best.bestModel.getLr() == pytest.approx(0.01)  # ...the lr that learns
    assert best.bestModel.getBatchSize() == 32  # the training batch size, as the estimator had it
    assert best.bestModel.getInferenceBatchSize() >= 256
    assert best.bestModel.getOptimizer().param_groups[0]["lr"] == pytest.approx(0.01)
    assert max(best.avgMetrics) == best.avgMetrics[3] and best.avgMetrics[2] < best.avgMetrics[3] - 0.2
