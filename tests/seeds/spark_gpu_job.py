"""A Spark fit and transform with use_gpu=True on a host with a CUDA GPU: `python spark_gpu_job.py
DISCOVERY_SCRIPT STORE` (tests/gpu/test_cuda.py). Prints one JSON line."""
import json
import sys

import torch
from pyspark.ml.evaluation import MulticlassClassificationEvaluator
from sklearn.datasets import load_digits
from torch import nn

from estimator import TorchEstimator
from store import Store

from gpu_jobs import gpu_session, kept_log_lines  # noqa: E402 - beside this script

script, store_path = sys.argv[1], sys.argv[2]
spark = gpu_session("gpu-fit", script, executor_gpus=1, task_gpus=1, cores=1, memory_mb=2048)
records = kept_log_lines()
digits = load_digits()
rows = [((x / 16.0).astype("float32").tolist(), int(y)) for x, y in zip(digits.data, digits.target)]
df = spark.createDataFrame(rows, "features array<float>, label long")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
fitted = TorchEstimator(num_proc=1, store=Store.create(store_path), model=model, use_gpu=True,
                        optimizer=torch.optim.Adam(model.parameters(), lr=0.01), loss=nn.CrossEntropyLoss(),
                        feature_cols=["features"], label_cols=["label"], epochs=6, batch_size=32).fit(df)
accuracy = MulticlassClassificationEvaluator(labelCol="label", metricName="accuracy").evaluate(fitted.transform(df))
trained = [r for r in records if r.startswith("Trained run")]
print(json.dumps({"device": "cuda:0" if "(cuda:0," in trained[0] else trained[0],
                  "allreduce": "nothing" if "one rank, nothing averaged" in trained[0] else trained[0],
                  "accuracy": accuracy}))
spark.stop()
