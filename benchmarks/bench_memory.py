"""gradient_checkpointing: the activation memory a training step keeps for backward, without it, with True (all
recomputed) and with 'selective' (the wide matrix products' and attention's outputs kept), measured exactly as the
bytes of the tensors autograd saves (torch.autograd.graph.saved_tensors_hooks) plus, for 'selective', those the
checkpoint keeps in its own cache; and the seconds of a forward and backward on this machine's CPU (the cost of
recomputing). A Llama with LoRA adapters (Hugging Face's switch), a block MLP (per unit), and one decoder layer of
Llama 3.2 1B's shape (hidden 2048, MLP 8192, 32/8 heads) with LoRA r=16 on every projection, in bf16 under autocast:
what a 1B fine-tune keeps per token and layer. The weights and the optimizer's state are the same either way; the
gradients are compared with the run that kept everything. Numbers, not assertions (RESULTS.md by hand).

    .venv/bin/python benchmarks/bench_memory.py [--batch 8] [--tokens 256] [--layer-tokens 2048] [--repeat 3]
"""
from __future__ import annotations

import argparse
import copy
import functools
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import torch  # noqa: E402

MODES = (False, True, "selective")


CACHES = []  # the selective checkpoints' caches of the step being measured


def counted_contexts():
    """memory.selective_contexts, its cache kept to be counted (set in place of it before the models are built:
    a model holds the function from checkpoint_activations on)."""
    both = ORIGINAL()
    CACHES.append(both[0].contexts[0].storage)
    return both


def kept_bytes(model, inputs, loss_of, autocast):
    """Bytes kept between forward and backward (each storage once, the parameters' not counted: autograd's saved
    tensors and the selective checkpoint's cache), the gradients, and the forward and backward's seconds."""
    seen = {}
    CACHES.clear()

    def pack(tensor):
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    started = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    loss = loss_of(out)
    for cache in CACHES:
        for entries in cache.values():
            for entry in entries.values():
                for value in entry if isinstance(entry, (tuple, list)) else (entry,):
                    tensor = getattr(value, "val", None)
                    if isinstance(tensor, torch.Tensor):
                        seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    loss.backward()
    seconds = time.perf_counter() - started
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return sum(n for ptr, n in seen.items() if ptr not in params), grads, seconds


def one_layer(tokens):
    """A decoder layer of Llama 3.2 1B's shape in bf16 with LoRA r=16 on its projections, as its own model (its
    rotary embedding inside), for the input hidden states of one sequence."""
    from peft import LoraConfig, get_peft_model
    from torch import nn
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig(vocab_size=1000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=1,
                         num_attention_heads=32, num_key_value_heads=8, attn_implementation="sdpa")

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([LlamaDecoderLayer(config, 0)])  # a unit for per-unit recomputation
            self.rope = LlamaRotaryEmbedding(config)

        def forward(self, hidden):
            positions = torch.arange(hidden.shape[1])[None]
            out = self.layers[0](hidden, position_embeddings=self.rope(hidden, positions), attention_mask=None,
                                 position_ids=positions)
            return out[0] if isinstance(out, tuple) else out

    torch.manual_seed(0)
    layer = get_peft_model(Layer().to(torch.bfloat16), LoraConfig(
        r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"]))
    for name, param in layer.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)  # gradients through the adapters' both sides
    hidden = torch.randn(1, tokens, 2048, dtype=torch.bfloat16, requires_grad=True)
    return layer, hidden


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--layer-tokens", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per mode (the median)")
    args = parser.parse_args(argv)
    from peft import LoraConfig

    import bench_lm
    from estimator.train import memory
    from estimator.train.memory import checkpoint_activations
    from helpers import BlockMLP

    global ORIGINAL
    ORIGINAL, memory.selective_contexts = memory.selective_contexts, counted_contexts
    from lm_helpers import plain_causal_lm

    path = bench_lm.build(os.path.join(tempfile.mkdtemp(prefix="bench-memory-"), "llama"), "small")
    ids = torch.randint(10, 300, (args.batch, args.tokens))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    layer, hidden = one_layer(args.layer_tokens)
    cases = (
        (f"Llama 'small' (4 layers, hidden 256) + LoRA r=16, batch {args.batch} x {args.tokens}, float32",
         lambda: plain_causal_lm(path, lora), inputs, lambda out: out.loss, False, args.batch * args.tokens),
        (f"block MLP (8 blocks of 1024, per unit), {args.batch * args.tokens} rows, float32",
         functools.partial(BlockMLP, 1024, 1024, 8, 10), torch.randn(args.batch * args.tokens, 1024),
         lambda out: out.square().mean(), False, args.batch * args.tokens),
        (f"one layer of Llama 3.2 1B's shape + LoRA r=16, {args.layer_tokens} tokens, bf16",
         lambda: copy.deepcopy(layer), hidden, lambda out: out.float().square().mean(), True, args.layer_tokens))
    print("Activation memory kept for backward (MB; KiB a token) and a forward + backward's seconds (median of "
          f"{args.repeat}), on this CPU")
    print("| model | kept, none | kept, True | kept, 'selective' | seconds none / True / 'selective' | "
          "gradients as kept |")
    print("|---|---|---|---|---|---|")
    for name, build, data, loss_of, autocast, tokens in cases:
        kept, seconds, same = {}, {}, True
        reference = None
        for mode in MODES:
            torch.manual_seed(0)
            model = build().train()
            if mode:
                checkpoint_activations(model, None, mode)
            runs = []
            for _ in range(args.repeat + 1):  # the first warms up
                if isinstance(data, torch.Tensor):
                    data.grad = None
                model.zero_grad(set_to_none=True)
                kept[mode], grads, took = kept_bytes(model, data, loss_of, autocast)
                runs.append(took)
            seconds[mode] = statistics.median(runs[1:])
            if reference is None:
                reference = grads
            same = same and grads.keys() == reference.keys() and all(
                torch.equal(grads[k], reference[k]) for k in grads)
        cells = [f"{kept[m] / 2**20:,.1f} ({kept[m] / tokens / 1024:,.1f})" for m in MODES]
        times = " / ".join(f"{seconds[m]:.2f}" for m in MODES)
        print(f"| {name} | {' | '.join(cells)} | {times} | {'equal' if same else 'DIFFERENT'} |")


if __name__ == "__main__":
    main()
