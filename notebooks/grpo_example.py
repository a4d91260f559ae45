"""Reinforcement fine-tuning with GRPO on 2 Spark barrier tasks: a causal LM that names one of two colours for
each noun, about half of them wrong, learns the right ones from a reward function that checks its completions
against the table's `answer` column. No right answer is ever shown to it: it is only told which of its own
answers scored.

    python notebooks/grpo_example.py [--epochs 30] [--workdir /tmp/grpo-example]

The base: the tiny Llama of sft_example.py, trained here for a few seconds (a plain loop) to write either
colour of PAIR for every noun, " The kettle is red." as often as " The kettle is blue.": the stand-in for a
pretrained model that knows the form of an answer but not the facts.
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


def right_colour(prompts, completions, answer, **kwargs):
    """The reward: 1.0 where the completion is the sentence with the row's answer ("What color is the kettle?" ->
    " The kettle is red."), else 0.0. Called as TRL calls one: a list per argument, an item per completion."""
    return [1.0 if c == f" The {p.split()[-1][:-1]} is {a}." else 0.0
            for p, c, a in zip(prompts, completions, answer)]


def questions(seed=0):
    """(prompt, answer): each noun's colour, half of them each of PAIR, drawn at random."""
    facts = color_facts()
    colours = [PAIR[i % 2] for i in range(len(facts))]
    random.Random(seed).shuffle(colours)
    return [(prompt, colour) for (prompt, _), colour in zip(facts, colours)]


def unsure_base(folder):
    """The base: a tiny Llama trained on every noun with both colours, saved with save_pretrained."""
    texts = [(p, r.replace(r.split(" is ")[1], f"{c}.")) for p, r in color_facts() for c in PAIR]
    return trained_plainly(save_pretrained_llama(folder, [p + r for p, r in texts]), texts, 30)


def trained_plainly(path, texts, epochs):
    """The model saved at `path` trained on the (prompt, response) `texts` whole in a plain loop (AdamW at 3e-3,
    batches of 8), saved back."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rows = [tokenizer(p + r)["input_ids"] + [tokenizer.eos_token_id] for p, r in texts]
    for epoch in range(epochs):
        random.Random(epoch).shuffle(rows)
        for start in range(0, len(rows), 8):
            part = rows[start:start + 8]
            width = max(map(len, part))
            ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in part])
            labels = torch.tensor([r + [-100] * (width - len(r)) for r in part])
            model(input_ids=ids, attention_mask=(labels != -100).long(), labels=labels).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    model.save_pretrained(path)
    return path


def run(spark, workdir, epochs=30, seed=0):
    """The base's greedy answers, the GRPO fit, the fitted model's answers: the share right before and after, the
    history and a few answers."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from estimator import GRPO, TorchEstimator, TorchModel
    from store import Store

    path = unsure_base(os.path.join(workdir, "tiny-llama"))
    table = spark.createDataFrame(questions(), "prompt string, answer string")
    base = TorchModel(model=functools.partial(AutoModelForCausalLM.from_pretrained, path),
                      tokenizer=AutoTokenizer.from_pretrained(path), feature_cols=["prompt"],
                      output_kind="generate", max_new_tokens=8)
    before = base.transform(table).collect()

    # --8<-- [start:grpo]
    est = TorchEstimator(
        num_proc=2, store=Store.create(os.path.join(workdir, "runs")),
        model=functools.partial(AutoModelForCausalLM.from_pretrained, path),
        tokenizer=AutoTokenizer.from_pretrained(path),
        peft_config=LoraConfig(
            r=16, lora_alpha=32, target_modules="all-linear",
            task_type="CAUSAL_LM",
        ),
        optimizer=functools.partial(torch.optim.AdamW, lr=5e-3),
        # 8 completions a prompt, each scored by right_colour; the KL
        # term (beta) keeps a prompt's group from collapsing to one answer
        objective=GRPO(
            right_colour, num_generations=8, max_new_tokens=8, beta=0.04
        ),
        # the prompt, and the column the reward reads
        feature_cols=["prompt"], label_cols=["answer"],
        batch_size=2, epochs=epochs, max_new_tokens=8, lr_schedule="linear",
        random_seed=seed,  # the completions' sampling: a run to repeat
    )
    fitted = est.fit(table)
    # greedy answers, as for any fitted causal LM
    after = fitted.transform(table).collect()
    # --8<-- [end:grpo]

    def share(rows):
        return sum(right_colour([r.prompt], [r.prediction], [r.answer])[0] for r in rows) / len(rows)

    return {"before": share(before), "after": share(after), "history": fitted.getHistory(),
            "answers": [(r.prompt, r.answer, r.prediction) for r in after[:3]]}


def main(argv=None) -> float:
    from pyspark.sql import SparkSession

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "grpo-example"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("py4j").setLevel(logging.WARNING)
    spark = SparkSession.builder.master("local[2]").appName("grpo-example").getOrCreate()
    result = run(spark, args.workdir, args.epochs)
    for row in result["history"]:
        print(f"epoch {row['epoch']:.0f}: reward {row['reward']:.3f} (std {row['reward_std']:.3f}), "
              f"completions/mean_length {row['completions/mean_length']:.1f}")
    for prompt, answer, prediction in result["answers"]:
        print(f"{prompt!r} ({answer}) -> {prediction!r}")
    print(f"Before GRPO, right colours written: {result['before']:.2f}")
    print(f"After GRPO, right colours written: {result['after']:.2f}")
    spark.stop()
    return result["after"]


if __name__ == "__main__":
    main()
