"""Issue 53: the causal LM's loss chunk by chunk (estimator.lm.chunked_loss) against a plain PEFT loop
whose loss is the model's own (the float32 logits of every position): each step's memory above the built model, and
tokens/s. Numbers, not assertions (RESULTS.md by hand). No Spark, no tokenizer: token ids drawn at random.

    .venv/bin/python benchmarks/bench_chunked_loss.py [--vocab 128256] [--hidden 256] [--layers 2] [--batch 4]
                                                      [--tokens 512] [--steps 4] [--labels sft,all] [--json F]
                                                      [--device cuda] [--bf16]

On CUDA (`--device cuda`) the memory is torch.cuda's peak allocated bytes above what the built model holds (not
the RSS), the steps are timed with a synchronize at each end, and `--bf16` runs each step under bf16 autocast
(the logits in bf16; the plain loss upcasts them all to float32, the chunked one each chunk).

The model: a LlamaForCausalLM from a LlamaConfig (float32, untied head), peft's LoRA r=16 on every linear layer
(not lm_head: peft's 'all-linear' leaves it out), AdamW over the adapters. Each path runs in a subprocess of its
own, one after the other: it builds the model and the batch, records its RSS (the baseline), then a thread samples
the RSS every 2 ms while it takes one warm-up step and `--steps` timed ones.
  plain:      model(input_ids, attention_mask, labels=labels).loss, backward, step.
  chunked:    TokenObjective().on_batch(model, batch) (the fit's step: the chunked loss), the sum divided by the
              labelled tokens (as the loop's weighting scales it), backward, step.
  checkpoint: the same with each chunk recomputed in backward (torch.utils.checkpoint, use_reentrant=False)
              instead of its gradients computed in forward: the design not taken, measured.
  chunked@N:  chunked, with chunks of N MB of float32 logits (CHUNK_BYTES; default 128), `--chunk-mb`.
  before:     TokenObjective's step before issue 53 (the forward's logits, token_loss in float32).
Labels: 'sft' - rows of 512, 480, 448, 416 tokens (right-padded: label -100, attention_mask 0) whose first 64
tokens are a prompt (-100); 'all' - every token of full rows labelled.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

PATHS = ("plain", "chunked", "checkpoint", "before")


def batch_of(args):
    import torch

    from estimator.data.lm import IGNORE

    torch.manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.tokens))
    mask = torch.ones_like(ids)
    labels = ids.clone()
    if args.label_mode == "sft":
        for row in range(args.batch):
            mask[row, args.tokens - 32 * row:] = 0
        labels[:, :64] = IGNORE
        labels[mask == 0] = IGNORE
    return ids, mask, labels


def model_of(args):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=args.tokens, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    return get_peft_model(model, lora).to(args.device).train()


def checkpointed(hidden, head, labels, positions=None):
    """The chunked loss with each chunk's logits recomputed in backward (what HeadLoss does not do)."""
    import torch
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    from estimator.data.lm import IGNORE
    from estimator.lm.chunked_loss import positions_per_chunk, vocabulary_of

    def piece_loss(piece, targets):
        return F.cross_entropy(head(piece).float(), targets, reduction="sum")

    target = labels[:, 1:]
    labelled = target != IGNORE
    picked, targets = hidden[:, :-1][labelled], target[labelled]
    positions = positions or positions_per_chunk(vocabulary_of(head, picked))
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, picked.shape[0], positions):
        end = start + positions
        loss = loss + checkpoint(piece_loss, picked[start:end], targets[start:end], use_reentrant=False)
    return loss, labelled.sum()


def step_of(path, model, ids, mask, labels):
    """One training step's loss for backward, for `path`."""
    from estimator.lm import chunked_loss
    from estimator.train.objectives import tokens

    if path.startswith("chunked@"):
        chunked_loss.CHUNK_BYTES = int(path.split("@")[1]) * 2 ** 20
    if path == "plain":
        return lambda: model(input_ids=ids, attention_mask=mask, labels=labels).loss
    if path == "checkpoint":
        tokens.chunked_token_loss = checkpointed
    if path == "before":
        tokens.output_head = lambda model: (None, "the code before issue 53")
    objective = tokens.TokenObjective()
    batch = ([{"input_ids": ids, "attention_mask": mask}], [labels], None)
    weight = objective.weight_of(batch)

    def step():
        loss, _ = objective.on_batch(model, batch)
        return loss / weight
    return step


