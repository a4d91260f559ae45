"""QLoRA (issue 64): a rank's peak memory with the base in 4 bits against the base in bf16, and the estimator's
QLoRA tokens/s against a plain QLoRA loop (transformers + bitsandbytes + peft, as notebooks write it) over the same
batches. No Spark (the rank through LocalLauncher). Numbers, not assertions (RESULTS.md by hand).

    PYTHONPATH=.cache/qlora-site .venv/bin/python benchmarks/bench_qlora.py [--device cpu|cuda] [--repeat 3]

The model: bench_lm.py's Llama at 'base' size (hidden 1024, 8 layers, intermediate 4096: 134M parameters in its
linear layers, the folder saved in bf16: 272 MB), LoRA r=16 on every linear layer, AdamW; 4 bits: NF4 with double
quantization, computing in bfloat16 (as the bf16 base does).
  memory:  a process per base (bf16; 4-bit), each after its imports: the base loaded, prepared and adapted, then
           3 training steps of 8 rows: the model's tensors, and the anonymous resident memory above the
           process's before the load (CPU: an allocator's high-water mark, not the live set), or
           torch.cuda.max_memory_allocated (GPU).
  speed:   one epoch of `--rows` rows in batches of 8, one rank: ours = LocalLauncher's rank (its training-loop
           seconds); plain = the loop over batches tokenized before the clock, model(...).loss, backward, AdamW.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import torch  # noqa: E402

BATCH = 8


def four_bits(device):
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.bfloat16)


def build(folder):
    """bench_lm's base-size Llama, saved in bf16."""
    from transformers import AutoModelForCausalLM

    import bench_lm

    path = bench_lm.build(folder, "base")
    AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).save_pretrained(path)
    return path


def adapted(path, base, device):
    """The base (bf16, or 4-bit) prepared and with LoRA, as a QLoRA notebook builds it, in train mode."""
    from peft import get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM

    import bench_lm

    if base == "4bit":
        model = AutoModelForCausalLM.from_pretrained(path, quantization_config=four_bits(device))
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device)
    return get_peft_model(model, bench_lm.lora()).train()


def batches(path, rows, device):
    from transformers import AutoTokenizer

    import bench_lm

    tokenizer = AutoTokenizer.from_pretrained(path)
    out = []
    for start in range(0, len(rows), BATCH):
        b = bench_lm.tokens_of(tokenizer, rows[start:start + BATCH])
        out.append([torch.from_numpy(b[k]).to(device) for k in ("prompt.input_ids", "prompt.attention_mask",
                                                                  "response")])
    return out


def step(model, optimizer, ids, mask, labels):
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def memory(path, base, device):
    """One base's memory in this process (run as a child): the model's tensors (get_memory_footprint), and the
    process's anonymous resident memory (the safetensors file's mapped pages left out) above its level before the
    load, after the load and at the largest of 3 steps (sampled after each forward and backward); on a GPU,
    torch.cuda.max_memory_allocated."""
    import bench_lm

    ready = batches(path, bench_lm.rows_of(3 * BATCH), device)
    before = anon_mb()
    model = adapted(path, base, device)
    out = {"weights_mb": model.get_memory_footprint() / 2 ** 20, "loaded_mb": anon_mb() - before}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    largest = 0.0
    for ids, mask, labels in ready:
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        largest = max(largest, anon_mb() - before)
        loss.backward()
        largest = max(largest, anon_mb() - before)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if device == "cuda":
        return {**out, "peak_mb": torch.cuda.max_memory_allocated() / 2 ** 20}
    return {**out, "peak_mb": largest}


def anon_mb():
    """This process's anonymous resident memory (RssAnon), MB."""
    with open("/proc/self/status") as handle:
        line = next(row for row in handle if row.startswith("RssAnon:"))
    return int(line.split()[1]) / 1024


def plain(path, rows, device):
    model = adapted(path, "4bit", device)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ready = batches(path, rows, device)
    started, losses = time.perf_counter(), []
    for ids, mask, labels in ready:
        losses.append(step(model, optimizer, ids, mask, labels).detach())
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started, float(torch.stack(losses).mean())


def ours(store, path, rows, device, run):
    from estimator.launch.local import LocalLauncher
    from lm_helpers import lm_train_spec

    import bench_lm

    spec = lm_train_spec(store, path, rows, batch=BATCH, epochs=1, peft_config=bench_lm.lora(), lr=1e-4, run=run,
                         use_gpu=device == "cuda", verbose=0, quantization=four_bits(device))
    result = LocalLauncher().run(spec, 1)[0]
    return result.train_loop_seconds, result.history[-1]["loss"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--memory-of", help=argparse.SUPPRESS)  # a child: one base's memory, as JSON
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_of:
        print(json.dumps(memory(args.path, args.memory_of, args.device)))
        return
    from store import Store

    import bench_lm

    work = tempfile.mkdtemp(prefix="bench-qlora-")
    path = build(os.path.join(work, "llama"))
    mem = {}
    for base in ("bf16", "4bit"):
        out = subprocess.run([sys.executable, __file__, "--memory-of", base, "--path", path, "--device", args.device],
                             capture_output=True, text=True, check=True)
        mem[base] = json.loads(out.stdout.strip().splitlines()[-1])
    for base in ("bf16", "4bit"):
        print(f"{base} base: " + ", ".join(f"{k} {v:.0f}" for k, v in mem[base].items()))
    print("4-bit / bf16: " + ", ".join(f"{k} {mem['4bit'][k] / mem['bf16'][k]:.2f}x" for k in mem["bf16"]))
    rows = bench_lm.rows_of(args.rows)
    tokens = sum(int(b[1].sum()) for b in batches(path, rows, "cpu"))
    store = Store.create(os.path.join(work, "store"))
    for i in range(args.repeat):  # alternating: the machine's drift falls on both
        seconds_ours, loss_ours = ours(store, path, rows, args.device, f"r{i}")
        seconds_plain, loss_plain = plain(path, rows, args.device)
        print(f"repeat {i}: ours {tokens / seconds_ours:.0f} tokens/s (loss {loss_ours:.4f}), plain "
              f"{tokens / seconds_plain:.0f} tokens/s (loss {loss_plain:.4f}): {seconds_plain / seconds_ours:.2f}x")


if __name__ == "__main__":
    main()
