"""Executors whose Python holds exactly what the README's 'On a cluster' lists (torch, numpy, pyarrow, pandas,
with what pip installs for them) and nothing of this project: a standalone cluster of two one-core workers, their
PYSPARK_PYTHON that bare venv. A fit and a transform work; a model whose code needs a package the executors lack
fails once (not retried), naming the module, the executor and its Python. Prints one JSON line.

    PYSPARK_PYTHON=<bare venv>/bin/python python tests/seeds/bare_executor_job.py <folder>
"""
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), HERE]
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
    import numpy as np
    import torch
    from pyspark.sql import SparkSession
    from sklearn.datasets import load_digits

    from estimator import TorchEstimator
    from estimator.cluster import LocalStandaloneCluster
    from estimator.failures import RankFailed
    from store import Store

    report = {}
    os.makedirs(os.path.join(folder, "cluster"), exist_ok=True)
    with LocalStandaloneCluster(workers=2, cores=1, memory="2g", base_dir=os.path.join(folder, "cluster")) as cluster:
        spark = (SparkSession.builder.master(cluster.master_url).appName("bare-executors")
                 .config("spark.executor.memory", "1g").config("spark.ui.showConsoleProgress", "false")
                 .config("spark.task.maxFailures", "3").getOrCreate())
        cluster.wait_for_executors(spark)
        report["executor_python"] = spark.range(1).rdd.map(lambda _: sys.executable).collect()[0] \
            if hasattr(spark, "sparkContext") else None
        digits = load_digits()
        rows = [((x / 16.0).astype(np.float32).tolist(), int(t)) for x, t in zip(digits.data, digits.target)]
        df = spark.createDataFrame(rows, "features array<float>, label long").repartition(2).cache()
        store = Store.create(os.path.join(folder, "store"))

        def estimator(model, **kw):
            return TorchEstimator(num_proc=2, store=store, model=model,
                                  optimizer=torch.optim.Adam(model.parameters(), lr=0.01), loss=nn.CrossEntropyLoss(),
                                  metrics=["accuracy"], feature_cols=["features"], label_cols=["label"],
                                  batch_size=64, epochs=3, validation=0.2, random_seed=1, verbose=0, **kw)

        torch.manual_seed(0)
        plain = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        model = estimator(plain).fit(df)
        report["val_accuracy"] = model.getHistory()[-1]["val_accuracy"]
        predicted = model.transform(df).select("label", "prediction").collect()
        report["transform_accuracy"] = float(np.mean([r["label"] == r["prediction"] for r in predicted]))
        started = time.monotonic()
        try:
            estimator(NeedsSklearn(), max_retries=2).fit(df)
            report["failure"] = None
        except RankFailed as exc:
            report["failure"] = {"kind": exc.kind.value, "summary": exc.summary, "lines": len(str(exc).splitlines())}
        report["failure_s"] = time.monotonic() - started
        spark.stop()
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
