"""A fit's fixed cost: a warm refit of 1,000 rows on 2 ranks (local[2], the session up, the DataFrame cached and
its materialized copy reused), an MLP for one epoch, so that nearly all of the time is the fit's own overhead.
The fit's stages (materialize, dry run, launch, rank setup, training, teardown, Spark's share) are printed per
fit. Numbers, not assertions (RESULTS.md by hand).

    .venv/bin/python benchmarks/bench_refit.py [--fits 8] [--num-proc 2] [--json benchmarks/results_refit.json]

The first fit warms the Python workers and writes the copy; the rest are the warm refits (median and range).
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
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STAGES = ("materialize_s", "dry_run_s", "launch_s", "rank_setup_s", "train_s", "teardown_s", "spark_overhead_s")


class Stages(logging.Handler):
    def __init__(self):
        super().__init__()
        self.seen = []

    def emit(self, record):
        message = record.getMessage()
        if message.startswith("fit stages: "):
            self.seen.append(json.loads(message[len("fit stages: "):]))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fits", type=int, default=8)
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    import numpy as np
    import torch
    from pyspark.sql import SparkSession

    from estimator import TorchEstimator
    from store import Store

    spark = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    rng = np.random.default_rng(0)
    df = spark.createDataFrame([(rng.normal(size=8).tolist(), int(rng.integers(0, 2))) for _ in range(1000)],
                               "features array<float>, label long").cache()
    df.count()
    store = Store.create(os.path.join(tempfile.mkdtemp(prefix="bench-refit-"), "store"))
    stages = Stages()
    logging.getLogger("estimator").addHandler(stages)
    logging.getLogger("estimator").setLevel(logging.INFO)
    fits = []
    for i in range(args.fits):
        torch.manual_seed(0)
        est = TorchEstimator(num_proc=args.num_proc, store=store, model=torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)), optimizer=lambda p: torch.optim.SGD(
            p, lr=0.1), loss=torch.nn.CrossEntropyLoss(), feature_cols=["features"], label_cols=["label"],
            batch_size=64, epochs=1, verbose=0)
        started = time.perf_counter()
        est.fit(df)
        seconds = time.perf_counter() - started
        fits.append({"fit_s": seconds, **{k: stages.seen[-1][k] for k in STAGES}})
        print(f"fit {i}{' (cold)' if i == 0 else ''}: {seconds:.3f} s",
              {k: round(stages.seen[-1][k], 3) for k in STAGES}, flush=True)
    spark.stop()
    warm = [f["fit_s"] for f in fits[1:]]
    print(f"warm refits: median {statistics.median(warm):.3f} s (range {min(warm):.3f}-{max(warm):.3f}); rank "
          f"setup median {statistics.median(f['rank_setup_s'] for f in fits[1:]):.3f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "fits": fits, "warm_median_s": statistics.median(warm)}, f, indent=1)


if __name__ == "__main__":
    main()
