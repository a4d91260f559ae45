"""Preference tuning after SFT: a causal LM fine-tuned (LoRA, 2 Spark barrier tasks) on facts with the wrong
colours writes them; saved as a merged folder, it is then tuned with DPO on pairs whose chosen answer is the
right colour and whose rejected answer is the one it learned, and writes the right colours.

    python notebooks/dpo_example.py [--workdir /tmp/dpo-example]

The model: the tiny Llama of sft_example.py (built and saved here with `save_pretrained`, the stand-in for a
downloaded checkpoint). The facts are made up ("What color is the kettle?" -> " The kettle is red."), each
noun red or blue: the SFT model is taught the other colour.
"""
from __future__ import annotations

import argparse
import functools
import logging
import os
import random
import sys
import tempfile

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # executors use this interpreter (and its torch)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from sft_example import color_facts, save_pretrained_llama  # noqa: E402

PAIR = ("red", "blue")  # each noun is one of two colours


def two_colour_facts(seed=0):
    """(right, wrong) facts: each noun's colour, one of PAIR drawn at random, and the other one."""
    rng, right, wrong = random.Random(seed), [], []
    for prompt, response in color_facts():
        noun = response[len(" The "):].split(" is ")[0]
        colour = rng.choice(PAIR)
        right.append((prompt, f" The {noun} is {colour}."))
        wrong.append((prompt, f" The {noun} is {PAIR[1 - PAIR.index(colour)]}."))
    return right, wrong


def main(argv=None) -> float:
    from peft import LoraConfig
    from pyspark.sql import SparkSession
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from estimator import DPO, TorchEstimator
    from store import Store

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "dpo-example"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("py4j").setLevel(logging.WARNING)
    spark = SparkSession.builder.master("local[2]").appName("dpo-example").getOrCreate()
    right, wrong = two_colour_facts()
    base = save_pretrained_llama(os.path.join(args.workdir, "tiny-llama"),
                                 [p + r for p, r in right + wrong] * 2, layers=3)
    store = Store.create(os.path.join(args.workdir, "runs"))
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")

    # First SFT on the wrong colours, saved with its adapters merged: the model DPO starts from.
    sft_df = spark.createDataFrame(wrong, "prompt string, response string")
    sft = TorchEstimator(
        num_proc=2, store=store,
        model=functools.partial(AutoModelForCausalLM.from_pretrained, base),
        tokenizer=AutoTokenizer.from_pretrained(base), peft_config=lora,
        optimizer=functools.partial(torch.optim.AdamW, lr=5e-3),
        lr_schedule="linear",
        feature_cols=["prompt"], label_cols=["response"],
        batch_size=2, epochs=40, max_new_tokens=16, verbose=0,
    ).fit(sft_df)
    sft_folder = os.path.join(args.workdir, "sft-merged")
    sft.save_pretrained(sft_folder)
    before = {r.prompt: r.prediction for r in sft.transform(sft_df).collect()}

    # --8<-- [start:dpo]
    pairs_df = spark.createDataFrame(
        [(p, r, w) for (p, r), (_, w) in zip(right, wrong)],
        "prompt string, chosen string, rejected string",
    )
    est = TorchEstimator(
        num_proc=2, store=store,
        model=functools.partial(
            AutoModelForCausalLM.from_pretrained, sft_folder
        ),
        tokenizer=AutoTokenizer.from_pretrained(sft_folder),
        peft_config=LoraConfig(
            r=16, lora_alpha=32, target_modules="all-linear",
            task_type="CAUSAL_LM",
        ),
        optimizer=functools.partial(torch.optim.AdamW, lr=2e-3),
        objective=DPO(beta=0.1, sft_weight=1.0),
        feature_cols=["prompt"], label_cols=["chosen", "rejected"],
        batch_size=2, epochs=30, max_new_tokens=16,
    )
    tuned = est.fit(pairs_df)
    answers = tuned.transform(pairs_df.select("prompt", "chosen"))
    # --8<-- [end:dpo]

    rows = answers.collect()
    last = tuned.getHistory()[-1]
    print("epoch {:.0f}: loss {:.4f}, rewards/accuracies {:.2f}, rewards/margins {:.2f}".format(
        last["epoch"], last["loss"], last["rewards/accuracies"], last["rewards/margins"]))
    for row in rows[:3]:
        print(f"{row.prompt!r}: after SFT {before[row.prompt]!r}, after DPO {row.prediction!r}")
    taught = sum(before[p] == w for p, w in wrong) / len(wrong)
    switched = sum(row.prediction == row.chosen for row in rows) / len(rows)
    print(f"After SFT, wrong colours written: {taught:.2f}")
    print(f"After DPO, right colours written: {switched:.2f}")
    spark.stop()
    return switched


if __name__ == "__main__":
    main()
