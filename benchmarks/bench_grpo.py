"""Issue 66: GRPO with LoRA on the estimator's ranks (LocalLauncher, 2 ranks: no Spark) against TRL's GRPOTrainer
(one process) on the same base, prompts, reward, LoRA, group size, learning rate, clipping and steps, over seeds
(TRL only here: a benchmark dependency, never the package's; `--trl-python` names an interpreter that has trl).
Numbers, not assertions (RESULTS.md by hand).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_grpo.py [--seeds 3] [--epochs 20]
                                                          [--trl-python /work/venv-trl/bin/python] [--json F]
                                                          [--ways ours,trl] [--batch 2]

The base: the tests' tiny Llama (hidden 64, 2 layers), fine-tuned here (a plain loop, full weights) on three
answers per noun, " The kettle is teal." with its own colour and with two others, so that it writes each noun's
colour about one time in three. The task: 24 prompts "What color is the kettle?" with the `answer` column; the
reward 1.0 where the completion names the answer (" is teal"), else 0.0. GRPO: G = 8 completions a prompt, at
most 10 new tokens, temperature 1.0, LoRA r=4 (alpha 8) on every linear layer, AdamW at lr 1e-2 constant, the
gradient norm clipped at 1.0, beta 0, loss 'dapo', scale_rewards 'group', 4 prompts (32 completions) a step:
ours 2 ranks x 2 prompts, TRL one process of 32 completions (steps_per_generation 1). Reported per seed: the
mean reward of the first and last epochs (TRL: its logged 'reward' averaged over each epoch's steps), the
greedy answers right over the 24 prompts after training (computed here alike for both), and completions/s over
the training loop (ours: the ranks' training seconds; TRL: train_runtime).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
for extra in (os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "notebooks"),
              os.path.join(os.path.dirname(HERE), "tests")):
    sys.path.insert(0, extra)

LR, G, NEW_TOKENS, PROMPTS, RANKS, BATCH = 1e-2, 8, 10, 24, 2, 2


def right_colour(completions, answer, **_):
    """1.0 where the completion names the answer's colour."""
    return [1.0 if f" is {a}" in c else 0.0 for c, a in zip(completions, answer)]


def rows():
    """(prompt, answer): the first PROMPTS nouns, each with its colour."""
    from sft_example import color_facts

    return [(p, r[len(" The "):-1].split(" is ")[1]) for p, r in color_facts()[:PROMPTS]]


def build_base(folder):
    """The base: the tiny Llama fine-tuned on three colours per noun (its own and two others), saved."""
    from grpo_example import trained_plainly
    from sft_example import COLORS, color_facts, save_pretrained_llama

    facts = color_facts()
    rng = random.Random(5)
    texts = []
    for prompt, response in facts:
        noun, colour = response[len(" The "):-1].split(" is ")
        others = rng.sample([c for c in COLORS if c != colour], 2)
        texts += [(prompt, f" The {noun} is {c}.") for c in [colour, *others]]
    return trained_plainly(save_pretrained_llama(folder, [p + r for p, r in texts]), texts, 40)


