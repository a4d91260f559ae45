"""A user's job against a standalone cluster: `python cluster_job.py spark://127.0.0.1:PORT STORE`.
Waits for both executors, fits with the default num_proc (the cluster's task slots), evaluates."""
import sys
import time

import numpy as np
import torch
from pyspark.ml.evaluation import MulticlassClassificationEvaluator
from pyspark.sql import SparkSession
from sklearn.datasets import load_digits
from torch import nn

from estimator import TorchEstimator
from store import Store

master, store_path = sys.argv[1], sys.argv[2]
spark = (SparkSession.builder.master(master).appName("cluster-job").config("spark.executor.memory", "1g")
         .config("spark.ui.showConsoleProgress", "false").getOrCreate())
deadline = time.time() + 120
while spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size() < 3:  # the driver and two executors
    if time.time() > deadline:
        raise SystemExit("executors did not register within 120 s")
    time.sleep(0.5)
print("executors registered:", spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size() - 1)
digits = load_digits()
rows = [((x / 16.0).astype(np.float32).tolist(), int(y)) for x, y in zip(digits.data, digits.target)]
df = spark.createDataFrame(rows, "features array<float>, label long").repartition(2)
train, test = df.randomSplit([0.8, 0.2], seed=3)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
est = TorchEstimator(store=Store.create(store_path), model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
                     loss=nn.CrossEntropyLoss(), metrics=["accuracy"], feature_cols=["features"], label_cols=["label"],
                     batch_size=32, epochs=5, validation=0.1, random_seed=1)
fitted = est.fit(train)
accuracy = MulticlassClassificationEvaluator(labelCol="label", metricName="accuracy").evaluate(fitted.transform(test))
print("ranks:", spark.sparkContext.defaultParallelism)
print(f"Test accuracy: {accuracy:.4f}")
spark.stop()
