"""Benchmarks side by side, in one run, on this machine: this project's TorchEstimator, the in-memory
PyTorch limit, TorchDistributor with a hand-written pyarrow loader, raw pyarrow reads, raw forward passes.
Prints tables and writes JSON. Not a test: numbers, not assertions.

    .venv/bin/python benchmarks/bench.py [--quick] [--json benchmarks/results.json]

Workloads (synthetic, seeded, generated on the executors):
  W1: 20,000 rows x 784 float32 + int label (10 classes), MLP 784-128-10, SGD(lr=0.01, momentum=0.9),
      batch 128, 2 epochs, num_proc=2 on local[2]; then transform 5,000 rows.
  W2: 1,000,000 rows x 64 features, MLP 64-128-10, 1 epoch, batch 512.
  Growth: 1 epoch of W2's shape at 10k, 100k and 1M rows.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import resource
import sys
import tempfile
import time

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

CORES = os.cpu_count() or 2


def mlp(features: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(features, 128), nn.ReLU(), nn.Linear(128, 10))


def frame(spark, rows: int, features: int, seed: int = 0, partitions: int = 2):
    """Seeded synthetic rows, generated on the executors: labels are a fixed random projection's argmax."""
    def generate(batches):
        for batch in batches:
            ids = batch.column(0).to_numpy()
            if len(ids) == 0:
                continue
            rng = np.random.default_rng([seed, int(ids[0])])
            x = rng.standard_normal((len(ids), features), dtype=np.float32)
            w = np.random.default_rng(seed).standard_normal((features, 10)).astype(np.float32)
            y = (x @ w).argmax(1).astype(np.int64)
            offsets = pa.array(np.arange(0, len(ids) * features + 1, features, dtype=np.int32))
            values = pa.ListArray.from_arrays(offsets, pa.array(x.reshape(-1)))
            yield pa.RecordBatch.from_arrays([values, pa.array(y)], ["features", "label"])

    return spark.range(0, rows, numPartitions=partitions).mapInArrow(generate, "features array<float>, label long")


class Stages(logging.Handler):
    """Collects the estimator's 'fit stages' log record."""

    def __init__(self):
        super().__init__()
        self.last = {}

    def emit(self, record):
        message = record.getMessage()
        if message.startswith("fit stages: "):
            self.last = json.loads(message[len("fit stages: "):])


def ours_fit(df, features, epochs, batch, store, num_proc=2, validation=None, **kw):
    from estimator import TorchEstimator

    model = mlp(features)
    est = TorchEstimator(num_proc=num_proc, store=store, model=model,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                         loss=nn.CrossEntropyLoss(), feature_cols=["features"], label_cols=["label"],
                         batch_size=batch, epochs=epochs, validation=validation, random_seed=1, verbose=0, **kw)
    started = time.perf_counter()
    fitted = est.fit(df)
    return fitted, time.perf_counter() - started


def local_data(rows: int, features: int, seed: int = 0):
    """The same distribution as `frame`, generated in this process (no collect through the driver)."""
    rng = np.random.default_rng([seed, 0])
    x = rng.standard_normal((rows, features), dtype=np.float32)
    w = np.random.default_rng(seed).standard_normal((features, 10)).astype(np.float32)
    return x, (x @ w).argmax(1).astype(np.int64)


def in_memory(x: np.ndarray, y: np.ndarray, epochs: int, batch: int) -> dict:
    """The same model and loop in one plain PyTorch process over tensors already in memory."""
    torch.set_num_threads(CORES)
    model = mlp(x.shape[1])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    generator = torch.Generator().manual_seed(0)
    started = time.perf_counter()
    for _ in range(epochs):
        order = torch.randperm(len(xt), generator=generator)
        for i in range(0, len(xt), batch):
            idx = order[i:i + batch]
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model(xt[idx]), yt[idx]).backward()
            optimizer.step()
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "rows_per_s": len(x) * epochs / seconds}


def td_train(path: str, features: int, epochs: int, batch: int) -> dict:
    """What a Databricks user writes by hand for TorchDistributor: pyarrow reads this rank's files, DDP."""
    import glob
    import os as _os
    import time as _time

    import numpy as _np
    import pyarrow.dataset as ds
    import torch as _torch
    import torch.distributed as dist
    from torch import nn as _nn
    from torch.nn.parallel import DistributedDataParallel

    started = _time.perf_counter()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    files = sorted(glob.glob(_os.path.join(path, "*.parquet")))[rank::world]
    table = ds.dataset(files, format="parquet").to_table()
    x = _np.array(table.column("features").combine_chunks().flatten().to_numpy()).reshape(-1, features)
    y = table.column("label").to_numpy()
    xt, yt = _torch.from_numpy(x.astype(_np.float32)), _torch.from_numpy(y)
    _torch.manual_seed(0)
    model = DistributedDataParallel(_nn.Sequential(_nn.Linear(features, 128), _nn.ReLU(), _nn.Linear(128, 10)))
    optimizer = _torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = _nn.CrossEntropyLoss()
    steps = len(xt) // batch
    steps = _torch.tensor(steps)
    dist.all_reduce(steps, op=dist.ReduceOp.MIN)  # equal steps on every rank, or DDP hangs
    for epoch in range(epochs):
        order = _torch.randperm(len(xt))
        for i in range(int(steps)):
            idx = order[i * batch:(i + 1) * batch]
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model(xt[idx]), yt[idx]).backward()
            optimizer.step()
    seconds = _time.perf_counter() - started
    del model
    dist.destroy_process_group()
    return {"seconds": seconds}


