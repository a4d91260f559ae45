"""The data step against Spark's own floor, on the same DataFrame and columns: computing the DataFrame (a `noop`
write), Spark's plain Parquet write of the selected columns, and this project's `materialize` (fresh store each
time; then a reuse in the same store). Two sources: generated arrays (`spark.range` + seeded `rand`, 1M x 32
array<float> + a long label), and Spark ML pipeline output (VectorAssembler + StandardScaler over 32 double
columns), where it also times the reuse of a second `transform` of the same fitted PipelineModel (new UDF
objects: found by the rows' fingerprint) and measures the store after 20 data steps of such transforms (as 20
fits of the same pipeline output make). Not a test: numbers, not assertions.

    .venv/bin/python benchmarks/bench_materialize.py [--rows 1000000] [--repeat 3] [--json benchmarks/results_materialize.json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WIDTH, NUM_PROC = 32, 2


def arrays_frame(spark, rows):
    from pyspark.sql import functions as F

    values = F.array(*[F.rand(seed).cast("float") for seed in range(WIDTH)])
    return spark.range(rows, numPartitions=4).select(values.alias("features"), (F.col("id") % 10).alias("label"))


def pipeline_frames(spark, rows):
    """The same fitted PipelineModel's output, transformed twice (as a CrossValidator or a refit does)."""
    from pyspark.ml import Pipeline
    from pyspark.ml.feature import StandardScaler, VectorAssembler
    from pyspark.sql import functions as F

    source = spark.range(rows, numPartitions=4).select(
        *[F.rand(seed).alias(f"x{seed}") for seed in range(WIDTH)], (F.col("id") % 10).alias("label"))
    source = source.cache()
    source.count()
    model = Pipeline(stages=[VectorAssembler(inputCols=[f"x{i}" for i in range(WIDTH)], outputCol="raw"),
                             StandardScaler(inputCol="raw", outputCol="features")]).fit(source)
    return model.transform(source).select("features", "label"), model, source


def timed(action):
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def measure(spark, df, repeat, workdir):
    from estimator.fit.materialize import finish, materialize
    from pyspark.ml.functions import vector_to_array
    from pyspark.ml.linalg import VectorUDT
    from store import Store

    arrays = df.select(vector_to_array("features", "float32").alias("features"), "label") \
        if isinstance(df.schema["features"].dataType, VectorUDT) else df
    times = {"noop": [], "spark_parquet": [], "materialize": [], "materialize_reuse": []}
    for i in range(repeat):
        times["noop"].append(timed(lambda: arrays.write.format("noop").mode("overwrite").save()))
        path = os.path.join(workdir, f"plain-{i}")
        times["spark_parquet"].append(timed(lambda: arrays.write.parquet(path)))
        shutil.rmtree(path, ignore_errors=True)
        store = Store.create(os.path.join(workdir, f"store-{i}"))
        times["materialize"].append(timed(lambda: finish(store, materialize(df, store, ["features", "label"], 0.1, 0,
                                                                            NUM_PROC))))
        times["materialize_reuse"].append(timed(lambda: finish(store, materialize(df, store, ["features", "label"],
                                                                                  0.1, 0, NUM_PROC))))
        shutil.rmtree(os.path.join(workdir, f"store-{i}"), ignore_errors=True)
    summary = {k: {"median": statistics.median(v), "min": min(v), "max": max(v), "runs": v} for k, v in times.items()}
    return summary


def twenty_transforms(model, source, workdir):
    """20 data steps, each on a new transform of the same PipelineModel: seconds each, copies and bytes left."""
    from estimator.fit.materialize import finish, materialize
    from store import Store

    store = Store.create(os.path.join(workdir, "store-20"))
    seconds, reused = [], 0
    for _ in range(20):
        started = time.perf_counter()
        m = materialize(model.transform(source).select("features", "label"), store, ["features", "label"], 0.1, 0,
                        NUM_PROC)
        finish(store, m)
        seconds.append(time.perf_counter() - started)
        reused += m.reused
    markers = list(store.find(store.path("data"), suffix="_COMMITTED.json"))
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(store.path("data")) for f in fs)
    return {"first_s": seconds[0], "reuse_median_s": statistics.median(seconds[1:]), "reused": reused,
            "copies": len(markers), "store_data_bytes": size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
             .config("spark.driver.memory", "4g").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    workdir = tempfile.mkdtemp(prefix="bench-materialize-")
    try:
        results = {"rows": args.rows, "width": WIDTH, "repeat": args.repeat}
        results["arrays"] = measure(spark, arrays_frame(spark, args.rows), args.repeat, workdir)
        first, model, source = pipeline_frames(spark, args.rows)
        results["pipeline"] = measure(spark, first, args.repeat, workdir)
        results["pipeline_20_transforms"] = twenty_transforms(model, source, workdir)
        source.unpersist()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        spark.stop()
    print(f"{args.rows:,} rows x {WIDTH} floats + a long label, local[2], medians of {args.repeat} (min-max), s")
    print("| source | noop (compute) | Spark's df.write.parquet | materialize | materialize / Spark's write | reuse |")
    print("|---|---|---|---|---|---|")
    for name in ("arrays", "pipeline"):
        r = results[name]
        cell = lambda k: f"{r[k]['median']:.2f} ({r[k]['min']:.2f}-{r[k]['max']:.2f})"  # noqa: E731
        print(f"| {name} | {cell('noop')} | {cell('spark_parquet')} | {cell('materialize')} | "
              f"{r['materialize']['median'] / r['spark_parquet']['median']:.2f}x | {cell('materialize_reuse')} |")
    t = results["pipeline_20_transforms"]
    print(f"20 data steps on new transforms of one PipelineModel: first {t['first_s']:.2f} s, then "
          f"{t['reuse_median_s']:.2f} s each (median; {t['reused']} reused); the store holds {t['copies']} copy, "
          f"{t['store_data_bytes'] / 1e6:.1f} MB")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