def greedy_right(model, tokenizer, table):
    """The prompts whose greedy completion names their answer."""
    import torch

    right = 0
    with torch.no_grad():
        for prompt, answer in table:
            ids = tokenizer([prompt], return_tensors="pt")
            out = model.generate(**ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            right += right_colour([tokenizer.decode(out[0, ids["input_ids"].shape[1]:],
                                                    skip_special_tokens=True)], [answer])[0] == 1.0
    return right


def lora():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")


def ours(base, seed, epochs, work, batch=BATCH):
    from transformers import AutoTokenizer

    from estimator.launch.local import LocalLauncher
    from estimator.train.checkpoint import restore
    from estimator.train.objectives.grpo import GRPO
    from lm_helpers import lm_train_spec, plain_causal_lm
    from store import Store

    store = Store.create(os.path.join(work, f"ours-{seed}"))
    table = rows()
    objective = GRPO(right_colour, num_generations=G, max_new_tokens=NEW_TOKENS)
    spec = lm_train_spec(store, base, table, batch=batch, epochs=epochs, peft_config=lora(), lr=LR,
                         objective=objective, gradient_clip_val=1.0)
    spec = dataclasses.replace(spec, seed=seed)
    started = time.perf_counter()
    results = LocalLauncher().run(spec, RANKS)
    wall = time.perf_counter() - started
    history = results[0].history
    model = plain_causal_lm(base, lora(), seed=0)
    restore(store, store.run("r"), store.run("r").checkpoint, model, None)
    seconds = max(r.train_loop_seconds for r in results)  # the ranks' training loops (sampling included)
    return {"first_reward": history[0]["reward"], "last_reward": history[-1]["reward"],
            "greedy_right": greedy_right(model.eval(), AutoTokenizer.from_pretrained(base), table),
            "completions_per_s": len(table) * G * epochs / seconds, "seconds": seconds, "wall_seconds": wall}


def trl_child(args):
    """In the TRL interpreter: GRPOTrainer on the same rows; prints one JSON line."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    table = rows()
    tokenizer = AutoTokenizer.from_pretrained(args.path)
    model = AutoModelForCausalLM.from_pretrained(args.path)
    config = GRPOConfig(output_dir=args.work, per_device_train_batch_size=RANKS * BATCH * G, num_generations=G,
                        max_completion_length=NEW_TOKENS, temperature=1.0, learning_rate=LR,
                        lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, beta=0.0, loss_type="dapo",
                        scale_rewards="group", num_train_epochs=args.epochs, seed=args.seed, logging_steps=1,
                        report_to=[], save_strategy="no", use_cpu=True, bf16=False, dataloader_num_workers=0,
                        gradient_accumulation_steps=1, steps_per_generation=1, shuffle_dataset=False)
    dataset = Dataset.from_list([{"prompt": p, "answer": a} for p, a in table])
    trainer = GRPOTrainer(model=model, reward_funcs=right_colour, args=config, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=lora())
    out = trainer.train()
    logs = [r for r in trainer.state.log_history if "reward" in r]
    per_epoch = len(logs) // args.epochs
    first = statistics.mean(r["reward"] for r in logs[:per_epoch])
    last = statistics.mean(r["reward"] for r in logs[-per_epoch:])
    trained = trainer.model.eval()
    print(json.dumps({"first_reward": first, "last_reward": last,
                      "greedy_right": greedy_right(trained, tokenizer, table),
                      "completions_per_s": len(table) * G * args.epochs / out.metrics["train_runtime"],
                      "seconds": out.metrics["train_runtime"], "steps": len(logs)}))


def trl(base, seed, epochs, work, python):
    found = subprocess.run([python, os.path.abspath(__file__), "--trl-child", "--path", base, "--seed", str(seed),
                            "--epochs", str(epochs), "--work", os.path.join(work, f"trl-{seed}")],
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ""})
    lines = [line for line in found.stdout.splitlines() if line.startswith("{")]
    if found.returncode or not lines:
        raise RuntimeError(f"TRL failed:\n{found.stderr[-3000:]}")
    return json.loads(lines[-1])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--trl-python", default="/work/venv-trl/bin/python")
    parser.add_argument("--json")
    parser.add_argument("--trl-child", action="store_true")
    parser.add_argument("--path")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work")
    parser.add_argument("--ways", default="ours,trl", help="which runs, of ours and trl")
    parser.add_argument("--batch", type=int, default=BATCH, help="ours: prompts a rank a step (TRL's stays 4)")
    args = parser.parse_args()
    if args.trl_child:
        return trl_child(args)
    import torch

    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    work = tempfile.mkdtemp(prefix="bench-grpo-")
    base = build_base(os.path.join(work, "base"))
    tokenizer = AutoTokenizer.from_pretrained(base)
    results = {"base_greedy_right": greedy_right(AutoModelForCausalLM.from_pretrained(base).eval(), tokenizer,
                                                 rows()), "prompts": PROMPTS, "epochs": args.epochs, "runs": []}
    print("base greedy right:", results["base_greedy_right"], "of", PROMPTS, flush=True)
    for seed in range(args.seeds):
        for name, run in (("ours", lambda: ours(base, seed, args.epochs, work, args.batch)),
                          ("trl", lambda: trl(base, seed, args.epochs, work, args.trl_python))):
            if name not in args.ways.split(","):
                continue
            found = run()
            found.update(way=name, seed=seed)
            results["runs"].append(found)
            print(json.dumps(found), flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(results, f, indent=1)
    for name in args.ways.split(","):
        mine = [r for r in results["runs"] if r["way"] == name]
        print(name, {k: statistics.median(r[k] for r in mine)
                     for k in ("first_reward", "last_reward", "greedy_right", "completions_per_s")})


if __name__ == "__main__":
    main()
