"""What a user's console shows during fits, in local mode with Spark's default log settings (no setLogLevel):
`python console_job.py fail|quiet STORE`. Writes `=== <name>` markers to stderr around each fit.
  fail:  rank 1 raises at its 4th step, on every launch (max_retries=3: the second failure, the same as the first,
         ends the fit); the fit's RankFailed is caught and its first line printed to stdout.
  quiet: tensorboard made unimportable; fits with verbose=0, 0, 1, 1 (nothing said about TensorBoard: optional),
         then a transform of the last; prints `transform: N rows` and `driver imported: [...]`.
The model's forward raises where a language-model package (peft, transformers, bitsandbytes) is imported: a
classic fit and transform must not import them, on the driver (its dry run), the ranks or the executors."""
import os
import sys

mode, store_path = sys.argv[1], sys.argv[2]
if mode == "quiet":
    sys.modules["tensorboard"] = None  # as if not installed

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
from pyspark.sql import SparkSession  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from torch import nn, optim  # noqa: E402

from estimator import TorchEstimator  # noqa: E402
from store import Store  # noqa: E402

spark = SparkSession.builder.master("local[2]").getOrCreate()
digits = load_digits()
rows = [((x / 16).tolist(), int(y)) for x, y in zip(digits.data[:600], digits.target[:600])]
df = spark.createDataFrame(rows, "features array<float>, label long")


def flaky(output, target):
    flaky.calls = getattr(flaky, "calls", 0) + 1
    if os.environ.get("RANK") == "1" and flaky.calls > 3:
        raise ArithmeticError("rank 1 exploded at step 3")
    return nn.functional.cross_entropy(output, target)


LM_PACKAGES = ("peft", "transformers", "bitsandbytes")


class Guarded(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))

    def forward(self, x):
        imported = [name for name in LM_PACKAGES if name in sys.modules]
        if imported:
            raise RuntimeError(f"a classic model's process imported {imported}")
        return self.net(x)


def fit(name, **kw):
    model = Guarded()
    params = dict(num_proc=2, store=Store.create(store_path), model=model, epochs=2, batch_size=32,
                  optimizer=optim.SGD(model.parameters(), lr=0.1), loss=nn.CrossEntropyLoss(),
                  feature_cols=["features"], label_cols=["label"])
    params.update(kw)
    print(f"=== {name} begins", file=sys.stderr, flush=True)
    try:
        fitted = TorchEstimator(**params).fit(df)
    except Exception as exc:  # noqa: BLE001 - what the user sees
        print(f"=== {name} raised", file=sys.stderr, flush=True)
        print(f"{type(exc).__name__}: {str(exc).splitlines()[0]}", flush=True)
        return None
    print(f"=== {name} returned", file=sys.stderr, flush=True)
    return fitted


if mode == "fail":
    fit("failing fit", loss=flaky, max_retries=3)
else:
    for i, verbose in enumerate([0, 0, 1, 1]):
        fitted = fit(f"fit {i} verbose={verbose}", verbose=verbose)
    try:
        print(f"transform: {len(fitted.transform(df.limit(64)).collect())} rows", flush=True)
    except Exception as exc:  # noqa: BLE001
        print(f"transform raised {type(exc).__name__}: {str(exc).splitlines()[0]}", flush=True)
    print(f"driver imported: {[name for name in LM_PACKAGES if name in sys.modules]}", flush=True)
spark.stop()
