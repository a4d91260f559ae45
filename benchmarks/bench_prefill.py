"""GRPO's sampling with a prompt read once a group (estimator.lm.generation.prefilled: the prompts' KV cache
computed once and repeated for the group's G rows) against each row reading its prompt (generate()'s own way, and
ours before), in one process on the CPU: 8 prompts x 8 completions by `sampled_groups`, alternating 3 times.
Numbers, not assertions (RESULTS.md by hand).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_prefill.py SHAPE NEW_TOKENS LOW HIGH

SHAPE: 'tiny' (bench_gpu_lm's: hidden 128, 2 layers) or 'small' (hidden 512, 4 layers, 8,192 words);
NEW_TOKENS at most per completion (a stop word ends some); prompts of LOW..HIGH words (one token a word).
"""
import os
import random
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import bench_gpu_lm as B  # noqa: E402
from estimator.lm import generation  # noqa: E402

SMALL = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=8192)


def main(shape, new, low, high):
    B.SHAPES.setdefault("small", SMALL)
    path, words = B.build(os.path.join(tempfile.mkdtemp(prefix="bench-prefill-"), "llama"), shape, "cpu")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [tokenizer(t)["input_ids"] for t in B.texts_of(words, 8, low, high, seed=6)]
    stops = sorted(random.Random(3).sample(range(4, 4 + len(words)), max(1, len(words) // 64)))
    kwargs = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "pad_token_id": tokenizer.pad_token_id,
              "eos_token_id": stops + [tokenizer.eos_token_id]}
    ways = {"a prompt read once a group": generation.prefilled, "each row reads its prompt": lambda *_: {}}
    times, outs = {name: [] for name in ways}, {}
    generation.sampled_groups(model, prompts[:2], 8, [1, 2], 4, kwargs, "cpu")  # warm
    for _ in range(3):
        for name, prefilled in ways.items():
            generation.prefilled = prefilled
            started = time.perf_counter()
            outs[name] = generation.sampled_groups(model, prompts, 8, list(range(8)), new, kwargs, "cpu")
            times[name].append(time.perf_counter() - started)
    tokens = sum(len(c) for c in outs[next(iter(ways))])
    print(f"{shape}, {new} new tokens, prompts of {low}-{high}: the same completions: "
          f"{len({str(o) for o in outs.values()}) == 1}; {tokens} tokens")
    for name, seconds in times.items():
        median = statistics.median(seconds)
        print(f"  {name}: {[round(x, 3) for x in seconds]} s, median {median:.3f} s, {tokens / median:,.0f} tokens/s")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
