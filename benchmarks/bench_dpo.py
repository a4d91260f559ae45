"""Issue 56: preference tuning. DPO with LoRA on the estimator's ranks (LocalLauncher: no Spark) against TRL's
DPOTrainer on the same model, pairs, batch, LoRA, beta and learning rate (TRL only here: a benchmark dependency,
never the package's; run with `--trl-python` naming an interpreter that has trl). Numbers, not assertions
(RESULTS.md by hand).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_dpo.py [--pairs 512] [--seeds 3]
                                                         [--trl-python /work/venv-trl/bin/python] [--json F]

Model: the 'small' Llama of bench_lm.py (hidden 256, 4 layers), first fine-tuned here (our SFT, LoRA, merged and
saved) to answer "What color is the kettle?" with " The kettle is teal!" for all 26 nouns: the model DPO starts
from prefers the wrong answer. The preference: chosen " The kettle is teal." (the colour drawn per row), rejected
" The kettle is teal!" (one token apart), a style any prompt shares, so that held-out prompts can show it:
training pairs ask about 20 nouns, held-out pairs about the other 6. DPO: LoRA r=16 on every linear layer, AdamW
at LR, constant, gradients clipped at 1.0 (TRL's default), beta 0.1, one epoch. Ours: 2 ranks x batch 4 (global
8), the reference the adapters off (the default) or precomputed before training (reference='precomputed': one
forward per step); TRL: one process, batch 8. pairs/s = the training pairs over the ranks' training-loop seconds
(ours; the precomputing pass counted in) or train_runtime (TRL). Held out, computed the same way for every trained
model, one row at a time: the reward accuracy (the share of pairs whose chosen answer's reward beta x (policy -
reference log-probability) is above the rejected one's, the reference the adapters off), the mean margin between
the two rewards, and the share of the 6 held-out prompts whose greedy answer ends with '.' (the SFT model: '!').
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "notebooks"))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
sys.path.insert(0, HERE)

LR, BETA, BATCH, RANKS = 5e-4, 0.1, 4, 2


def pairs_of(count, nouns, seed):
    from sft_example import COLORS

    rng = random.Random(seed)
    out = []
    for _ in range(count):
        noun, colour = rng.choice(nouns), rng.choice(COLORS)
        out.append((f"What color is the {noun}?", f" The {noun} is {colour}.",
                    f" The {noun} is {colour}!"))
    return out


def split_nouns():
    from sft_example import NOUNS

    return list(NOUNS[:20]), list(NOUNS[20:26])


def held_out_rewards(model, tokenizer, held):
    """(the share of pairs whose chosen answer's reward is above the rejected one's, the mean reward margin
    beta x ((policy - reference) chosen - (policy - reference) rejected)): adapters on vs off."""
    import torch

    def logp(prompt, answer):
        return answer_logp(model, tokenizer, prompt, answer)

    model.eval()
    right, margins = 0, []
    with torch.no_grad():
        for prompt, chosen, rejected in held:
            policy = logp(prompt, chosen) - logp(prompt, rejected)
            with model.disable_adapter():
                reference = logp(prompt, chosen) - logp(prompt, rejected)
            right += policy > reference
            margins.append(BETA * (policy - reference))
    return right / len(held), statistics.mean(margins)


def answer_logp(model, tokenizer, prompt, answer):
    """The answer's summed log-probability after its prompt, the row alone."""
    import torch

    ids = tokenizer(prompt)["input_ids"] + tokenizer(answer, add_special_tokens=False)["input_ids"]
    ids.append(tokenizer.eos_token_id)
    start = len(tokenizer(prompt)["input_ids"])
    logps = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
    return float(sum(logps[t - 1, ids[t]] for t in range(start, len(ids))))


def prefers_chosen(model, tokenizer, held):
    """The share of pairs whose chosen answer the model finds more likely than the rejected one."""
    import torch

    model.eval()
    with torch.no_grad():
        return sum(answer_logp(model, tokenizer, p, c) > answer_logp(model, tokenizer, p, r)
                   for p, c, r in held) / len(held)


