"""Whether transform should merge a LoRA model's adapters into the base before generating (issue 53): generated
tokens/s of the adapted model as peft runs it against the same model after merge_and_unload, alternating, in one
process, and whether the texts are the same. Numbers, not assertions (RESULTS.md).

    .venv/bin/python benchmarks/bench_merge.py [--hidden 1024] [--layers 12] [--repeat 3]

The model: a Llama (the example's builder, notebooks/sft_example.py; float32), LoRA r=16 on every linear layer
with random adapters (B not zero, so the merge changes the weights); 32 prompts, 32 new tokens each, greedy,
one batch, left-padded, as transform's generate kind calls it.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "notebooks"))


def main() -> None:
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    from sft_example import color_facts, save_pretrained_llama

    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as work:
        facts = color_facts()
        folder = save_pretrained_llama(os.path.join(work, "base"), [p + r for p, r in facts] * 4,
                                       hidden=args.hidden, layers=args.layers, positions=128)
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        tokenizer.padding_side = "left"
        adapted = get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(folder),
                                 LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))
        with torch.no_grad():
            for name, param in adapted.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.02)
        adapted.eval()
        merged = copy.deepcopy(adapted).merge_and_unload().eval()
        prompts = [p for p, _ in facts[:32]]
        batch = tokenizer(prompts, return_tensors="pt", padding=True)
        new = 32

        def generate(model):
            with torch.inference_mode():
                started = time.perf_counter()
                out = model.generate(**batch, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                     pad_token_id=tokenizer.pad_token_id)
                return time.perf_counter() - started, out[:, batch["input_ids"].shape[1]:]

        generate(adapted), generate(merged)  # warm-up
        times = {"adapted": [], "merged": []}
        texts = {}
        for _ in range(args.repeat):
            for name, model in (("adapted", adapted), ("merged", merged)):
                seconds, tokens = generate(model)
                times[name].append(seconds)
                texts[name] = tokenizer.batch_decode(tokens, skip_special_tokens=True)
        rate = {k: len(prompts) * new / statistics.median(v) for k, v in times.items()}
        same = sum(a == b for a, b in zip(texts["adapted"], texts["merged"]))
        print(json.dumps({"args": vars(args), "tokens_per_s": rate, "merged_over_adapted": rate["merged"] /
                          rate["adapted"], "same_texts": f"{same}/{len(prompts)}",
                          "seconds": times, "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
