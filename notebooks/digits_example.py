"""Train a small CNN on scikit-learn's digits with 2 Spark barrier tasks; print test accuracy.

    python notebooks/digits_example.py [--epochs 8] [--store /tmp/runs]
        [--cluster [--cluster-dir DIR]]   # a real standalone cluster on 127.0.0.1: master + 2 one-core workers
        [--master spark://host:7077]      # an existing cluster (then --store must be a path every executor sees)
        [--remote sc://host:15002]        # a Spark Connect server (Databricks: the workspace's Connect URL)
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # executors use this interpreter (and its torch)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from pyspark.ml.evaluation import MulticlassClassificationEvaluator  # noqa: E402
from pyspark.sql import SparkSession  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from torch import nn, optim  # noqa: E402

from estimator import TorchEstimator  # noqa: E402
from estimator.cluster import LocalStandaloneCluster  # noqa: E402
from store import Store  # noqa: E402


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                  nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 2 * 2, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x))


def digits_frames(spark: SparkSession, seed: int = 0):
    digits = load_digits()
    features = (digits.data / 16.0).astype(np.float32)  # pixel values 0..16 -> 0..1
    rows = [(f.tolist(), int(y)) for f, y in zip(features, digits.target)]
    df = spark.createDataFrame(rows, "features array<float>, label long").repartition(2)
    return df.randomSplit([0.8, 0.2], seed=seed)


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--store", default=os.path.join(tempfile.gettempdir(), "spark-torch-estimator-example"))
    parser.add_argument("--cluster", action="store_true", help="start a standalone cluster on 127.0.0.1 and use it")
    parser.add_argument("--cluster-dir", default=None, help="where the cluster's logs and work dirs go")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--remote", default=None, help="train through a Spark Connect session of this server URL")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("py4j").setLevel(logging.WARNING)
    if args.remote:
        return train(args, None, remote=args.remote)
    if not args.cluster:
        return train(args, args.master)
    if args.cluster_dir:
        os.makedirs(args.cluster_dir, exist_ok=True)
    with LocalStandaloneCluster(workers=2, cores=1, base_dir=args.cluster_dir) as cluster:
        return train(args, cluster.master_url, cluster)


def train(args: argparse.Namespace, master: str, cluster: LocalStandaloneCluster = None, remote: str = None) -> float:
    if remote:  # a Connect client: the server owns the master and its settings
        spark = SparkSession.builder.remote(remote).getOrCreate()
    else:
        spark = (SparkSession.builder.master(master).appName("digits").config("spark.executor.memory", "1g")
                 .getOrCreate())
        spark.sparkContext.setLogLevel("WARN")
    if cluster is not None:
        print("executors registered:", cluster.wait_for_executors(spark))
    train_df, test_df = digits_frames(spark)
    torch.manual_seed(0)
    model = Net()
    est = TorchEstimator(num_proc=None if cluster else 2, store=Store.create(args.store), model=model,
                         optimizer=optim.Adam(model.parameters(), lr=0.01), loss=nn.CrossEntropyLoss(),
                         metrics=["accuracy"], feature_cols=["features"], label_cols=["label"],
                         input_shapes=[[-1, 1, 8, 8]], batch_size=64, epochs=args.epochs, validation=0.1,
                         random_seed=0)
    fitted = est.fit(train_df)
    predictions = fitted.transform(test_df)
    accuracy = MulticlassClassificationEvaluator(labelCol="label", predictionCol="prediction",
                                                 metricName="accuracy").evaluate(predictions)
    for row in fitted.getHistory():
        print("epoch {epoch:.0f}: loss {loss:.4f} val_loss {val_loss:.4f} val_accuracy {val_accuracy:.4f}".format(**row))
    print("ranks:", spark.sparkContext.defaultParallelism if cluster else 2)  # cluster: a classic session
    print(f"Test accuracy: {accuracy:.4f}")
    spark.stop()
    return accuracy


if __name__ == "__main__":
    main()
