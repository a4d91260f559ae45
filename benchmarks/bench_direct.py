"""data_mode='materialize' against data_mode='direct': whole fits, on the same DataFrames.

- fresh data: a fit on rows the store has never seen (a new store each run), at 100k, 1M and 4M rows of 32 float
  arrays + a long label, read from Parquet (as a table of a data lake is): materialize writes its copy, direct
  streams the rows into the ranks;
- refit: the same DataFrame fitted again (a new run_id): materialize reuses its copy, direct computes again;
- CrossValidator: 2 lr values x 2 folds and the final fit, at 1M rows.
2 ranks (local[2]), MLP 32-64-10, batch 512, 2 epochs, validation 0.1. Not a test: numbers, not assertions.

    .venv/bin/python benchmarks/bench_direct.py [--sizes 100000,1000000,4000000] [--repeat 3] [--json F]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_materialize import WIDTH, arrays_frame, timed  # noqa: E402 - sets the Spark environment first

MODES = ("materialize", "direct")


class StageLog(logging.Handler):
    """The last `fit stages` line the estimator logged."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.stages = {}

    def emit(self, record):
        found = re.search(r"fit stages: (\{.*\})", record.getMessage())
        if found:
            self.stages = json.loads(found.group(1))


def estimator(store, mode, **kw):
    import torch
    from torch import nn

    from estimator import TorchEstimator

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, 64), nn.ReLU(), nn.Linear(64, 10))
    params = dict(num_proc=2, store=store, model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.001),
                  loss=nn.CrossEntropyLoss(), metrics=["accuracy"], feature_cols=["features"], label_cols=["label"],
                  batch_size=512, epochs=2, validation=0.1, random_seed=0, verbose=0, data_mode=mode)
    params.update(kw)
    return TorchEstimator(**params)


def summary(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def fresh_and_refit(spark, path, repeat, workdir, log):
    from store import Store

    df = spark.read.parquet(path)
    out = {f"{kind}_{mode}": [] for kind in ("fresh", "refit") for mode in MODES}
    stages = {}
    for i in range(repeat):
        for mode in MODES:
            store = Store.create(os.path.join(workdir, f"store-{mode}-{i}"))
            out[f"fresh_{mode}"].append(timed(lambda: estimator(store, mode).fit(df)))
            stages[f"fresh_{mode}"] = log.stages
            out[f"refit_{mode}"].append(timed(lambda: estimator(store, mode).fit(df)))
            stages[f"refit_{mode}"] = log.stages
            shutil.rmtree(os.path.join(workdir, f"store-{mode}-{i}"), ignore_errors=True)
    result = {k: summary(v) for k, v in out.items()}
    result["stages"] = stages
    return result


def cross_validator(spark, path, workdir):
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator
    from pyspark.ml.tuning import CrossValidator, ParamGridBuilder

    from store import Store

    df = spark.read.parquet(path)
    out = {}
    for mode in MODES:
        store = Store.create(os.path.join(workdir, f"cv-{mode}"))
        est = estimator(store, mode, epochs=1)
        grid = ParamGridBuilder().addGrid(est.lr, [0.001, 0.01]).build()
        cv = CrossValidator(estimator=est, estimatorParamMaps=grid, numFolds=2, seed=1,
                            evaluator=MulticlassClassificationEvaluator(metricName="accuracy"))
        out[mode] = timed(lambda: cv.fit(df))
        shutil.rmtree(os.path.join(workdir, f"cv-{mode}"), ignore_errors=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="100000,1000000,4000000")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cv-rows", type=int, default=1_000_000)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
             .config("spark.driver.memory", "6g").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    log = StageLog()
    logging.getLogger("estimator").addHandler(log)
    logging.getLogger("estimator").setLevel(logging.INFO)
    workdir = tempfile.mkdtemp(prefix="bench-direct-")
    results = {"width": WIDTH, "repeat": args.repeat, "sizes": {}}
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
        for rows in sorted(set(sizes + [args.cv_rows])):
            arrays_frame(spark, rows).write.parquet(os.path.join(workdir, f"source-{rows}"))
        estimator(None, "direct").fit(spark.read.parquet(os.path.join(workdir, f"source-{sizes[0]}")))  # warm-up
        for rows in sizes:
            results["sizes"][rows] = fresh_and_refit(spark, os.path.join(workdir, f"source-{rows}"), args.repeat,
                                                     workdir, log)
            print(rows, {k: round(v["median"], 2) for k, v in results["sizes"][rows].items() if k != "stages"},
                  flush=True)
        results["cross_validator"] = {"rows": args.cv_rows, **cross_validator(
            spark, os.path.join(workdir, f"source-{args.cv_rows}"), workdir)}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        spark.stop()
    print(f"\nWhole fits, s: medians of {args.repeat} (min-max); 2 ranks, 2 epochs, {WIDTH} floats + label per row")
    print("| rows | fresh: materialize | fresh: direct | refit: materialize (reuse) | refit: direct |")
    print("|---|---|---|---|---|")
    for rows, r in results["sizes"].items():
        cell = lambda k: f"{r[k]['median']:.2f} ({r[k]['min']:.2f}-{r[k]['max']:.2f})"  # noqa: E731
        print(f"| {rows:,} | {cell('fresh_materialize')} | {cell('fresh_direct')} | {cell('refit_materialize')} | "
              f"{cell('refit_direct')} |")
    cv = results["cross_validator"]
    print(f"CrossValidator 2 lr x 2 folds + final fit, {cv['rows']:,} rows, 1 epoch: materialize "
          f"{cv['materialize']:.1f} s, direct {cv['direct']:.1f} s")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1, default=str)


if __name__ == "__main__":
    main()
