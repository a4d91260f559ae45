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
import resource
import statistics
import sys
import tempfile
import time
from typing import List, Tuple

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
    params = dict(num_proc=num_proc, store=store, model=model,
                  optimizer=torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                  loss=nn.CrossEntropyLoss(), feature_cols=["features"], label_cols=["label"],
                  batch_size=batch, epochs=epochs, validation=validation, random_seed=1, verbose=0)
    est = TorchEstimator(**{**params, **kw})
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


def median_of(fn, repeat: int) -> Tuple[float, List[float]]:
    """Median and all of `repeat` timings of fn()."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def reader_vs_pyarrow(store, pieces, data_spec, repeat: int, rank=0, world=2) -> dict:
    """Our reader alone vs raw pyarrow.dataset reading the same shard (the files holding rank 0's rows) into
    numpy; page cache warm for both (one untimed read first)."""
    import pyarrow.dataset as ds

    from estimator.data.parquet import read_rows, shard_range

    start, stop = shard_range(sum(p.num_rows for p in pieces), rank, world)
    offsets = np.cumsum([0] + [p.num_rows for p in pieces])
    files = sorted({p.path for p, lo, hi in zip(pieces, offsets, offsets[1:]) if lo < stop and hi > start})

    def ours():
        read_rows(store, pieces, start, stop, data_spec.columns)

    def raw():
        table = ds.dataset(files, format="parquet", filesystem=store.fs).to_table(columns=list(data_spec.columns))
        features = table.column("features").combine_chunks()
        np.asarray(features.flatten().to_numpy()).reshape(len(features), -1), table.column("label").to_numpy()
        return table.num_rows

    raw_rows = raw()
    ours()
    ours_s, _ = median_of(ours, repeat)
    raw_s, _ = median_of(raw, repeat)
    rows_ours = stop - start
    return {"ours_rows": rows_ours, "ours_s": ours_s, "ours_rows_per_s": rows_ours / ours_s,
            "raw_rows": raw_rows, "raw_s": raw_s, "raw_rows_per_s": raw_rows / raw_s,
            "ratio": (rows_ours / ours_s) / (raw_rows / raw_s)}


def transform_vs_forward(fitted, df, repeat: int) -> dict:
    """Our transform (the first one after the fit, then warm), Spark's own floor for the same rows (a plain
    aggregation; a no-op Arrow UDF that only moves the feature column to Python and back), and a raw torch
    forward over the same rows in this process (warmed up, torch threads = cores)."""
    from pyspark.sql import functions as F

    rows = df.count()

    def ours():
        fitted.transform(df).agg(F.sum("prediction")).collect()

    first, _ = median_of(ours, 1)
    warm, _ = median_of(ours, repeat)
    plain, _ = median_of(lambda: df.agg(F.sum(F.size("features"))).collect(), repeat)

    def noop(column: pa.Array) -> pa.Array:
        return pa.array(np.zeros(len(column)))

    if hasattr(F, "arrow_udf"):
        udf = F.arrow_udf(noop, "double")
        noop_s, _ = median_of(lambda: df.select(udf("features").alias("p")).agg(F.sum("p")).collect(), repeat)
    else:
        noop_s = None
    pdf = df.select("features").toPandas()
    x = torch.from_numpy(np.stack(pdf["features"].to_numpy()).astype(np.float32))
    model = fitted.getModel().eval()
    torch.set_num_threads(CORES)
    batch = fitted.getBatchSize()

    def forward():
        with torch.inference_mode():
            for i in range(0, len(x), batch):
                model(x[i:i + batch]).argmax(1)

    forward()
    raw_s, _ = median_of(forward, max(repeat, 5))
    return {"rows": rows, "ours_first_s": first, "ours_s": warm, "spark_plain_job_s": plain,
            "spark_noop_arrow_udf_s": noop_s, "raw_forward_s": raw_s, "ratio": raw_s / warm,
            "ours_minus_noop_udf_s": (warm - noop_s) if noop_s is not None else None}


def median_dict(runs: List[dict], key: str = "seconds") -> dict:
    """The run with the median `key`, with every run's `key` alongside."""
    ordered = sorted(runs, key=lambda r: r[key])
    return {**ordered[len(ordered) // 2], "all_" + key: [r[key] for r in ordered]}


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
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement; tables show medians")
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
               f"{platform.python_version()}, torch {torch.__version__}", "cores": CORES, "repeat": args.repeat}

    repeat = args.repeat

    def fits(make_df, features, epochs, batch, n):
        """n fits, each on make_df(i): (median seconds, the stages of the median fit, all seconds)."""
        runs = []
        for i in range(n):
            df = make_df(i)
            fitted, seconds = ours_fit(df, features, epochs, batch, store)
            runs.append((seconds, dict(stages.last), fitted, df))
        runs.sort(key=lambda r: r[0])
        middle = runs[len(runs) // 2]
        return middle, [r[0] for r in runs], runs

    def cached(rows, features, seed):
        df = frame(spark, rows, features, seed=seed).cache()
        df.count()
        return df

    # fit overhead: 1k rows, 1 epoch, session up and workers warm (one warm-up fit first)
    small = cached(1000, 784, 5)
    ours_fit(small, 784, 1, 128, store)
    (overhead, overhead_stages, _, _), overhead_all, _ = fits(lambda i: small, 784, 1, 128, repeat)
    results["overhead"] = {"seconds": overhead, "all_s": overhead_all, "stages": overhead_stages}

    # W1: first fits on fresh DataFrames (each materializes), second fits reuse the first DataFrame's data
    w1_frames = [cached(20000, 784, 1 + i) for i in range(repeat)]
    (w1_first, first_stages, fitted, _), first_all, _ = fits(lambda i: w1_frames[i], 784, 2, 128, repeat)
    (w1_second, second_stages, _, _), second_all, _ = fits(lambda i: w1_frames[0], 784, 2, 128, repeat)
    x1, y1 = local_data(20000, 784, seed=1)
    mem = median_dict([in_memory(x1, y1, 2, 128) for _ in range(repeat)])
    td = (median_dict([torch_distributor(spark, w1_frames[0], 784, 2, 128, workdir) for _ in range(repeat)],
                      "total_s") if not args.skip_td else {})
    results["w1"] = {"ours_first_s": w1_first, "ours_first_all_s": first_all, "ours_first_stages": first_stages,
                     "ours_second_s": w1_second, "ours_second_all_s": second_all,
                     "ours_second_stages": second_stages, "in_memory": mem, "torch_distributor": td}
    for df in w1_frames[1:]:
        df.unpersist()

    # transform, right after a fit (W1's last refit), on 5,000 new rows
    ours_fit(w1_frames[0], 784, 2, 128, store)
    test = cached(5000, 784, 9)
    results["transform"] = transform_vs_forward(fitted, test, repeat)
    test.unpersist()
    if not args.quick:  # the same at 10x the rows: how the ratio moves once Spark's per-job cost is spread
        test = cached(50000, 784, 10)
        results["transform_50k"] = transform_vs_forward(fitted, test, repeat)
        test.unpersist()

    from estimator.core.spec import DataSpec
    from estimator.data.parquet import list_pieces

    markers = [m for m in store.find(store.path("data"), suffix="_COMMITTED.json")
               if json.loads(store.read_bytes(m))["train_rows"] == 20000]
    committed = json.loads(store.read_bytes(markers[0]))
    train_dir = f"{markers[0].rsplit('/', 1)[0]}/attempt-{committed['attempt']}/__is_val=false"
    pieces = list_pieces(store, train_dir)
    if pieces:
        spec = DataSpec(store, pieces, (), ("features",), ("label",))
        results["reader"] = reader_vs_pyarrow(store, pieces, spec, max(repeat, 5))
    w1_frames[0].unpersist()

    # W2 and growth: first fits (each materializes its own fresh DataFrame), `repeat` per size
    sizes = [10_000, 100_000] + ([] if args.quick else [1_000_000])
    growth = []
    for rows in sizes:
        def make(i, rows=rows):
            return cached(rows, 64, rows + i)
        (seconds, point_stages, _, _), all_s, runs = fits(make, 64, 1, 512, repeat)
        growth.append({"rows": rows, "fit_s": seconds, "all_s": all_s, **point_stages})
        if rows == sizes[-1]:
            train_rates = sorted(rows / r[1]["train_s"] for r in runs)
            x2, y2 = local_data(rows, 64, seed=rows)
            mem2 = median_dict([in_memory(x2, y2, 1, 512) for _ in range(repeat)])
            refit_rates = []
            for _ in range(repeat):  # the same data again: no materialization just before training
                ours_fit(runs[-1][3], 64, 1, 512, store)
                refit_rates.append(rows / stages.last["train_s"])
            gloo_rates = []
            for _ in range(repeat):  # the same refit with gloo over loopback instead of shared memory
                ours_fit(runs[-1][3], 64, 1, 512, store, shared_memory_allreduce=False)
                gloo_rates.append(rows / stages.last["train_s"])
            results["w2"] = {"rows": rows, "ours_fit_s": seconds,
                             "ours_refit_gloo_train_rows_per_s": statistics.median(gloo_rates),
                             "ours_refit_gloo_train_rows_per_s_all": sorted(gloo_rates),
                             "ours_train_rows_per_s": statistics.median(train_rates),
                             "ours_train_rows_per_s_all": train_rates,
                             "ours_refit_train_rows_per_s": statistics.median(refit_rates),
                             "ours_refit_train_rows_per_s_all": sorted(refit_rates), "in_memory": mem2}
            del x2, y2
        for r in runs:
            r[3].unpersist()
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


def spread(values) -> str:
    return f"{min(values):.2f}-{max(values):.2f}" if values else ""


def report(r):
    print(f"# Benchmarks {r['date']} on {r['machine']}; medians of {r['repeat']} runs (range alongside)")
    s = r["overhead"]["stages"]
    table("Fit overhead: 1,000 rows, 1 epoch, session up (target <= 3 s)",
          [{"fit s": r["overhead"]["seconds"], "range": spread(r["overhead"]["all_s"]), **s}],
          ["fit s", "range", *s.keys()])
    w1 = r["w1"]
    td = w1.get("torch_distributor") or {}
    rows = [{"what": "ours, first fit (materializes)", "seconds": w1["ours_first_s"],
             "range": spread(w1["ours_first_all_s"])},
            {"what": "ours, second fit (reuses data)", "seconds": w1["ours_second_s"],
             "range": spread(w1["ours_second_all_s"])},
            {"what": "in-memory limit, 1 process", "seconds": w1["in_memory"]["seconds"],
             "range": spread(w1["in_memory"]["all_seconds"])}]
    if td:
        rows += [{"what": "TorchDistributor: write Parquet + run", "seconds": td["total_s"]},
                 {"what": "TorchDistributor: run only", "seconds": td["run_s"]}]
        rows.append({"what": "ratio: ours first fit / TorchDistributor (write + run)",
                     "seconds": w1["ours_first_s"] / td["total_s"]})
    table("W1: 20,000 x 784, MLP 784-128-10, 2 epochs, batch 128, 2 processes (target: ours <= 0.5x TorchDistributor)",
          rows, ["what", "seconds", "range"])
    table("W1 fit stages (seconds)", [{"fit": "first", **w1["ours_first_stages"]},
                                      {"fit": "second", **w1["ours_second_stages"]}],
          ["fit", *w1["ours_first_stages"].keys()])
    if "reader" in r:
        table("Reader: rank 0's shard into memory, page cache warm (target >= 0.8x raw pyarrow)", [r["reader"]],
              ["ours_rows", "ours_rows_per_s", "raw_rows", "raw_rows_per_s", "ratio"])
    table("Transform 5,000 rows (target >= 0.5x raw forward; 50,000 rows for scale), seconds",
          [r["transform"], *([r["transform_50k"]] if "transform_50k" in r else [])],
          ["rows", "ours_first_s", "ours_s", "spark_plain_job_s", "spark_noop_arrow_udf_s", "ours_minus_noop_udf_s",
           "raw_forward_s", "ratio"])
    if "w2" in r:
        w2 = r["w2"]
        table(f"W2: {w2['rows']:,} x 64, 1 epoch, batch 512 (target: training >= 0.7x in-memory)",
              [{"what": "ours, first fit (training stage: loop + any wait for the shard read)",
                "rows/s": w2["ours_train_rows_per_s"],
                "range": spread([v / 1000 for v in w2["ours_train_rows_per_s_all"]]) + " k"},
               {"what": "ours, refit of the same data (training stage)", "rows/s": w2["ours_refit_train_rows_per_s"],
                "range": spread([v / 1000 for v in w2["ours_refit_train_rows_per_s_all"]]) + " k"},
               *([{"what": "ours, refit, gloo allreduce (shared_memory_allreduce=False)",
                   "rows/s": w2["ours_refit_gloo_train_rows_per_s"],
                   "range": spread([v / 1000 for v in w2["ours_refit_gloo_train_rows_per_s_all"]]) + " k"}]
                 if "ours_refit_gloo_train_rows_per_s" in w2 else []),
               {"what": "in-memory limit", "rows/s": w2["in_memory"]["rows_per_s"]},
               {"what": "ratio, first fit", "rows/s": w2["ours_train_rows_per_s"] / w2["in_memory"]["rows_per_s"]},
               {"what": "ratio, refit", "rows/s": w2["ours_refit_train_rows_per_s"] / w2["in_memory"]["rows_per_s"]}],
              ["what", "rows/s", "range"])
    if "growth" in r:
        g = r["growth"]
        points = [{**p, "all_s": spread(p["all_s"])} for p in g["points"]]
        table(f"Growth, 1 epoch, first fits (fixed ~{g['fixed_s']:.1f} s + {g['per_row_us']:.1f} us/row)", points,
              list(points[0].keys()))


if __name__ == "__main__":
    main()
