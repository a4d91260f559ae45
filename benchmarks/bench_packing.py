"""Issue 54: packing. LoRA SFT tokens/s on a table whose responses run from 2 to 200 tokens, with and without
packing=True, on the estimator's ranks (LocalLauncher: no Spark), and TRL's SFTTrainer on the same model, rows,
batch and LoRA, with and without its packing (TRL only here: a benchmark dependency, never the package's; run
with `--trl-python` naming an interpreter that has trl). Held-out loss over the same held-out rows after one
epoch. Numbers, not assertions (RESULTS.md by hand).

    .venv/bin/python benchmarks/bench_packing.py [--rows 512] [--seeds 3] [--trl-python /work/venv-trl/bin/python]
                                                 [--json F] [--device cuda]

--device cuda (GPU rows, no TRL): the 'base' Llama of bench_lm.py (hidden 1024, 8 layers), one rank of batch 32,
bf16-mixed, 2,048 rows unless --rows says otherwise; packed rows go through torch's variable-length flash
attention there.

Model: the 'small' Llama of bench_lm.py (hidden 256, 4 layers, 256 positions), LoRA r=16 on every linear layer,
AdamW lr 1e-3, constant, gradients clipped at norm 1.0 and the rows shuffled (TRL's defaults: without the
clipping our held-out loss was 0.48 against TRL's 0.35 on seed 0, with it 0.32; the run below matches them;
AdamW's weight decay stays torch's 0.01 against Hugging Face's 0). Rows: made-up facts as prompts (about 10 tokens), each response the fact then " That is
all." repeated 0-45 times (seeded): 2 to about 200 tokens. Ours: 2 ranks x batch 8 (the global batch 16),
max_length 256; tokens/s = the rows' tokens over the ranks' training-loop seconds. TRL: one process, batch 16,
max_length 256, completion-only loss (its default for prompt/completion rows), no eval during training;
tokens/s = the same tokens over trainer.train()'s train_runtime. Held-out loss: the mean next-token loss over the
held-out rows' response tokens, computed the same way for every trained model (one plain forward per row).
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "notebooks"))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
sys.path.insert(0, HERE)

LR, BATCH, RANKS, MAX_LENGTH = 1e-3, 8, 2, 256
GPU_BATCH = 32


def rows_of(count, seed):
    from sft_example import color_facts

    rng, facts = random.Random(seed), color_facts()
    return [(facts[i % 26][0], facts[i % 26][1] + " That is all." * rng.randint(0, 45)) for i in range(count)]


def tokens_in(path, rows):
    from transformers import AutoTokenizer

    from bench_lm import tokens_of

    batch = tokens_of(AutoTokenizer.from_pretrained(path), rows)
    return int(batch["prompt.attention_mask"].sum())


def held_out_loss(model, path, rows):
    """The mean loss over the held-out rows' labelled tokens, one plain forward a row."""
    import torch
    from transformers import AutoTokenizer

    from bench_lm import tokens_of

    tokenizer = AutoTokenizer.from_pretrained(path)
    total = count = 0.0
    model.eval()
    with torch.no_grad():
        for prompt, response in rows:
            b = tokens_of(tokenizer, [(prompt, response)])
            ids, labels = torch.from_numpy(b["prompt.input_ids"]), torch.from_numpy(b["response"])
            logits = model(input_ids=ids).logits[0, :-1].float()
            target = labels[0, 1:]
            keep = target != -100
            total += float(torch.nn.functional.cross_entropy(logits[keep], target[keep], reduction="sum"))
            count += int(keep.sum())
    return total / count


def ours(path, rows, held, packed, seed, work, cuda=False, precision="bf16-mixed"):
    from estimator.launch.local import LocalLauncher
    from estimator.train.checkpoint import restore
    from bench_lm import lora
    from lm_helpers import lm_train_spec, plain_causal_lm
    from store import LocalStore

    store = LocalStore(os.path.join(work, f"store-{packed}-{seed}"))
    gpu = dict(use_gpu=True, precision=precision) if cuda else {}
    spec = lm_train_spec(store, path, rows, batch=GPU_BATCH if cuda else BATCH, epochs=1, peft_config=lora(), lr=LR,
                         run="r", verbose=0, max_length=MAX_LENGTH, packed=packed, **gpu)
    spec = dataclasses.replace(spec, seed=seed, shuffle=True, gradient_clip_val=1.0)  # as TRL's defaults do
    results = LocalLauncher().run(spec, 1 if cuda else RANKS)
    model = plain_causal_lm(path, lora(), seed=0)
    restore(store, store.run("r"), store.run("r").checkpoint, model, None)
    return {"seconds": max(r.train_loop_seconds for r in results), "held_out_loss": held_out_loss(model, path, held)}