def torch_distributor(spark, df, features, epochs, batch, workdir) -> dict:
    from pyspark.ml.torch.distributor import TorchDistributor

    path = os.path.join(workdir, f"td-{time.time_ns()}")
    started = time.perf_counter()
    df.write.parquet(path)
    written = time.perf_counter() - started
    result = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(td_train, path, features,
                                                                                    epochs, batch)
    total = time.perf_counter() - started
    return {"write_parquet_s": written, "run_s": total - written, "total_s": total,
            "rank0_train_s": result["seconds"] if result else None}


def reader_vs_pyarrow(store, pieces, data_spec, rank=0, world=2) -> dict:
    """Our reader alone (one rank's shard into memory) vs raw pyarrow.dataset reading the same files."""
    import pyarrow.dataset as ds

    from estimator.data import read_rows, shard_range

    start, stop = shard_range(sum(p.num_rows for p in pieces), rank, world)
    t0 = time.perf_counter()
    ours = read_rows(store, pieces, start, stop, data_spec.columns)
    ours_s = time.perf_counter() - t0
    files = sorted({p.path for p in pieces})
    t0 = time.perf_counter()
    table = ds.dataset(files, format="parquet", filesystem=store.fs).to_table(columns=list(data_spec.columns))
    raw = {c: table.column(c).combine_chunks() for c in data_spec.columns}
    _ = np.asarray(raw["features"].flatten().to_numpy()), raw["label"].to_numpy()
    raw_s = time.perf_counter() - t0
    rows_ours, rows_raw = stop - start, table.num_rows
    return {"ours_rows": rows_ours, "ours_s": ours_s, "ours_rows_per_s": rows_ours / ours_s,
            "raw_rows": rows_raw, "raw_s": raw_s, "raw_rows_per_s": rows_raw / raw_s,
            "ratio": (rows_ours / ours_s) / (rows_raw / raw_s)}


def transform_vs_forward(fitted, df, features) -> dict:
    from pyspark.sql import functions as F

    rows = df.count()
    t0 = time.perf_counter()
    fitted.transform(df).agg(F.sum("prediction")).collect()
    ours_s = time.perf_counter() - t0
    pdf = df.toPandas()
    x = torch.from_numpy(np.stack(pdf["features"].to_numpy()).astype(np.float32))
    model = fitted.getModel().eval()
    torch.set_num_threads(CORES)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(x), 1024):
            model(x[i:i + 1024]).argmax(1)
    raw_s = time.perf_counter() - t0
    return {"rows": rows, "ours_s": ours_s, "raw_forward_s": raw_s, "ratio": raw_s / ours_s}


def table(title, rows, columns):
    print(f"\n## {title}\n")
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(_fmt(row.get(c, "")) for c in columns) + " |")