def held_out_style(model, tokenizer, held):
    """The share of the held-out prompts whose greedy answer ends with '.' (the chosen style)."""
    import torch

    model.eval()
    prompts, ends = sorted({p for p, _, _ in held}), []
    with torch.no_grad():
        for prompt in prompts:
            ids = tokenizer([prompt], return_tensors="pt")
            out = model.generate(**ids, max_new_tokens=10, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id)
            ends.append(tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip())
    return sum(text.endswith(".") for text in ends) / len(ends), ends


def sft_first(path, work):
    """The base fine-tuned (ours, LoRA, 2 epochs) on every noun's fact ending with '!', merged and saved."""
    from transformers import AutoTokenizer

    from bench_lm import lora
    from estimator.launch.local import LocalLauncher
    from estimator.train.checkpoint import restore
    from lm_helpers import lm_train_spec, plain_causal_lm
    from sft_example import COLORS, NOUNS
    from store import LocalStore

    rows = [(f"What color is the {n}?", f" The {n} is {c}!") for n in NOUNS[:26] for c in COLORS] * 2
    store = LocalStore(os.path.join(work, "sft-store"))
    LocalLauncher().run(lm_train_spec(store, path, rows, batch=BATCH, epochs=2, peft_config=lora(), lr=1e-3,
                                      run="sft", verbose=0, shuffle=True), RANKS)
    model = plain_causal_lm(path, lora(), seed=0)
    restore(store, store.run("sft"), store.run("sft").checkpoint, model, None)
    folder = os.path.join(work, "sft")
    model.merge_and_unload().save_pretrained(folder)
    AutoTokenizer.from_pretrained(path).save_pretrained(folder)
    return folder


def ours(path, rows, held, seed, work, reference=None):
    import dataclasses

    from transformers import AutoTokenizer

    from bench_lm import lora
    from estimator.launch.local import LocalLauncher
    from estimator.train.checkpoint import restore
    from estimator.train.objectives.preference import DPO
    from lm_helpers import lm_train_spec, plain_causal_lm
    from store import LocalStore

    store = LocalStore(os.path.join(work, f"store-{seed}-{reference}"))
    spec = lm_train_spec(store, path, rows, batch=BATCH, epochs=1, peft_config=lora(), lr=LR, run="r", verbose=0,
                         objective=DPO(beta=BETA, reference=reference), reference_key=f"ref-{seed}")
    spec = dataclasses.replace(spec, seed=seed, shuffle=True, gradient_clip_val=1.0)
    results = LocalLauncher().run(spec, RANKS)
    model = plain_causal_lm(path, lora(), seed=0)
    restore(store, store.run("r"), store.run("r").checkpoint, model, None)
    tokenizer = AutoTokenizer.from_pretrained(path)
    accuracy, margin = held_out_rewards(model, tokenizer, held)
    style, _ = held_out_style(model, tokenizer, held)
    # the loop's seconds, and the pass that precomputed the reference (before the loop)
    seconds = max(r.train_loop_seconds + r.objective_setup_seconds for r in results)
    return {"seconds": seconds, "reference_pass_s": max(r.objective_setup_seconds for r in results),
            "held_out_accuracy": accuracy, "held_out_margin": margin, "held_out_style": style,
            "train_accuracy": results[0].history[-1]["rewards/accuracies"]}


