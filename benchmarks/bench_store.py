"""What a store holds after tuning: a 2 x 2 CrossValidator (2 folds: 8 fits and the refit of the best) and 20
plain fits, each of the digits MLP on 2 ranks, by default (save_runs=True, save_top_k=1) and with the store's run
budget at a small value. Not a test: numbers, not assertions.

    .venv/bin/python benchmarks/bench_store.py [--json benchmarks/results_store.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def measure(root: str) -> dict:
    """Bytes and files under the store's runs/ and data/, and the run folders."""
    out = {}
    for part in ("runs", "data"):
        files = [os.path.join(d, f) for d, _, names in os.walk(os.path.join(root, part)) for f in names]
        out[f"{part}_mb"] = round(sum(os.path.getsize(f) for f in files) / 1e6, 2)
        out[f"{part}_files"] = len(files)
    runs = os.path.join(root, "runs")
    out["run_folders"] = len(os.listdir(runs)) if os.path.isdir(runs) else 0
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    import torch
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator
    from pyspark.ml.tuning import CrossValidator, ParamGridBuilder
    from pyspark.sql import SparkSession
    from sklearn.datasets import load_digits
    from torch import nn

    from estimator import TorchEstimator
    from store import Store

    spark = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    digits = load_digits()
    df = spark.createDataFrame([((x / 16.0).astype("float32").tolist(), int(t)) for x, t in
                                zip(digits.data, digits.target)], "features array<float>, label long").cache()

    def estimator(store):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        return TorchEstimator(num_proc=2, store=store, model=model, optimizer=torch.optim.Adam(model.parameters()),
                              loss=nn.CrossEntropyLoss(), feature_cols=["features"], label_cols=["label"],
                              batch_size=64, epochs=2, validation=0.2, verbose=0)

    rows = []
    for label, kwargs in (("default", {}), ("max_run_bytes=100 kB", {"max_run_bytes": 100_000})):
        root = tempfile.mkdtemp(prefix="bench-store-")
        store = Store.create(root, **kwargs)
        est = estimator(store)
        grid = ParamGridBuilder().addGrid(est.epochs, [1, 2]).addGrid(est.lr, [0.001, 0.01]).build()
        CrossValidator(estimator=est, estimatorParamMaps=grid, numFolds=2, seed=1,
                       evaluator=MulticlassClassificationEvaluator(labelCol="label")).fit(df)
        rows.append({"store": label, "after": "2 x 2 CrossValidator (9 fits)", **measure(root)})
        for _ in range(20):
            estimator(store).fit(df)
        rows.append({"store": label, "after": "and 20 fits more", **measure(root)})
    spark.stop()
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(str(row[k]) for k in keys) + " |")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()
