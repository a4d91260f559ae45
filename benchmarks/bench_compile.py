"""compile=True against eager on CPU, W1 and W2 (see bench.py): the ranks' training time (`train_s` of the fit
stages), 2 epochs. Spark reuses its Python workers, and torch keeps compiled code in the process: the first
compiled fit in a worker pays the compile (inductor's disk caches are off, TORCHINDUCTOR_FORCE_DISABLE_CACHES=1,
as in a fresh cluster), later fits of the same architecture in that worker do not. So: eager (median), compiled
cold (the first compiled fit), compiled warm (median of the later ones), compile ~= cold - warm. The data is
materialized once per workload. Numbers, not assertions.

    .venv/bin/python benchmarks/bench_compile.py [--repeat 3] [--w2-rows 1000000]
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile

os.environ["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"  # inherited by Spark's Python workers
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_direct import StageLog  # noqa: E402 - sets the Spark environment first


def frame(spark, rows, width):
    from pyspark.sql import functions as F

    values = F.array(*[F.rand(seed).cast("float") for seed in range(width)])
    return spark.range(rows, numPartitions=2).select(values.alias("features"),
                                                     (F.col("id") % 10).alias("label")).cache()


def estimator(store, width, hidden, batch, epochs, compile_):
    import torch
    from torch import nn

    from estimator import TorchEstimator

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, 10))
    return TorchEstimator(num_proc=2, store=store, model=model,
                          optimizer=torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                          loss=nn.CrossEntropyLoss(), feature_cols=["features"], label_cols=["label"],
                          batch_size=batch, epochs=epochs, random_seed=0, verbose=0, compile=compile_)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--w2-rows", type=int, default=1_000_000)
    args = parser.parse_args()
    from pyspark.sql import SparkSession

    from store import Store

    spark = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    log = StageLog()
    logging.getLogger("estimator").addHandler(log)
    logging.getLogger("estimator").setLevel(logging.INFO)
    workdir = tempfile.mkdtemp(prefix="bench-compile-")
    store = Store.create(os.path.join(workdir, "store"))
    workloads = {"W1 (20,000 x 784, MLP 784-128-10, batch 128)": (20_000, 784, 128, 128),
                 f"W2 ({args.w2_rows:,} x 64, MLP 64-128-10, batch 512)": (args.w2_rows, 64, 128, 512)}
    rows_out = []
    try:
        for name, (rows, width, hidden, batch) in workloads.items():
            df = frame(spark, rows, width)
            estimator(store, width, hidden, batch, 1, False).fit(df)  # materializes; warms the workers
            eager, compiled = [], []
            for _ in range(args.repeat):
                estimator(store, width, hidden, batch, 2, False).fit(df)
                eager.append(log.stages["train_s"])
            for _ in range(args.repeat + 1):
                estimator(store, width, hidden, batch, 2, True).fit(df)
                compiled.append(log.stages["train_s"])
            df.unpersist()
            warm = statistics.median(compiled[1:])
            rows_out.append((name, statistics.median(eager), compiled[0], warm, compiled[0] - warm))
            print(name, "eager", [round(v, 2) for v in eager], "compiled", [round(v, 2) for v in compiled], flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        spark.stop()
    print(f"\nRanks' training time (train_s), 2 epochs, s; eager and warm: medians of {args.repeat}; 2 ranks, "
          "local[2], CPU")
    print("| workload | eager | compiled, first fit in the worker | compiled, later fits | compile (first - later) |")
    print("|---|---|---|---|---|")
    for name, eager, cold, warm, comp in rows_out:
        print(f"| {name} | {eager:.2f} | {cold:.2f} | {warm:.2f} | {comp:.2f} |")


if __name__ == "__main__":
    main()
