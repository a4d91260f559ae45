"""Fine-tuning on a text column: rows/s of 2 ranks that tokenize on the ranks (the reader's workers, padded per
batch) against a plain single-process loop over pre-tokenized tensors, and the fraction of training time the
ranks waited for batches (target <= 10%). On this machine; numbers, not assertions (RESULTS.md by hand).

    .venv/bin/python benchmarks/bench_text.py [--rows 6000] [--repeat 3] [--json benchmarks/results_text.json]

The model: a BERT from a BertConfig with a WordPiece tokenizer trained by `tokenizers` (the text example's
builder), saved with save_pretrained, in two sizes: 'tiny' (hidden 32, 2 layers: the worst case for data wait,
little compute per token) and 'small' (hidden 128, 4 layers). Texts: 5 generated topic sentences each (about 50
words, truncated at 64 tokens). One epoch, batch 32 per rank, AdamW.
  ours:            TorchEstimator(num_proc=2, tokenizer=...).fit(df): train rows/s = train_rows / train_s of the
                   fit's stages (the launch and materialization are not in it), data_wait_fraction as logged.
  plain, pre-tok.: one process with every core, batches of 64 (= 2 ranks x 32) tokenized before the clock starts.
  plain, tokenizing: the same loop tokenizing each batch on the training thread (a hand-written loop's way).
"""
from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "notebooks"))
from bench import CORES, Stages, spread, table  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

SIZES = {"tiny": dict(hidden=32, layers=2), "small": dict(hidden=128, layers=4)}


def texts(rows, seed=0):
    from text_example import topic_texts

    sentences = topic_texts(rows * 5, seed=seed)
    return [(" ".join(t for t, _ in sentences[i * 5:(i + 1) * 5]), sentences[i * 5][1]) for i in range(rows)]


def build(folder, rows, size):
    from text_example import save_pretrained_bert

    return save_pretrained_bert(folder, [t for t, _ in rows[:2000]], dropout=0.1, **SIZES[size])


def ours(spark, store, path, rows, batch, strategy="ddp"):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from estimator import TorchEstimator

    df = spark.createDataFrame(rows, "text string, label long").repartition(2)
    stages = Stages()
    logging.getLogger("estimator").addHandler(stages)
    logging.getLogger("estimator").setLevel(logging.INFO)
    try:
        TorchEstimator(num_proc=2, store=store, strategy=strategy,
                       model=functools.partial(AutoModelForSequenceClassification.from_pretrained, path),
                       optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
                       tokenizer=AutoTokenizer.from_pretrained(path),
                       loss=nn.CrossEntropyLoss(), feature_cols=["text"], label_cols=["label"], batch_size=batch,
                       epochs=1, random_seed=1, verbose=0).fit(df)
    finally:
        logging.getLogger("estimator").removeHandler(stages)
    s = stages.last
    return {"rows_per_s": s["train_rows"] / s["train_s"], "epoch_rows_per_s": s["train_rows"] / s["epochs_s"],
            "data_wait": s["data_wait_fraction"]}


def plain(path, rows, batch, pretokenized):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.set_num_threads(CORES)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(path).train()
    tokenizer = AutoTokenizer.from_pretrained(path)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    chunks = [rows[i:i + batch] for i in range(0, len(rows), batch)]
    encode = lambda chunk: (tokenizer([t for t, _ in chunk], padding="longest", truncation=True,  # noqa: E731
                                      return_tensors="pt"), torch.tensor([y for _, y in chunk]))
    ready = [encode(c) for c in chunks] if pretokenized else None
    started = time.perf_counter()
    for i, chunk in enumerate(chunks):
        encoded, labels = ready[i] if pretokenized else encode(chunk)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(**encoded).logits, labels).backward()
        optimizer.step()
    return {"rows_per_s": len(rows) / (time.perf_counter() - started)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=6000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    from store import Store

    spark = (SparkSession.builder.master("local[2]").appName("bench-text").config("spark.ui.enabled", "false")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    work = tempfile.mkdtemp(prefix="bench-text-")
    store = Store.create(os.path.join(work, "store"))
    rows, results = texts(args.rows), []
    for size in SIZES:
        path = build(os.path.join(work, size), rows, size)
        runs = {"ours": [], "plain_pretokenized": [], "plain_tokenizing": []}
        for _ in range(args.repeat):
            runs["ours"].append(ours(spark, store, path, rows, args.batch))
            runs["plain_pretokenized"].append(plain(path, rows, 2 * args.batch, True))
            runs["plain_tokenizing"].append(plain(path, rows, 2 * args.batch, False))
        for what, found in runs.items():
            speeds = [r["rows_per_s"] for r in found]
            waits = [r["data_wait"] for r in found if "data_wait" in r]
            results.append({"model": size, "what": what, "rows/s": statistics.median(speeds),
                            "range": spread(speeds), "data wait": statistics.median(waits) if waits else "",
                            "wait range": spread(waits)})
            print(results[-1], flush=True)
    spark.stop()
    table(f"Text fine-tuning, {args.rows} rows of ~50 words, 1 epoch, batch {args.batch} per rank; medians of "
          f"{args.repeat} ({CORES} cores)", results, ["model", "what", "rows/s", "range", "data wait", "wait range"])
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"date": time.strftime("%Y-%m-%d"), "rows": args.rows, "results": results}, handle, indent=1)


if __name__ == "__main__":
    main()
