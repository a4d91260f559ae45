"""A user's script for tests/test_interrupt_spark.py: a long fit that the test interrupts with SIGINT (Ctrl-C);
then what a user would see and do next, measured, as one JSON line on stdout."""
import json
import os
import sys
import time

import numpy as np
import torch
from pyspark.sql import SparkSession
from torch import nn

from estimator import TorchEstimator
from store import Store

root, kind = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "classic"
if kind == "connect":  # a local Spark Connect server started in this process (pyspark[connect])
    spark = SparkSession.builder.remote("local[2]").config("spark.ui.enabled", "false").getOrCreate()
else:
    spark = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate()
rng = np.random.default_rng(0)
x = rng.standard_normal((5000, 16)).astype("float32")  # an epoch of 157 steps a rank: a second or two
y = (x[:, 0] > 0).astype("int64")
df = spark.createDataFrame([(row.tolist(), int(label)) for row, label in zip(x, y)], ["features", "label"])
df = df.repartition(2).cache()
df.count()


def estimator(**kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 2))
    params = dict(num_proc=2, store=Store.create(root), model=model,
                  optimizer=torch.optim.SGD(model.parameters(), lr=0.01), loss=nn.CrossEntropyLoss(),
                  feature_cols=["features"], label_cols=["label"], batch_size=16, random_seed=1, verbose=1)
    params.update(kw)
    return TorchEstimator(**params)


def snapshot():
    found = {}
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            try:
                stat = os.stat(path)
            except FileNotFoundError:
                continue
            found[path] = (stat.st_mtime_ns, stat.st_size)
    return found


out = {}
print("fitting", file=sys.stderr, flush=True)
started = time.monotonic()
try:
    estimator(run_id="long", epochs=500, checkpoint_steps=50).fit(df)
    out["interrupted"] = False
except KeyboardInterrupt:
    out["interrupted"] = True
    out["raised_after_s"] = time.monotonic() - started
    if kind == "classic":  # a Connect client has no status tracker: there the still store says the ranks stopped
        tracker = spark.sparkContext.statusTracker()
        stop = time.monotonic()
        while tracker.getActiveJobsIds() and time.monotonic() - stop < 60:
            time.sleep(0.2)
        out["jobs_active_after_s"] = time.monotonic() - stop
        out["active_jobs"] = list(tracker.getActiveJobsIds())
    time.sleep(2)  # the killed workers' last writes (none expected)
    before = snapshot()
    time.sleep(5)  # a rank still training would write a checkpoint every 50 steps (a fraction of a second)
    after = snapshot()
    out["changed"] = sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))
    with open(os.path.join(root, "runs", "long", "progress.json")) as f:
        out["done"] = len(json.load(f))  # epochs the interrupted launch finished
out["after_interrupt_stderr_mark"] = True
print("---after---", file=sys.stderr, flush=True)
began = time.monotonic()
short = estimator(run_id="short", epochs=2).fit(df)
out["new_fit_s"] = time.monotonic() - began
out["new_fit_epochs"] = len(short.getHistory())
began = time.monotonic()
resumed = estimator(run_id="long", epochs=out.get("done", 0) + 1, checkpoint_steps=50).fit(df)
out["resumed_fit_s"] = time.monotonic() - began
out["resumed_epochs"] = len(resumed.getHistory())
print(json.dumps(out), flush=True)
spark.stop()