def child(args):
    """One path in this process: {'baseline_mb', 'peak_mb' (above the baseline), 'seconds' (the timed steps)}."""
    import psutil
    import torch

    import contextlib

    me = psutil.Process()
    cuda = args.device.startswith("cuda")
    model = model_of(args)
    ids, mask, labels = (t.to(args.device) for t in batch_of(args))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    step = step_of(args.child, model, ids, mask, labels)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated() if cuda else me.memory_info().rss
    peak, done = [baseline], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], me.memory_info().rss)
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    if not cuda:
        sampler.start()
    autocast = torch.autocast(args.device.split(":")[0], dtype=torch.bfloat16) if args.bf16 else \
        contextlib.nullcontext()
    times, losses = [], []
    for _ in range(1 + args.steps):
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        with autocast:
            loss = step()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
        losses.append(loss.item())
    done.set()
    if cuda:
        peak[0] = torch.cuda.max_memory_allocated()
    else:
        sampler.join()
    print(json.dumps({"baseline_mb": baseline / 2 ** 20, "peak_mb": (peak[0] - baseline) / 2 ** 20,
                      "seconds": sum(times[1:]), "step_s": times, "losses": losses,
                      "tokens": int(mask.sum()) * args.steps, "threads": torch.get_num_threads()}))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--labels", default="sft,all")
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--chunk-mb", default="32,512", help="more chunk sizes, run with the labels' last mode")
    parser.add_argument("--child")
    parser.add_argument("--label-mode", default="sft")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--bf16", action="store_true", help="each step under bf16 autocast")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    import torch

    results, modes = {}, args.labels.split(",")
    paths = {mode: args.paths.split(",") for mode in modes}
    paths[modes[-1]] += [f"chunked@{mb}" for mb in args.chunk_mb.split(",") if mb]
    for mode in modes:
        for path in paths[mode]:
            command = [sys.executable, os.path.abspath(__file__), "--child", path, "--label-mode", mode,
                       *(f"--{k}={getattr(args, k)}" for k in ("vocab", "hidden", "layers", "batch", "tokens",
                                                               "steps", "device")),
                       *(["--bf16"] if args.bf16 else [])]
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            results[f"{mode}/{path}"] = json.loads(out.strip().splitlines()[-1])
            print(mode, path, results[f"{mode}/{path}"], flush=True)
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"{os.cpu_count()} CPU cores"
    print(f"\n{where}, torch {torch.__version__}{', bf16 autocast' if args.bf16 else ''}; Llama vocab {args.vocab:,}, hidden {args.hidden}, "
          f"{args.layers} layers, LoRA r=16, float32; batch {args.batch} x {args.tokens} tokens, {args.steps} timed "
          "steps after one warm-up")
    memory = "peak CUDA memory allocated" if args.device.startswith("cuda") else "peak RSS"
    print(f"| labels | path | {memory} above the built model | vs plain | tokens/s | vs plain | first loss |")
    print("|---|---|---|---|---|---|---|")
    for mode in modes:
        plain = results.get(f"{mode}/plain")
        for path in paths[mode]:
            r = results[f"{mode}/{path}"]
            rate = r["tokens"] / r["seconds"]
            ratios = (f"{r['peak_mb'] / plain['peak_mb']:.2f}x", f"{rate / (plain['tokens'] / plain['seconds']):.2f}x"
                      ) if plain else ("-", "-")
            print(f"| {mode} | {path} | {r['peak_mb']:,.0f} MB | {ratios[0]} | {rate:,.0f} | {ratios[1]} | "
                  f"{r['losses'][0]:.4f} |")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "results": results}, handle, indent=1)


if __name__ == "__main__":
    main()