def trl_child(args):
    """In an interpreter with trl: TRL's DPOTrainer; prints one JSON line."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    from bench_lm import lora

    rows, held = json.loads(open(args.rows_file).read())
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.path)
    model = AutoModelForCausalLM.from_pretrained(args.path)
    data = Dataset.from_dict({"prompt": [p for p, _, _ in rows], "chosen": [c for _, c, _ in rows],
                              "rejected": [r for _, _, r in rows]})
    config = DPOConfig(output_dir=os.path.join(args.work, "trl"), per_device_train_batch_size=BATCH * RANKS,
                       num_train_epochs=1, learning_rate=LR, lr_scheduler_type="constant", beta=BETA,
                       report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True, seed=args.seed,
                       dataloader_num_workers=0, bf16=False)
    trainer = DPOTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer,
                         peft_config=lora())
    metrics = trainer.train().metrics
    accuracy, margin = held_out_rewards(trainer.model, tokenizer, held)
    style, _ = held_out_style(trainer.model, tokenizer, held)
    print("RESULT " + json.dumps({"seconds": metrics["train_runtime"], "held_out_accuracy": accuracy,
                                  "held_out_margin": margin, "held_out_style": style,
                                  "threads": torch.get_num_threads()}), flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=512)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--trl-python")
    parser.add_argument("--json")
    parser.add_argument("--trl-child", action="store_true")
    parser.add_argument("--path"), parser.add_argument("--work"), parser.add_argument("--rows-file")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.trl_child:
        return trl_child(args)
    import torch

    from bench_lm import build

    results = {}
    train_nouns, held_nouns = split_nouns()
    with tempfile.TemporaryDirectory() as work:
        path = sft_first(build(os.path.join(work, "llama"), "small"), work)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        sft_model, tokenizer = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
        before, ends = held_out_style(sft_model, tokenizer, pairs_of(64, held_nouns, 1000))
        preferred = prefers_chosen(sft_model, tokenizer, pairs_of(64, held_nouns, 1000))
        print(f"the SFT model, held out: {before:.2f} of its answers end with '.' ({ends[:3]}); it finds the chosen "
              f"answer more likely in {preferred:.2f} of the pairs", flush=True)
        for seed in range(args.seeds):
            rows, held = pairs_of(args.pairs, train_nouns, seed), pairs_of(64, held_nouns, 1000 + seed)
            runs = {"ours": ours(path, rows, held, seed, work),
                    "ours, reference precomputed": ours(path, rows, held, seed, work, "precomputed")}
            if args.trl_python:
                rows_file = os.path.join(work, f"rows-{seed}.json")
                with open(rows_file, "w") as f:
                    json.dump([rows, held], f)
                command = [args.trl_python, os.path.abspath(__file__), "--trl-child", "--path", path, "--work",
                           work, "--rows-file", rows_file, "--seed", str(seed)]
                out = subprocess.run(command, capture_output=True, text=True)
                if out.returncode:
                    raise RuntimeError(out.stderr[-3000:])
                line = next(l for l in out.stdout.splitlines() if l.startswith("RESULT "))
                runs["TRL DPOTrainer"] = json.loads(line[7:])
            for name, run in runs.items():
                run["pairs_per_s"] = args.pairs / run["seconds"]
                results.setdefault(name, []).append(run)
                print(seed, name, run, flush=True)
    print(f"\n{os.cpu_count()} CPU cores, torch {torch.__version__}; {args.pairs} pairs, {args.seeds} seeds; medians")
    print("| way | pairs/s | vs ours | held-out reward accuracy (min-max) | held-out reward margin (min-max) | "
          "held-out answers in the chosen style (min-max) |")
    print("|---|---|---|---|---|---|")
    base = statistics.median(r["pairs_per_s"] for r in results["ours"])
    for name, runs in results.items():
        rate = statistics.median(r["pairs_per_s"] for r in runs)
        acc, margin = [r["held_out_accuracy"] for r in runs], [r["held_out_margin"] for r in runs]
        style = [r["held_out_style"] for r in runs]
        print(f"| {name} | {rate:,.1f} | {rate / base:.2f}x | {statistics.median(acc):.2f} "
              f"({min(acc):.2f}-{max(acc):.2f}) | {statistics.median(margin):.3f} "
              f"({min(margin):.3f}-{max(margin):.3f}) | {statistics.median(style):.2f} "
              f"({min(style):.2f}-{max(style):.2f}) |")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "results": results}, handle, indent=1)


if __name__ == "__main__":
    main()
