"""A model built by a factory, with the package as installed (run by .ci/check-wheel from a folder outside the
checkout): fit from functools.partial recipes, the model built on the meta device with its weights read from a
safetensors folder (weights_folder), sharded over the ranks (strategy='fsdp': the checkpoints are Distributed
Checkpoint folders), save (the weights as safetensors: the wheel's dependencies must hold what that needs), load
in this process through the factory, and predict the same probabilities."""
import functools
import os
import sys

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from pyspark.sql import SparkSession  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from torch import nn  # noqa: E402

from safetensors.torch import save_model  # noqa: E402

from estimator import TorchEstimator, TorchModel, parameters_on_meta  # noqa: E402
from store import Store  # noqa: E402


def mlp(hidden):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def mlp_on_meta(hidden):
    with parameters_on_meta():
        return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))


work = sys.argv[1]
os.makedirs(os.path.join(work, "weights"))
save_model(mlp(32), os.path.join(work, "weights", "model.safetensors"))
spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
         .config("spark.ui.showConsoleProgress", "false").getOrCreate())  # its bar would prefix the last line
digits = load_digits()
df = spark.createDataFrame([(i, (x / 16).tolist(), int(y)) for i, (x, y) in enumerate(zip(digits.data, digits.target))],
                           "id long, features array<float>, label long")
fitted = TorchEstimator(num_proc=2, store=Store.create(os.path.join(work, "runs")), model=functools.partial(mlp_on_meta, 32),
                        optimizer=functools.partial(torch.optim.AdamW, lr=0.01), loss=nn.CrossEntropyLoss(),
                        feature_cols=["features"], label_cols=["label"], batch_size=64, epochs=2,
                        strategy="fsdp", weights_folder=os.path.join(work, "weights")).fit(df)
fitted.save(os.path.join(work, "model"))
assert "model.safetensors" in os.listdir(os.path.join(work, "model")), os.listdir(os.path.join(work, "model"))
sample = df.orderBy("id").limit(50)
probabilities = [np.array([r.probability.toArray() for r in m.transform(sample).orderBy("id").collect()])
                 for m in (fitted, TorchModel.load(os.path.join(work, "model")))]
np.testing.assert_allclose(probabilities[0], probabilities[1], atol=1e-6)
spark.stop()
print("check-wheel: a model built by a factory on the meta device, its weights read from a folder, trained sharded "
      "(fsdp), saved as safetensors, loaded, and predicted the same")