def trl_child(args):
    """In an interpreter with trl: TRL's SFTTrainer, packing as asked; prints one JSON line."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from bench_lm import lora

    rows, held = json.loads(open(args.rows_file).read())
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.path)
    model = AutoModelForCausalLM.from_pretrained(args.path)
    data = Dataset.from_dict({"prompt": [p for p, _ in rows], "completion": [r for _, r in rows]})
    config = SFTConfig(output_dir=os.path.join(args.work, "trl"), per_device_train_batch_size=BATCH * RANKS,
                       num_train_epochs=1, learning_rate=LR, lr_scheduler_type="constant", packing=args.packing,
                       max_length=MAX_LENGTH, report_to=[], save_strategy="no", logging_strategy="no",
                       use_cpu=True, seed=args.seed, dataloader_num_workers=0, bf16=False)
    trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer, peft_config=lora())
    metrics = trainer.train().metrics
    print("RESULT " + json.dumps({"seconds": metrics["train_runtime"],
                                  "held_out_loss": held_out_loss(trainer.model, args.path, held),
                                  "threads": torch.get_num_threads()}), flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--precision", default="bf16-mixed", help="with --device cuda: bf16-mixed or 32")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--trl-python")
    parser.add_argument("--json")
    parser.add_argument("--trl-child", action="store_true")
    parser.add_argument("--packing", action="store_true")
    parser.add_argument("--path"), parser.add_argument("--work"), parser.add_argument("--rows-file")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.trl_child:
        return trl_child(args)
    import torch

    from bench_lm import build

    cuda = args.device == "cuda"
    args.rows = args.rows or (2048 if cuda else 512)
    results = {}
    with tempfile.TemporaryDirectory() as work:
        path = build(os.path.join(work, "llama"), "base" if cuda else "small")
        for seed in range(args.seeds):
            rows, held = rows_of(args.rows, seed), rows_of(64, 1000 + seed)
            tokens = tokens_in(path, rows)
            runs = {"ours": ours(path, rows, held, False, seed, work, cuda, args.precision),
                    "ours, packing": ours(path, rows, held, True, seed, work, cuda, args.precision)}
            if args.trl_python:
                rows_file = os.path.join(work, f"rows-{seed}.json")
                with open(rows_file, "w") as f:
                    json.dump([rows, held], f)
                for packing in (False, True):
                    command = [args.trl_python, os.path.abspath(__file__), "--trl-child", "--path", path, "--work",
                               work, "--rows-file", rows_file, "--seed", str(seed)] + (["--packing"] * packing)
                    out = subprocess.run(command, capture_output=True, text=True)
                    if out.returncode:
                        raise RuntimeError(out.stderr[-3000:])
                    line = next(l for l in out.stdout.splitlines() if l.startswith("RESULT "))
                    runs["TRL" + (", packing" if packing else "")] = json.loads(line[7:])
            for name, run in runs.items():
                run["tokens_per_s"] = tokens / run["seconds"]
                results.setdefault(name, []).append(run)
                print(seed, name, run, flush=True)
    where = (f"{torch.cuda.get_device_name()}, {args.precision}, batch {GPU_BATCH}" if cuda
             else f"{os.cpu_count()} CPU cores")
    print(f"\n{where}, torch {torch.__version__}; {args.rows} rows (responses 2-200 tokens), "
          f"{args.seeds} seeds; medians")
    print("| way | tokens/s | vs ours unpacked | held-out loss (min-max) |")
    print("|---|---|---|---|")
    base = statistics.median(r["tokens_per_s"] for r in results["ours"])
    for name, runs in results.items():
        rate = statistics.median(r["tokens_per_s"] for r in runs)
        losses = [r["held_out_loss"] for r in runs]
        print(f"| {name} | {rate:,.0f} | {rate / base:.2f}x | {statistics.median(losses):.3f} "
              f"({min(losses):.3f}-{max(losses):.3f}) |")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "results": results}, handle, indent=1)


if __name__ == "__main__":
    main()
