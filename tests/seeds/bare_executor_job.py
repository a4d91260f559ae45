"""Executors whose Python holds exactly what the README's 'On a cluster' lists (torch, numpy, pyarrow, pandas,
with what pip installs for them) and nothing of this project: a standalone cluster of two one-core workers, their
PYSPARK_PYTHON that bare venv. The README's example (notebooks/digits_example.py, as its --cluster flag runs it:
num_proc from the cluster's task slots) fits, transforms and evaluates there, the project shipped by the driver;
then a model whose code needs a package the executors lack fails once (not retried), naming the module, the
executor and its Python. Prints the example's lines, then one JSON line.

    PYSPARK_PYTHON=<bare venv>/bin/python python tests/seeds/bare_executor_job.py <folder>
"""
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT, HERE, os.path.join(ROOT, "notebooks")]
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

import sklearn  # noqa: E402 - on the driver only: NeedsSklearn's forward names it
from torch import nn  # noqa: E402


class NeedsSklearn(nn.Module):  # pickled by value (this file is __main__): its forward's globals name sklearn
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(64, 10)

    def forward(self, x):
        return self.net(x) if sklearn.__name__ else x


def main(folder):
    import argparse

    import numpy as np
    import torch
    from pyspark.sql import SparkSession
    from sklearn.datasets import load_digits

    import digits_example
    from estimator import TorchEstimator
    from estimator.cluster import LocalStandaloneCluster
    from estimator.failures import RankFailed
    from store import Store

    report = {}
    os.makedirs(os.path.join(folder, "cluster"), exist_ok=True)
    with LocalStandaloneCluster(workers=2, cores=1, memory="2g", base_dir=os.path.join(folder, "cluster")) as cluster:
        # the example as `digits_example.py --cluster --epochs 5` runs it, on this cluster (it stops its session)
        example = argparse.Namespace(epochs=5, store=os.path.join(folder, "example-runs"))
        report["example_accuracy"] = digits_example.train(example, cluster.master_url, cluster)
        spark = (SparkSession.builder.master(cluster.master_url).appName("bare-executors")
                 .config("spark.executor.memory", "1g").config("spark.ui.showConsoleProgress", "false")
                 .config("spark.task.maxFailures", "3").getOrCreate())
        cluster.wait_for_executors(spark)
        report["executor_python"] = spark.range(1).rdd.map(lambda _: sys.executable).collect()[0]
        digits = load_digits()
        rows = [((x / 16.0).astype(np.float32).tolist(), int(t)) for x, t in zip(digits.data, digits.target)]
        df = spark.createDataFrame(rows, "features array<float>, label long").repartition(2)
        model = NeedsSklearn()
        estimator = TorchEstimator(num_proc=2, store=Store.create(os.path.join(folder, "store")), model=model,
                                   optimizer=torch.optim.Adam(model.parameters(), lr=0.01), loss=nn.CrossEntropyLoss(),
                                   feature_cols=["features"], label_cols=["label"], batch_size=64, epochs=3,
                                   random_seed=1, verbose=0, max_retries=2)
        started = time.monotonic()
        try:
            estimator.fit(df)
            report["failure"] = None
        except RankFailed as exc:
            report["failure"] = {"kind": exc.kind.value, "summary": exc.summary, "lines": len(str(exc).splitlines())}
        report["failure_s"] = time.monotonic() - started
        spark.stop()
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