def _fmt(v):
    if isinstance(v, float):
        return f"{v:,.3f}" if v < 10 else f"{v:,.1f}"
    return str(v)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="W2 and growth at 100k rows at most")
    parser.add_argument("--json", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results.json"))
    parser.add_argument("--skip-td", action="store_true", help="leave TorchDistributor out")
    args = parser.parse_args(argv)

    from pyspark.sql import SparkSession

    from store import Store

    logging.basicConfig(level=logging.WARNING)
    stages = Stages()
    logging.getLogger("estimator").addHandler(stages)
    logging.getLogger("estimator").setLevel(logging.INFO)
    workdir = tempfile.mkdtemp(prefix="bench-")
    store = Store.create(os.path.join(workdir, "store"))
    spark = (SparkSession.builder.master("local[2]").appName("benchmarks").config("spark.ui.enabled", "false")
             .config("spark.sql.shuffle.partitions", "2").config("spark.driver.memory", "3g").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    results = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {CORES} cores, "
               f"{platform.python_version()}, torch {torch.__version__}", "cores": CORES}

    # fit overhead: 1k rows, 1 epoch, session up and workers warm (one warm-up fit first)
    small = frame(spark, 1000, 784, seed=5).cache()
    small.count()
    ours_fit(small, 784, 1, 128, store)
    _, overhead = ours_fit(small, 784, 1, 128, store)
    results["overhead"] = {"seconds": overhead, "stages": stages.last}

    # W1
    w1 = frame(spark, 20000, 784, seed=1).cache()
    w1.count()
    fitted, w1_first = ours_fit(w1, 784, 2, 128, store)
    first_stages = dict(stages.last)
    _, w1_second = ours_fit(w1, 784, 2, 128, store)
    second_stages = dict(stages.last)
    mem = in_memory(*local_data(20000, 784, seed=1), 2, 128)
    td = torch_distributor(spark, w1, 784, 2, 128, workdir) if not args.skip_td else {}
    results["w1"] = {"ours_first_s": w1_first, "ours_first_stages": first_stages, "ours_second_s": w1_second,
                     "ours_second_stages": second_stages, "in_memory": mem, "torch_distributor": td}
    test = frame(spark, 5000, 784, seed=9).cache()
    test.count()
    results["transform"] = transform_vs_forward(fitted, test, 784)
    from estimator.data import list_pieces
    from estimator.spec import DataSpec

    markers = [m for m in store.find(store.path("data"), suffix="_COMMITTED.json")
               if json.loads(store.read_bytes(m))["train_rows"] == 20000]
    committed = json.loads(store.read_bytes(markers[0]))
    train_dir = f"{markers[0].rsplit('/', 1)[0]}/attempt-{committed['attempt']}/__is_val=false"
    pieces = list_pieces(store, train_dir)
    if pieces:
        spec = DataSpec(store, pieces, (), ("features",), ("label",))
        results["reader"] = reader_vs_pyarrow(store, pieces, spec)

    # W2 and growth
    sizes = [10_000, 100_000] + ([] if args.quick else [1_000_000])
    growth = []
    for rows in sizes:
        df = frame(spark, rows, 64, seed=rows).cache()
        df.count()
        _, seconds = ours_fit(df, 64, 1, 512, store)
        growth.append({"rows": rows, "fit_s": seconds, **{k: v for k, v in stages.last.items()}})
        if rows == sizes[-1]:
            mem2 = in_memory(*local_data(rows, 64, seed=rows), 1, 512)
            results["w2"] = {"rows": rows, "ours_fit_s": seconds, "ours_train_s": stages.last.get("train_s"),
                             "ours_train_rows_per_s": rows / stages.last["train_s"] if stages.last.get("train_s")
                             else None, "in_memory": mem2}
        df.unpersist()
    if len(growth) >= 2:
        a, b = growth[0], growth[-1]
        per_row = (b["fit_s"] - a["fit_s"]) / (b["rows"] - a["rows"])
        results["growth"] = {"points": growth, "per_row_us": per_row * 1e6, "fixed_s": a["fit_s"] - per_row * a["rows"]}
    results["driver_peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    spark.stop()
    report(results)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=2, default=str)
    print(f"\nJSON: {args.json}")


def report(r):
    print(f"# Benchmarks {r['date']} on {r['machine']}")
    s = r["overhead"]["stages"]
    table("Fit overhead: 1,000 rows, 1 epoch, session up (target <= 3 s)",
          [{"fit s": r["overhead"]["seconds"], **{k: v for k, v in s.items()}}], ["fit s", *s.keys()])
    w1 = r["w1"]
    td = w1.get("torch_distributor") or {}
    rows = [{"what": "ours, first fit (materializes)", "seconds": w1["ours_first_s"]},
            {"what": "ours, second fit (reuses data)", "seconds": w1["ours_second_s"]},
            {"what": "in-memory limit, 1 process", "seconds": w1["in_memory"]["seconds"]}]
    if td:
        rows += [{"what": "TorchDistributor: write Parquet + run", "seconds": td["total_s"]},
                 {"what": "TorchDistributor: run only", "seconds": td["run_s"]}]
    table("W1: 20,000 x 784, MLP 784-128-10, 2 epochs, batch 128, 2 processes (target: ours <= 0.5x TorchDistributor)",
          rows, ["what", "seconds"])
    table("W1 fit stages (seconds)", [{"fit": "first", **w1["ours_first_stages"]},
                                      {"fit": "second", **w1["ours_second_stages"]}],
          ["fit", *w1["ours_first_stages"].keys()])
    if "reader" in r:
        table("Reader: one rank's shard into memory (target >= 0.8x raw pyarrow)", [r["reader"]],
              ["ours_rows", "ours_rows_per_s", "raw_rows", "raw_rows_per_s", "ratio"])
    table("Transform 5,000 rows (target >= 0.5x raw forward)", [r["transform"]], ["rows", "ours_s", "raw_forward_s",
                                                                                  "ratio"])
    if "w2" in r:
        w2 = r["w2"]
        table(f"W2: {w2['rows']:,} x 64, 1 epoch, batch 512 (target: training >= 0.7x in-memory)",
              [{"what": "ours (training stage)", "rows/s": w2["ours_train_rows_per_s"]},
               {"what": "in-memory limit", "rows/s": w2["in_memory"]["rows_per_s"]}], ["what", "rows/s"])
    if "growth" in r:
        g = r["growth"]
        table(f"Growth, 1 epoch (fixed ~{g['fixed_s']:.1f} s + {g['per_row_us']:.1f} us/row)", g["points"],
              list(g["points"][0].keys()))


if __name__ == "__main__":
    main()
