"""The transform after a fit runs in the fit's Python workers (torch already imported), not in new
ones: `python worker_reuse_job.py STORE`. A fresh local[2] session; prints one JSON line."""
import json
import sys
import time

import pandas as pd
import torch
from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from sklearn.datasets import load_digits
from torch import nn

from estimator import TorchEstimator
from store import Store

spark = (SparkSession.builder.master("local[2]").appName("worker-reuse")
         .config("spark.ui.showConsoleProgress", "false").getOrCreate())
digits = load_digits()
rows = [((x / 16.0).astype("float32").tolist(), int(y)) for x, y in zip(digits.data[:400], digits.target[:400])]
df = spark.createDataFrame(rows, "features array<float>, label long").repartition(2).cache()
df.count()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))
fitted = TorchEstimator(num_proc=2, store=Store.create(sys.argv[1]), model=model,
                        optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss=nn.CrossEntropyLoss(),
                        feature_cols=["features"], label_cols=["label"], epochs=1).fit(df)


def probe(labels: pd.Series) -> pd.Series:  # what the Python worker running this batch had imported
    import os
    import sys as _sys
    return pd.Series([f"{os.getpid()} {'estimator.launch.spark' in _sys.modules}"] * len(labels))


started = time.perf_counter()
predicted = fitted.transform(df).withColumn("worker", F.pandas_udf(probe, "string")("label"))
workers = sorted({r["worker"] for r in predicted.select("worker").collect()})
print(json.dumps({"workers": workers, "transform_s": time.perf_counter() - started}))
spark.stop()
