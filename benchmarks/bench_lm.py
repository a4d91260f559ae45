"""Language models: SFT tokens/s of the estimator's ranks against a plain PEFT loop over pre-tokenized tensors, and
transform's generated tokens/s against model.generate over the same prompts in one process. No Spark (the ranks
through LocalLauncher, transform's per-batch function called directly), so it runs where Java is not (a GPU box).
Numbers, not assertions (RESULTS.md by hand).

    .venv/bin/python benchmarks/bench_lm.py [--device cpu|cuda] [--size small|base] [--repeat 3] [--json F]

The model: a Llama from a LlamaConfig ('small': hidden 256, 4 layers, about 3M parameters, for CPUs; 'base':
hidden 1024, 8 layers, 16 heads, about 100M, for a GPU, in bf16-mixed), its tokenizer trained by `tokenizers`
(the example's builder, notebooks/sft_example.py), LoRA r=16 on every linear layer, AdamW.
Rows: made-up facts as prompt/response pairs, responses of 1-4 sentences.
  SFT, ours:   TrainSpec over the rows in Parquet, `ranks` ranks of batch b (CPU 2, GPU 1), one epoch; tokens/s =
               the tokens of the rows (prompt and response) over the ranks' training-loop seconds.
  SFT, plain:  one process, batches of ranks x b, tokenized (the same rule) before the clock starts, peft's
               model(input_ids, attention_mask, labels).loss, backward, AdamW.
  generation:  the same prompts, `--prompts` of them, 32 new tokens each (greedy, no eos stop: eos is masked out
               so every row generates all of them), batches of 32: ours = transform's Arrow-batch function
               (sorted by length, left-padded); plain = tokenizer(padding=True, left) + model.generate per batch.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "notebooks"))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))  # lm_helpers: the ranks' spec, the plain model

import numpy as np  # noqa: E402
import torch  # noqa: E402

SIZES = {"small": dict(hidden=256, layers=4, heads=4), "base": dict(hidden=1024, layers=8, heads=16)}
NEW_TOKENS = 32


def rows_of(count):
    from sft_example import color_facts

    facts = color_facts()
    return [(facts[i % 26][0], facts[i % 26][1] + " That is all." * (i % 4)) for i in range(count)]


def build(folder, size):
    import sft_example
    from transformers import AutoConfig, LlamaForCausalLM

    path = sft_example.save_pretrained_llama(folder, [p + r for p, r in rows_of(104)], positions=256)
    s = SIZES[size]
    config = AutoConfig.from_pretrained(path)
    config.update(dict(hidden_size=s["hidden"], intermediate_size=4 * s["hidden"], num_hidden_layers=s["layers"],
                       num_attention_heads=s["heads"], num_key_value_heads=s["heads"]))
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def lora():
    from peft import LoraConfig

    return LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")


def tokens_of(tokenizer, rows):
    from estimator.core.spec import LMSpec
    from estimator.data.rows import PromptResponse
    from estimator.data.lm import CausalLMTokenize

    return CausalLMTokenize(tokenizer, LMSpec(PromptResponse("prompt", "response")), None)(
        {"prompt": np.array([p for p, _ in rows], dtype=object), "response": np.array([r for _, r in rows],
                                                                                      dtype=object)})


def ours_sft(store, path, rows, batch, ranks, device, precision, run):
    from estimator.launch.local import LocalLauncher
    from lm_helpers import lm_train_spec

    spec = lm_train_spec(store, path, rows, batch=batch, epochs=1, peft_config=lora(), lr=1e-4, run=run,
                         use_gpu=device == "cuda", precision=precision, verbose=0, checkpoint_async=True)
    results = LocalLauncher().run(spec, ranks)
    seconds = max(r.train_loop_seconds for r in results)
    return {"seconds": seconds, "data_wait": max(r.data_wait_seconds for r in results) / seconds}


def plain_sft(path, rows, batch, device, precision):
    from transformers import AutoTokenizer
    from lm_helpers import plain_causal_lm

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = plain_causal_lm(path, lora()).to(device).train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ready = []
    for start in range(0, len(rows), batch):
        b = tokens_of(tokenizer, rows[start:start + batch])
        ready.append([torch.from_numpy(b[k]).to(device) for k in ("prompt.input_ids", "prompt.attention_mask",
                                                                    "response")])
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "bf16-mixed")
    synchronize(device)
    started = time.perf_counter()
    for ids, mask, labels in ready:
        with autocast:
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    synchronize(device)
    return {"seconds": time.perf_counter() - started}


def synchronize(device):
    if device == "cuda":
        torch.cuda.synchronize()


def generation(path, prompts, device, dtype):
    """(ours seconds, plain seconds, generated tokens): eos is never generated (its logit is masked)."""
    import pyarrow as pa
    from transformers import AutoTokenizer
    from lm_helpers import plain_causal_lm

    from estimator.data.text import Tokenize
    from estimator.predict import inference
    from estimator.predict.kinds.generate import Generate

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = plain_causal_lm(path, lora()).to(device=device, dtype=dtype).eval()
    kwargs = {"suppress_tokens": [tokenizer.eos_token_id], "min_new_tokens": NEW_TOKENS}
    layout = Generate(feature_cols=("prompt",), batch_size=32, use_gpu=device == "cuda",
                      tokenize=Tokenize(tokenizer, ()), max_new_tokens=NEW_TOKENS, generate_kwargs=kwargs)
    key = f"bench-{id(model)}"
    inference._CACHE[(key, inference.device_for(layout.use_gpu))] = model  # the worker's cached model
    column = pa.array(prompts, pa.string())
    tokenizer.padding_side = "left"
    with torch.inference_mode():  # both warmed up (kernels, generation config) before either is timed
        inference.predict_arrow(key, b"", layout, column.slice(0, 32))
        warm = tokenizer(prompts[:32], padding=True, return_tensors="pt").to(device)
        model.generate(**warm, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                       **kwargs)
    synchronize(device)
    started = time.perf_counter()
    inference.predict_arrow(key, b"", layout, column)
    synchronize(device)
    ours = time.perf_counter() - started
    started = time.perf_counter()
    with torch.inference_mode():
        for start in range(0, len(prompts), 32):
            batch = tokenizer(prompts[start:start + 32], padding=True, return_tensors="pt").to(device)
            model.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False,
                           pad_token_id=tokenizer.pad_token_id, **kwargs)
    synchronize(device)
    return ours, time.perf_counter() - started, len(prompts) * NEW_TOKENS


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    parser.add_argument("--size", default=None, choices=tuple(SIZES))
    parser.add_argument("--rows", type=int, default=None)
    parser.add_argument("--prompts", type=int, default=None)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from store import Store

    gpu = args.device == "cuda"
    size = args.size or ("base" if gpu else "small")
    ranks, batch = (1, 16) if gpu else (2, 8)
    precision, dtype = ("bf16-mixed", torch.bfloat16) if gpu else ("32", torch.float32)
    count = args.rows or (2048 if gpu else 512)
    work = tempfile.mkdtemp(prefix="bench-lm-")
    path = build(os.path.join(work, "llama"), size)
    rows = rows_of(count)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokens = int(tokens_of(tokenizer, rows)["prompt.attention_mask"].sum())
    runs = {"ours": [], "plain": []}
    for i in range(args.repeat):
        store = Store.create(os.path.join(work, f"store-{i}"))
        runs["ours"].append(ours_sft(store, path, rows, batch, ranks, args.device, precision, f"sft-{i}"))
        runs["plain"].append(plain_sft(path, rows, ranks * batch, args.device, precision))
        print(i, runs["ours"][-1], runs["plain"][-1], flush=True)
    prompts = [p for p, _ in rows_of(args.prompts or (512 if gpu else 128))]
    generated = [generation(path, prompts, args.device, dtype) for _ in range(args.repeat)]
    med = lambda xs: statistics.median(xs)  # noqa: E731
    sft_ours, sft_plain = (tokens / med([r["seconds"] for r in runs[k]]) for k in ("ours", "plain"))
    gen_ours, gen_plain = (g[2] / med([x[j] for x in generated]) for j, g in ((0, generated[0]), (1, generated[0])))
    name = torch.cuda.get_device_name(0) if gpu else f"{os.cpu_count()} CPU cores"
    result = {"device": name, "torch": torch.__version__, "size": size, "rows": count, "tokens": tokens,
              "ranks": ranks, "batch_per_rank": batch, "precision": precision,
              "sft_tokens_per_s": {"ours": sft_ours, "plain": sft_plain, "ratio": sft_ours / sft_plain,
                                   "data_wait": med([r["data_wait"] for r in runs["ours"]])},
              "generated_tokens_per_s": {"ours": gen_ours, "plain": gen_plain, "ratio": gen_ours / gen_plain,
                                         "prompts": len(prompts), "new_tokens": NEW_TOKENS}}
    print(f"{name}, torch {torch.__version__}, Llama '{size}', LoRA r=16, precision '{precision}'; medians of "
          f"{args.repeat}")
    print("| what | ours | plain | ratio |")
    print("|---|---|---|---|")
    print(f"| SFT tokens/s ({count} rows, {ranks} rank(s) x batch {batch} vs one process x {ranks * batch}) | "
          f"{sft_ours:,.0f} | {sft_plain:,.0f} | {sft_ours / sft_plain:.2f}x |")
    print(f"| generated tokens/s ({len(prompts)} prompts x {NEW_TOKENS}, batches of 32) | {gen_ours:,.0f} | "
          f"{gen_plain:,.0f} | {gen_ours / gen_plain:.2f}x |")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
