"""GPU assignment through Spark's resource scheduling, without a GPU (as pyspark's own TorchDistributor
tests do): `python gpu_assignment_job.py DISCOVERY_SCRIPT STORE`. A local-cluster executor with 2 cores
gets the GPU addresses the discovery script reports; each barrier task is given one. Prints one JSON line
per check."""
import json
import sys

import pandas as pd
import torch
from pyspark.sql import functions as F
from sklearn.datasets import load_digits
from torch import nn

from estimator import TorchEstimator
from estimator.failures import RankFailed
from store import Store

from gpu_jobs import gpu_session, kept_log_lines  # noqa: E402 - beside this script

script, store_path = sys.argv[1], sys.argv[2]
spark = gpu_session("gpu-assignment", script, executor_gpus=2, task_gpus=1)
records = kept_log_lines()

digits = load_digits()
rows = [((x / 16.0).astype("float32").tolist(), int(y)) for x, y in zip(digits.data[:400], digits.target[:400])]
df = spark.createDataFrame(rows, "features array<float>, label long").repartition(2)


def estimator(**kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))
    return TorchEstimator(num_proc=2, store=Store.create(store_path), model=model,
                          optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss=nn.CrossEntropyLoss(),
                          feature_cols=["features"], label_cols=["label"], epochs=1, **kw)


estimator().fit(df)  # use_gpu=None: no CUDA here, so CPU, but each rank reports the GPU Spark gave it
print(json.dumps({"assigned": sorted(r for r in records if "Spark assigned GPU" in r)}))
try:
    estimator(use_gpu=True).fit(df)
    print(json.dumps({"use_gpu_true": "no error"}))
except RankFailed as exc:
    print(json.dumps({"use_gpu_true": str(exc)}))


def inference_gpu(ids: pd.Series) -> pd.Series:  # the GPU a transform task would run its forward passes on
    from estimator.predict.inference import task_gpu
    return pd.Series([str(task_gpu())] * len(ids))


udf = F.pandas_udf(inference_gpu, "string")
print(json.dumps({"inference_gpus": sorted({r[0] for r in spark.range(0, 8, numPartitions=2).select(udf("id"))
                                             .collect()})}))
spark.stop()
