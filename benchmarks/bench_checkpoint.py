"""Checkpoints that do not stall training: the same fit with rank 0 writing its checkpoints in the background
(checkpoint_async=True, the default) and in the foreground (False), against a slow store: every checkpoint write
takes `--store-seconds` longer (an injected sleep in the write path, where a remote store's latency would be).
Not a test: numbers, not assertions.

    .venv/bin/python benchmarks/bench_checkpoint.py [--rows 100000] [--repeat 3] [--json benchmarks/results_checkpoint.json]
    .venv/bin/python benchmarks/bench_checkpoint.py --strategy fsdp --json benchmarks/results_checkpoint_fsdp.json

With --strategy fsdp every rank writes its shards with Distributed Checkpoint (in the background: DCP's
async_save, then rank 0's file), and every rank's write is the slow one.

2 ranks on local[2], a 1.1M-parameter MLP (its checkpoint with Adam's state: 13 MB), 2 epochs of batch 64,
checkpoint_steps=200 (and the epoch ends). Reported from the fit's own `fit stages`: train_s (the slowest rank's
training), checkpoint_wait_s (rank 0's waits for writes); the stall per checkpoint is the training time above a
fit that checkpoints at epoch ends only on a fast store, over the checkpoints written. Variants alternate within
each repeat.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Stages(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.last = {}

    def emit(self, record):
        text = record.getMessage()
        if text.startswith("fit stages: "):
            self.last = json.loads(text[len("fit stages: "):])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--store-seconds", type=float, default=0.5)
    parser.add_argument("--checkpoint-steps", type=int, default=200)
    parser.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp"])  # fsdp: every rank writes its shards
    parser.add_argument("--json")
    args = parser.parse_args()

    import torch
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F
    from torch import nn

    from estimator import TorchEstimator
    from estimator.core.faults import ENV
    from store import Store

    spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
             .config("spark.sql.shuffle.partitions", "2").getOrCreate())
    df = spark.range(args.rows).select(F.array(*[F.rand(i).cast("float") for i in range(64)]).alias("x"),
                                       (F.rand(99) * 10).cast("long").alias("y")).repartition(2).cache()
    df.count()
    store = Store.create(tempfile.mkdtemp(prefix="bench-checkpoint-"))
    stages = Stages()
    logging.getLogger("estimator").addHandler(stages)
    logging.getLogger("estimator").setLevel(logging.INFO)
    steps_per_epoch = args.rows // 2 // 64

    def fit(name, steps, asynchronous, slow):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
        if slow:
            writers = (0, 1) if args.strategy == "fsdp" else (0,)  # every rank's write is slow
            os.environ[ENV] = json.dumps([{"point": "checkpoint_write", "rank": rank, "action": "sleep",
                                           "seconds": args.store_seconds} for rank in writers])
        try:
            TorchEstimator(num_proc=2, store=store, model=model, optimizer=torch.optim.Adam(model.parameters()),
                           loss=nn.CrossEntropyLoss(), feature_cols=["x"], label_cols=["y"], batch_size=64, epochs=2,
                           checkpoint_steps=steps, checkpoint_async=asynchronous, verbose=0, strategy=args.strategy,
                           random_seed=1).fit(df)
        finally:
            os.environ.pop(ENV, None)
        checkpoints = 2 + (2 * steps_per_epoch - 1) // steps if steps else 2
        return {"train_s": stages.last["train_s"], "checkpoint_wait_s": stages.last["checkpoint_wait_s"],
                "checkpoints": checkpoints}

    variants = {"epoch ends only, fast store": (None, True, False),
                "background writes, slow store": (args.checkpoint_steps, True, True),
                "foreground writes, slow store": (args.checkpoint_steps, False, True)}
    fit("warm-up", None, True, False)
    runs = {name: [] for name in variants}
    for _ in range(args.repeat):
        for name, (steps, asynchronous, slow) in variants.items():
            runs[name].append(fit(name, steps, asynchronous, slow))
    base = statistics.median(r["train_s"] for r in runs["epoch ends only, fast store"])
    table = {}
    for name, rows in runs.items():
        train = statistics.median(r["train_s"] for r in rows)
        wait = statistics.median(r["checkpoint_wait_s"] for r in rows)
        count = rows[0]["checkpoints"]
        table[name] = {"train_s": round(train, 2), "train_range": [round(min(r["train_s"] for r in rows), 2),
                                                                  round(max(r["train_s"] for r in rows), 2)],
                       "checkpoint_wait_s": round(wait, 2), "checkpoints": count,
                       "stall_per_checkpoint_s": round((train - base) / count, 3),
                       "wait_per_checkpoint_s": round(wait / count, 3)}
        print(f"{name:32s} train {train:6.2f} s  waits {wait:6.2f} s over {count} checkpoints: "
              f"stall {(train - base) / count:.3f} s, wait {wait / count:.3f} s per checkpoint")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": table, "runs": runs}, f, indent=1)
    spark.stop()


if __name__ == "__main__":
    main()
