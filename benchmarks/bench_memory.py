"""gradient_checkpointing: the activation memory a training step keeps for backward, with and without it, measured
exactly as the bytes of the tensors autograd saves (torch.autograd.graph.saved_tensors_hooks), for a Llama with
LoRA adapters and for a block MLP (per-unit recomputation), on this machine's CPU. The weights and the optimizer's
state are the same either way. Numbers, not assertions (RESULTS.md by hand).

    .venv/bin/python benchmarks/bench_memory.py [--batch 8] [--tokens 256]
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import torch  # noqa: E402


def saved_bytes(model, inputs, loss_of):
    """Bytes of the tensors autograd keeps between forward and backward (each storage once), and the loss."""
    seen = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_of(model(**inputs) if isinstance(inputs, dict) else model(inputs))
    loss.backward()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in seen.items() if ptr not in params), float(loss)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args(argv)
    from peft import LoraConfig

    import bench_lm
    from estimator.train.memory import checkpoint_activations
    from helpers import BlockMLP
    from lm_helpers import plain_causal_lm

    path = bench_lm.build(os.path.join(tempfile.mkdtemp(prefix="bench-memory-"), "llama"), "small")
    ids = torch.randint(10, 300, (args.batch, args.tokens))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    rows = []
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    for name, build, data, loss_of in (
            ("Llama 'small' (4 layers, hidden 256) + LoRA r=16", lambda: plain_causal_lm(path, lora), inputs,
             lambda out: out.loss),
            ("block MLP (8 blocks of 1024, per unit)", lambda: BlockMLP(1024, 1024, 8, 10),
             torch.randn(args.batch * args.tokens, 1024), lambda out: out.square().mean())):
        plain = build().train()
        recomputed = copy.deepcopy(plain)
        how = checkpoint_activations(recomputed)
        off, loss_off = saved_bytes(plain, data, loss_of)
        on, loss_on = saved_bytes(recomputed, data, loss_of)
        rows.append((name, how, off, on, abs(loss_on - loss_off)))
    print(f"Activation memory kept for backward, batch {args.batch} x {args.tokens} tokens (MB)")
    print("| model | recomputed by | kept without | kept with | saved | loss difference |")
    print("|---|---|---|---|---|---|")
    for name, how, off, on, diff in rows:
        print(f"| {name} | {how} | {off / 2**20:,.1f} | {on / 2**20:,.1f} | {1 - on / off:.0%} | {diff:.1e} |")


if __name__ == "__main__":
    main()
