"""A Spark fit and transform with use_gpu=True on a host with a CUDA GPU: `python spark_gpu_job.py
DISCOVERY_SCRIPT STORE` (tests/gpu/test_cuda.py). Prints one JSON line."""
import json
import logging
import sys

import torch
from pyspark.ml.evaluation import MulticlassClassificationEvaluator
from pyspark.sql import SparkSession
from sklearn.datasets import load_digits
from torch import nn

from estimator import TorchEstimator
from store import Store

script, store_path = sys.argv[1], sys.argv[2]
spark = (SparkSession.builder.master("local-cluster[1,1,2048]").appName("gpu-fit")
         .config("spark.worker.resource.gpu.amount", "1").config("spark.worker.resource.gpu.discoveryScript", script)
         .config("spark.executor.resource.gpu.amount", "1").config("spark.task.resource.gpu.amount", "1")
         .config("spark.ui.showConsoleProgress", "false").getOrCreate())
records = []
logging.basicConfig(level=logging.INFO)
logging.getLogger("estimator").addHandler(type("Keep", (logging.Handler,), {
    "emit": lambda self, r: records.append(r.getMessage())})())
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
                  "allreduce": "nccl" if "averaged by nccl" in trained[0] else trained[0], "accuracy": accuracy}))
spark.stop()
