"""The manual's figures, made from the code and from a real run (matplotlib, which the test extra brings):

    .venv/bin/python benchmarks/figures.py [--out docs/img] [--epochs 8]

- fit.svg: what a fit does (the driver, the store, the barrier tasks and their ranks);
- digits-history.svg: the loss and validation accuracy per epoch of notebooks/digits_example.py's CNN, trained
  here on 2 ranks (local[2]) with its settings; the history it plots is written beside it as JSON.
SVG files without dates or random ids: running this again changes them only where the run's numbers changed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

import matplotlib  # noqa: E402

matplotlib.use("Agg")
matplotlib.rcParams["svg.hashsalt"] = "spark-torch-estimator"  # stable ids
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INK, DRIVER, STORE, RANK = "#263238", "#e3f2fd", "#fff8e1", "#e8f5e9"


def box(ax, x, y, w, h, title, lines, color):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08", fc=color, ec=INK,
                                lw=1.2))
    ax.text(x + w / 2, y + h - 0.18, title, ha="center", va="top", fontsize=11, weight="bold", color=INK)
    ax.text(x + w / 2, y + h - 0.52, "\n".join(lines), ha="center", va="top", fontsize=8.5, color=INK,
            linespacing=1.5)


def arrow(ax, start, end, label, offset=(0, 0.12), style="-|>"):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=12, lw=1.1, color=INK))
    ax.text((start[0] + end[0]) / 2 + offset[0], (start[1] + end[1]) / 2 + offset[1], label, ha="center",
            va="bottom", fontsize=8, color=INK, style="italic")


def fit_diagram(path: str) -> None:
    fig, ax = plt.subplots(figsize=(9, 4.6))
    ax.set_xlim(0, 9)
    ax.set_ylim(0, 4.6)
    ax.axis("off")
    box(ax, 0.2, 2.5, 2.6, 1.9, "Driver", ["TorchEstimator.fit(df)", "checks params, columns, slots",
                                           "dry run on a few rows", "returns a TorchModel"], DRIVER)
    box(ax, 0.2, 0.2, 2.6, 1.6, "Store", ["Parquet: the DataFrame, once", "checkpoints, progress",
                                          "local, HDFS, S3, ABFS"], STORE)
    box(ax, 3.9, 0.2, 4.9, 4.2, "", [], "#fafafa")
    ax.text(6.35, 4.3, "Spark barrier job: num_proc tasks, started together", ha="center", va="top", fontsize=9.5,
            color=INK)
    for i, y in enumerate((2.45, 0.45)):
        box(ax, 4.2, y, 4.3, 1.45, f"rank {i}" + (" (writes checkpoints)" if i == 0 else ""),
            [f"reads shard {i} of the Parquet", "forward, loss, backward, step", "DDP / FSDP2 (torch.distributed)"],
            RANK)
    arrow(ax, (6.35, 2.45), (6.35, 1.9), "", style="<|-|>")
    ax.text(6.5, 2.17, "gradients all-reduced", ha="left", va="center", fontsize=8, color=INK, style="italic")
    arrow(ax, (1.5, 2.5), (1.5, 1.8), "materialize", offset=(-0.55, -0.12))
    arrow(ax, (2.8, 3.6), (4.2, 3.6), "launch", offset=(0, 0.05))
    arrow(ax, (4.2, 1.1), (2.8, 1.1), "shards, checkpoints", offset=(0, 0.05), style="<|-|>")
    arrow(ax, (4.2, 2.9), (2.8, 2.9), "epochs, results", offset=(0, -0.3))
    fig.savefig(path, format="svg", metadata={"Date": None}, bbox_inches="tight")
    plt.close(fig)


def digits_history(epochs: int) -> list:
    """notebooks/digits_example.py's fit (its Net, data and settings) on local[2]: its history."""
    sys.path.insert(0, os.path.join(ROOT, "notebooks"))
    from digits_example import Net, digits_frames  # noqa: E402
    import torch
    from pyspark.sql import SparkSession
    from torch import nn, optim

    from estimator import TorchEstimator
    from store import Store

    spark = SparkSession.builder.master("local[2]").getOrCreate()
    try:
        train_df, _ = digits_frames(spark)
        torch.manual_seed(0)
        model = Net()
        with tempfile.TemporaryDirectory() as folder:
            est = TorchEstimator(num_proc=2, store=Store.create(folder), model=model,
                                 optimizer=optim.Adam(model.parameters(), lr=0.01), loss=nn.CrossEntropyLoss(),
                                 metrics=["accuracy"], feature_cols=["features"], label_cols=["label"],
                                 input_shapes=[[-1, 1, 8, 8]], batch_size=64, epochs=epochs, validation=0.1,
                                 random_seed=0, verbose=0)
            return est.fit(train_df).getHistory()
    finally:
        spark.stop()


def history_plot(history: list, path: str) -> None:
    epochs = [row["epoch"] for row in history]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2))
    left.plot(epochs, [r["loss"] for r in history], "o-", label="loss (training)")
    left.plot(epochs, [r["val_loss"] for r in history], "s--", label="val_loss")
    left.set_xlabel("epoch")
    left.set_title("cross entropy")
    left.legend()
    right.plot(epochs, [r["accuracy"] for r in history], "o-", label="accuracy (training)")
    right.plot(epochs, [r["val_accuracy"] for r in history], "s--", label="val_accuracy")
    right.set_xlabel("epoch")
    right.set_title("accuracy")
    right.legend()
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.suptitle("digits CNN on 2 ranks: getHistory() of one fit", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, format="svg", metadata={"Date": None})
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "img"))
    parser.add_argument("--epochs", type=int, default=8)
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    fit_diagram(os.path.join(args.out, "fit.svg"))
    history = digits_history(args.epochs)
    with open(os.path.join(args.out, "digits-history.json"), "w") as handle:
        json.dump([{k: round(float(v), 4) for k, v in row.items()} for row in history], handle, indent=1)
    history_plot(history, os.path.join(args.out, "digits-history.svg"))
    print(f"figures written to {args.out}: fit.svg, digits-history.svg (final val_accuracy "
          f"{history[-1]['val_accuracy']:.4f})")


if __name__ == "__main__":
    main()
