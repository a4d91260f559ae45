"""Several GPUs per Spark task, without a GPU (as pyspark's own TorchDistributor tests do):
`python gpus_per_task_job.py DISCOVERY_SCRIPT STORE CASE`. A local-cluster executor with 2 cores and the GPU
addresses the discovery script reports. CASE "per_task": 2 GPUs per task, num_proc=4: 2 tasks of 2 ranks each,
then in the same session a fit whose rank 3 raises (no retry) and one whose rank 2's process exits (one retry);
"shared": half a GPU per task (two ranks on one address).
Prints one JSON line: {"fit": ..., "failure": ..., "retry": ...} ("fit" only for "shared")."""
import json
import os
import sys

import torch
from sklearn.datasets import load_digits
from torch import nn

from estimator import TorchEstimator
from estimator.core.faults import ENV
from estimator.failures import RankFailed
from store import Store

from gpu_jobs import gpu_session, kept_log_lines  # noqa: E402 - beside this script

script, store_path, case = sys.argv[1:4]
amount = "0.5" if case == "shared" else "2"
executor_gpus = "1" if case == "shared" else "4"
spark = gpu_session(f"gpus-per-task-{case}", script, executor_gpus, amount, memory_mb=2048)
records = kept_log_lines()

digits = load_digits()
rows = [((x / 16.0).astype("float32").tolist(), int(y)) for x, y in zip(digits.data, digits.target)]
df = spark.createDataFrame(rows, "features array<float>, label long").repartition(4)


def fit(part, retries=0, faults=None):
    """One fit, with the log lines it kept and the faults the driver hands its ranks (read at each launch)."""
    first = len(records)
    os.environ.pop(ENV, None)
    if faults:
        os.environ[ENV] = json.dumps(faults)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    estimator = TorchEstimator(num_proc=4 if amount == "2" else 2, store=Store.create(store_path), model=model,
                               optimizer=torch.optim.Adam(model.parameters(), lr=0.01), loss=nn.CrossEntropyLoss(),
                               feature_cols=["features"], label_cols=["label"], epochs=3, batch_size=32,
                               validation=0.2, metrics=["accuracy"], random_seed=1, max_retries=retries)
    out = {}
    try:
        fitted = estimator.fit(df)
        out["val_accuracy"] = fitted.getHistory()[-1]["val_accuracy"]
        if part == "fit" and case == "per_task":  # what is refused before any job, and what transform says
            for wrong in (dict(num_proc=3), dict(data_mode="direct")):
                try:
                    estimator.copy(estimator.extractParamMap()).setParams(**wrong).fit(df)
                except ValueError as exc:
                    out.setdefault("refused", []).append(str(exc))
            out["transformed"] = fitted.transform(df).count()
            out["transform_said"] = [r for r in records[first:] if r.startswith("transform runs")]
    except RankFailed as exc:
        out["error"] = str(exc).splitlines()[0]
        out["kind"] = exc.kind.value
    kept = records[first:]
    out["assigned"] = sorted(r for r in kept if "Spark assigned GPU" in r)
    out["tasks"] = [r for r in kept if "Spark tasks of" in r]
    out["retried"] = [r.splitlines()[0] for r in kept if "retrying from its last checkpoint" in r]
    return out


out = {"pid": os.getpid(), "fit": fit("fit")}
if case == "per_task":
    out["failure"] = fit("failure", faults=[{"point": "step", "rank": 3, "action": "raise", "step": 5}])
    out["retry"] = fit("retry", retries=1, faults=[{"point": "step", "rank": 2, "action": "exit", "step": 5,
                                                    "attempt": 0}])
os.environ.pop(ENV, None)
print(json.dumps(out))
spark.stop()
