"""The manual's figures, made from the code and from a real run (matplotlib, which the test extra brings):

    .venv/bin/python benchmarks/figures.py [--out docs/img] [--epochs 8] [--diagrams-only]

- fit.svg: what a fit does (the driver, the store, the barrier tasks and their ranks);
- shards.svg: the ranks, their shards of the materialized Parquet, and the store;
- retry.svg: the checkpoint and retry cycle (a rank fails, the launch is retried from the last checkpoint);
  the diagrams are drawn tall and narrow, their text readable on a phone (390 px wide);
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


def tall(height: float):
    """A figure 4.4 in wide (a phone's 390 px at about 0.9 of its size): 11-13 pt text stays readable."""
    fig, ax = plt.subplots(figsize=(4.4, height))
    ax.set_xlim(0, 4.4)
    ax.set_ylim(0, height)
    ax.axis("off")
    return fig, ax


def card(ax, x, y, w, h, title, lines, color):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08", fc=color, ec=INK,
                                lw=1.2))
    ax.text(x + w / 2, y + h - 0.12, title, ha="center", va="top", fontsize=13, weight="bold", color=INK)
    ax.text(x + w / 2, y + h - 0.5, "\n".join(lines), ha="center", va="top", fontsize=11, color=INK,
            linespacing=1.35)


def down(ax, x, top, bottom, label, side=0.12):
    ax.add_patch(FancyArrowPatch((x, top), (x, bottom), arrowstyle="-|>", mutation_scale=14, lw=1.3, color=INK))
    ax.text(x + side, (top + bottom) / 2, label, ha="left", va="center", fontsize=11, color=INK, style="italic")


def save(fig, path):
    fig.savefig(path, format="svg", metadata={"Date": None}, bbox_inches="tight")
    plt.close(fig)


def fit_diagram(path: str) -> None:
    fig, ax = tall(7.4)
    card(ax, 0.2, 5.75, 4.0, 1.55, "Driver", ["TorchEstimator.fit(df): checks", "params, columns, slots; a dry run",
                                              "returns a TorchModel"], DRIVER)
    down(ax, 2.2, 5.75, 5.2, "materialize, once")
    card(ax, 0.2, 3.95, 4.0, 1.25, "Store", ["Parquet of the DataFrame,", "checkpoints, progress"], STORE)
    down(ax, 2.2, 3.95, 3.4, "launch: a barrier job")
    box_y = 0.1
    ax.add_patch(FancyBboxPatch((0.2, box_y), 4.0, 3.3, boxstyle="round,pad=0.02,rounding_size=0.08", fc="#fafafa",
                                ec=INK, lw=1.0))
    ax.text(2.2, 3.3, "num_proc tasks, started together", ha="center", va="top", fontsize=11, color=INK)
    for i, y in enumerate((1.85, 0.25)):
        card(ax, 0.4, y, 3.6, 1.2, f"rank {i}" + (" (checkpoints)" if i == 0 else ""),
             [f"reads shard {i}; forward, loss,", "backward, step (DDP or FSDP2)"], RANK)
    ax.text(2.35, 1.65, "gradients all-reduced", ha="left", va="center", fontsize=10, color=INK, style="italic")
    ax.add_patch(FancyArrowPatch((2.2, 1.85), (2.2, 1.45), arrowstyle="<|-|>", mutation_scale=12, lw=1.2,
                                 color=INK))
    save(fig, path)


def shards_diagram(path: str) -> None:
    fig, ax = tall(7.0)
    card(ax, 0.2, 5.4, 4.0, 1.5, "Store", ["runs/<run_id>/: checkpoints", "data/<key>/: the Parquet,",
                                           "written once, reused"], STORE)
    ax.text(2.2, 5.0, "row groups\ndealt to\nthe ranks", ha="center", va="center", fontsize=11, color=INK,
            style="italic")
    for i, x in enumerate((0.2, 2.3)):
        ax.add_patch(FancyArrowPatch((x + 0.95, 5.4), (x + 0.95, 4.6), arrowstyle="-|>", mutation_scale=14,
                                     lw=1.3, color=INK))
        card(ax, x, 2.6, 1.9, 2.0, f"shard {i}", ["its row groups;", "in memory or", "streamed"], STORE)
        ax.add_patch(FancyArrowPatch((x + 0.95, 2.6), (x + 0.95, 1.9), arrowstyle="-|>", mutation_scale=14,
                                     lw=1.3, color=INK))
        card(ax, x, 0.1, 1.9, 1.8, f"rank {i}", ["equal steps:", "the same batch", "count each"], RANK)
    ax.text(2.2, 2.25, "shuffled\nper epoch", ha="center", va="center", fontsize=11, color=INK, style="italic")
    save(fig, path)


def retry_diagram(path: str) -> None:
    fig, ax = tall(7.6)
    card(ax, 0.2, 6.1, 4.0, 1.35, "Training", ["rank 0 writes a checkpoint", "every checkpoint_steps / epoch"],
         RANK)
    down(ax, 2.2, 6.1, 5.55, "a rank fails or is lost")
    card(ax, 0.2, 4.2, 4.0, 1.35, "The job ends", ["every task stops; the error", "is typed (RankFailed.kind)"],
         "#ffebee")
    down(ax, 2.2, 4.2, 3.65, "retryable, max_retries left")
    card(ax, 0.2, 2.3, 4.0, 1.35, "Relaunch", ["a new barrier job (fewer", "ranks: min_num_proc)"], DRIVER)
    down(ax, 2.2, 2.3, 1.75, "read the last checkpoint")
    card(ax, 0.2, 0.1, 4.0, 1.65, "Resume", ["at its step, inside an epoch;", "the rest of the epoch's rows",
                                             "once each"], STORE)
    ax.add_patch(FancyArrowPatch((0.2, 0.9), (0.2, 6.8), connectionstyle="arc3,rad=-0.3", arrowstyle="-|>",
                                 mutation_scale=14, lw=1.3, color=INK, clip_on=False))  # back to training, on the left
    save(fig, path)


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
    parser.add_argument("--diagrams-only", action="store_true", help="the diagrams, not the trained history")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    fit_diagram(os.path.join(args.out, "fit.svg"))
    shards_diagram(os.path.join(args.out, "shards.svg"))
    retry_diagram(os.path.join(args.out, "retry.svg"))
    if args.diagrams_only:
        return
    history = digits_history(args.epochs)
    with open(os.path.join(args.out, "digits-history.json"), "w") as handle:
        json.dump([{k: round(float(v), 4) for k, v in row.items()} for row in history], handle, indent=1)
    history_plot(history, os.path.join(args.out, "digits-history.svg"))
    print(f"figures written to {args.out}: fit.svg, digits-history.svg (final val_accuracy "
          f"{history[-1]['val_accuracy']:.4f})")


if __name__ == "__main__":
    main()
