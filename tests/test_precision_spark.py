"""Mixed precision in a real fit: bf16 autocast on CPU ranks still learns digits."""
import pytest
import torch
from pyspark.ml.evaluation import MulticlassClassificationEvaluator
from torch import nn

from estimator import TorchEstimator
from helpers import MLP, seeded
from spark_helpers import digits_frame

pytestmark = pytest.mark.spark


def test_bf16_mixed_on_cpu_trains_digits_to_90_percent(spark, store, digits):
    df = digits_frame(spark, digits)
    train, test = df.randomSplit([0.8, 0.2], seed=5)
    model = seeded(MLP)
    fitted = TorchEstimator(num_proc=2, store=store, model=model, optimizer=torch.optim.Adam(model.parameters(),
                            lr=0.01), loss=nn.CrossEntropyLoss(), metrics=["accuracy"], feature_cols=["features"],
                            label_cols=["label"], batch_size=64, epochs=8, precision="bf16-mixed",
                            gradient_clip_val=5.0, random_seed=2).fit(train)
    accuracy = MulticlassClassificationEvaluator(labelCol="label", metricName="accuracy").evaluate(
        fitted.transform(test))
    assert accuracy >= 0.90
    assert fitted.getPrecision() == "bf16-mixed"  # readable on the model, as the other training params


def test_16_mixed_with_use_gpu_false_is_refused_before_any_job(spark, store, digits):
    model = seeded(MLP)
    with pytest.raises(ValueError, match="precision='16-mixed' and use_gpu=False"):
        TorchEstimator(num_proc=2, store=store, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                       loss=nn.CrossEntropyLoss(), feature_cols=["features"], label_cols=["label"], use_gpu=False,
                       precision="16-mixed").fit(digits_frame(spark, digits))
