"""Launch cost: starting num_proc barrier tasks that meet once through BarrierTaskContext.allGather and send
a small result back - the RDD barrier launch this project used until issue 16 (`sc.parallelize(...).barrier()
.mapPartitions`), against the barrier `mapInArrow` over `spark.range` it uses now, on a classic session and on a
Spark Connect session (a local Connect server). Then a whole small fit (1 epoch, 1,797 digits) on each session.
Not a test: numbers, not assertions.

    .venv/bin/python benchmarks/bench_launch.py [--repeat 15] [--json benchmarks/results_launch.json]

Each launch kind runs once to warm the Python workers, then `--repeat` times, interleaved; medians and ranges.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NUM_PROC = 2


def rank_body(rank_and_gather):
    """What both launches run per task: one allGather (the rendezvous), then a 1 kB result."""
    rank, gather = rank_and_gather
    replies = gather(str(rank))
    return rank, bytes(1024) + str(len(replies)).encode()


def rdd_launch(spark) -> float:
    from pyspark import BarrierTaskContext

    def task(_):
        ctx = BarrierTaskContext.get()
        yield rank_body((ctx.partitionId(), ctx.allGather))

    started = time.perf_counter()
    rows = spark.sparkContext.parallelize(range(NUM_PROC), NUM_PROC).barrier().mapPartitions(task).collect()
    assert len(rows) == NUM_PROC
    return time.perf_counter() - started


def arrow_launch(spark) -> float:
    def task(batches):
        import pyarrow as pa
        from pyspark import BarrierTaskContext

        for _ in batches:
            pass
        ctx = BarrierTaskContext.get()
        rank, payload = rank_body((ctx.partitionId(), ctx.allGather))
        yield pa.RecordBatch.from_pydict({"rank": [rank], "result": [payload]},
                                         schema=pa.schema([("rank", pa.int64()), ("result", pa.binary())]))

    started = time.perf_counter()
    rows = spark.range(0, NUM_PROC, 1, NUM_PROC).mapInArrow(task, "rank long, result binary", barrier=True).collect()
    assert len(rows) == NUM_PROC
    return time.perf_counter() - started


def fit_seconds(spark, store_dir: str, repeat: int) -> list:
    import numpy as np
    import torch
    from sklearn.datasets import load_digits
    from torch import nn

    from estimator import TorchEstimator
    from store import Store

    data = load_digits()
    rows = [((x / 16.0).astype(np.float32).tolist(), int(t)) for x, t in zip(data.data, data.target)]
    df = spark.createDataFrame(rows, "features array<float>, label long").repartition(NUM_PROC)
    times = []
    for i in range(repeat + 1):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        est = TorchEstimator(num_proc=NUM_PROC, store=Store.create(store_dir), model=model,
                             optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss=nn.CrossEntropyLoss(),
                             feature_cols=["features"], label_cols=["label"], batch_size=64, epochs=1, verbose=0,
                             random_seed=1)
        started = time.perf_counter()
        est.fit(df)
        if i:  # the first fit materializes the data and warms the workers
            times.append(time.perf_counter() - started)
    return times


def summary(values: list) -> dict:
    return {"median_s": round(statistics.median(values), 3), "min_s": round(min(values), 3),
            "max_s": round(max(values), 3), "n": len(values)}


def measure(kind: str, repeat: int) -> dict:
    """One session kind in this process (a process holds classic or Connect sessions, not both)."""
    from pyspark.sql import SparkSession

    logging.getLogger("py4j").setLevel(logging.ERROR)
    server = None
    if kind == "connect":
        from estimator.cluster import LocalConnectServer

        server = LocalConnectServer(master=f"local[{NUM_PROC}]", conf={"spark.ui.enabled": "false"}).start()
        spark = SparkSession.builder.remote(server.url).getOrCreate()
    else:
        spark = (SparkSession.builder.master(f"local[{NUM_PROC}]").config("spark.ui.enabled", "false")
                 .getOrCreate())
        spark.sparkContext.setLogLevel("ERROR")
    try:
        launches = {"arrow": arrow_launch} if kind == "connect" else {"rdd": rdd_launch, "arrow": arrow_launch}
        for launch in launches.values():
            launch(spark)  # warm
        times = {name: [] for name in launches}
        for _ in range(repeat):
            for name, launch in launches.items():
                times[name].append(launch(spark))
        out = {f"{name}_launch": summary(values) for name, values in times.items()}
        with tempfile.TemporaryDirectory() as store_dir:
            out["fit_1_epoch"] = summary(fit_seconds(spark, store_dir, max(3, repeat // 3)))
        return out
    finally:
        spark.stop()
        if server is not None:
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--json", default=None)
    parser.add_argument("--kind", choices=("classic", "connect"), default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.kind:  # a child process: one session kind, JSON on the last line
        print(json.dumps(measure(args.kind, args.repeat)))
        return
    results = {}
    for kind in ("classic", "connect"):
        child = subprocess.run([sys.executable, __file__, "--kind", kind, "--repeat", str(args.repeat)],
                               capture_output=True, text=True, check=True)
        results[kind] = json.loads(child.stdout.strip().splitlines()[-1])
    print(f"{'session':<9} {'measure':<14} {'median s':>9} {'min s':>7} {'max s':>7}  n")
    for kind, rows in results.items():
        for name, s in rows.items():
            print(f"{kind:<9} {name:<14} {s['median_s']:>9.3f} {s['min_s']:>7.3f} {s['max_s']:>7.3f}  {s['n']}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"num_proc": NUM_PROC, "cores": os.cpu_count(), "results": results}, handle, indent=2)


if __name__ == "__main__":
    main()
