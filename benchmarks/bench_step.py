"""Our step against hand-written loops on 2 CPU ranks (gloo): a small BERT (hidden 128, 4 layers, the text
example's builder) fine-tuned for one epoch, ddp and fsdp. Numbers, not assertions (RESULTS.md by hand).

    .venv/bin/python benchmarks/bench_step.py [--rows 4000] [--repeat 3] [--json benchmarks/results_step.json]

  ours:        TorchEstimator(num_proc=2, strategy=..., tokenizer=...).fit(df) on local[2], tokenizing on the
               ranks: train rows/s = train_rows / train_s of the fit's stages (the ranks' whole work: the model
               built and sharded, the epoch, the checkpoint written; not the launch nor the materialization), and
               train_rows / epochs_s (the training pass alone, as the plain loops are timed).
  plain DDP:   2 processes (torch.multiprocessing, gloo, one thread each, as Spark gives each task one core
               here), DistributedDataParallel, each rank its half of the rows in batches of 32 tokenized before
               the clock starts (padded per batch), AdamW; rows/s over the epoch, the slowest rank's time.
  plain FSDP2: the same loop with fully_shard on each encoder layer, then the model (our default units).
Runs alternate (ours, plain; ours, plain ...) so that the machine's drift falls on both.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "notebooks"))
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

import torch  # noqa: E402
from torch import nn  # noqa: E402

import bench_text  # noqa: E402
from bench_text import build, texts  # noqa: E402

BATCH = 32


def ours(spark, store, path, rows, strategy):
    return bench_text.ours(spark, store, path, rows, BATCH, strategy)


def _plain_rank(rank, path, rows, strategy, port, out):
    import torch.distributed as dist
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(path).train()
    if strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model.bert.encoder.layer:
            fully_shard(layer)
        fully_shard(model)
        trained = model
    else:
        trained = nn.parallel.DistributedDataParallel(model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mine = rows[rank::2]
    ready = [(tokenizer([t for t, _ in chunk], padding="longest", truncation=True, return_tensors="pt"),
              torch.tensor([y for _, y in chunk])) for chunk in (mine[i:i + BATCH] for i in range(0, len(mine), BATCH))]
    dist.barrier()
    started = time.perf_counter()
    for encoded, labels in ready:
        optimizer.zero_grad()
        nn.functional.cross_entropy(trained(**encoded).logits, labels).backward()
        optimizer.step()
    seconds = torch.tensor([time.perf_counter() - started])
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"rows_per_s": len(rows) / float(seconds)}, f)
    del trained
    dist.destroy_process_group()


def plain(path, rows, strategy):
    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = tempfile.mktemp(suffix=".json")
    mp.spawn(_plain_rank, args=(path, rows, strategy, port, out), nprocs=2)
    with open(out) as f:
        return json.load(f)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=4000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--strategies", default="ddp,fsdp")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    from pyspark.sql import SparkSession

    from store import Store

    work = tempfile.mkdtemp(prefix="bench-step-")
    rows = texts(args.rows)
    path = build(os.path.join(work, "bert"), rows, "small")
    spark = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    store = Store.create(os.path.join(work, "store"))
    results = {}
    for strategy in args.strategies.split(","):
        ours(spark, store, path, rows[:256], strategy)  # warm the Python workers
        runs = {"ours": [], "plain": []}
        for _ in range(args.repeat):
            runs["ours"].append(ours(spark, store, path, rows, strategy))
            runs["plain"].append(plain(path, rows, strategy))
        ratios = [o["rows_per_s"] / p["rows_per_s"] for o, p in zip(runs["ours"], runs["plain"])]
        results[strategy] = {**runs, "ratio_median": statistics.median(ratios), "ratios": ratios}
        loops = [o["epoch_rows_per_s"] / p["rows_per_s"] for o, p in zip(runs["ours"], runs["plain"])]
        results[strategy].update(epoch_ratio_median=statistics.median(loops), epoch_ratios=loops)
        print(f"{strategy}: ours {[round(r['rows_per_s']) for r in runs['ours']]} rows/s (the epoch alone "
              f"{[round(r['epoch_rows_per_s']) for r in runs['ours']]}) vs plain "
              f"{[round(r['rows_per_s']) for r in runs['plain']]}: {statistics.median(ratios):.2f}x (paired "
              f"{', '.join(f'{r:.2f}' for r in ratios)}; the epoch alone {statistics.median(loops):.2f}x)", flush=True)
    spark.stop()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
