"""Issue 65: language models at the size people fine-tune, on one GPU, in one prepared device call. A Llama of
Llama 3.2 1B's shape (hidden 2048, 16 layers, 32 heads, 8 KV heads, MLP 8192, a 128,256-token vocabulary tied to
the embedding: 1.24B parameters), random weights drawn on the GPU and saved in bf16 (no hub), a word-level
tokenizer (one token a word) built here. No Spark: our ranks through LocalLauncher (one rank, in this process),
transform's per-batch function called directly, as bench_lm.py does. Numbers, not assertions (RESULTS.md by hand).

    python benchmarks/bench_gpu_lm.py [--device cuda|cpu] [--shape 1b|tiny] [--budget SECONDS] [--json F]

Every row is tried on its own: a row that fails prints its traceback and records the error; the JSON is written
after each row; rows are skipped once --budget seconds have passed. Two passes: first the rows that answer issue
65's targets in every section (FIRST: ours, ours with selective checkpointing and TRL + Liger for LoRA; ours and
generate@128 for generation; ours for the full fine-tune; embeddings and scores), then the other rows.

Fine-tuning (--sft-rows rows of 64-1,500 tokens, log-uniform, a quarter of each the prompt; one epoch, batches of
--batch rows in the table's order, AdamW lr 1e-4, the global gradient norm clipped at 1.0 as TRL's default does;
tokens/s = the rows' tokens (prompt, response, BOS and EOS) over the training loop's seconds):
  LoRA (r=16, alpha 32, every linear layer) on a bf16 base, and a full fine-tune (float32 weights), each by
  - ours:        TrainSpec -> LocalLauncher, one rank, precision 'bf16-mixed', packed rows (padding-free: torch's
                 variable-length flash attention on the GPU), the model from the folder (the factory's dtype);
                 and again with gradient_checkpointing='selective' (the wide products' and attention's outputs
                 kept, the norms, activations and adapters recomputed: the memory Liger's kernels save);
  - plain:       the same model by hand: HF + PEFT, right-padded batches (tokenized before the clock), autocast
                 bf16, the logits' cross-entropy over the step's labelled tokens, backward, clip, AdamW; on a GPU
                 each step's 16 rows go through in micro-batches of 4 (--plain-micro: 16 padded rows of up to
                 1,500 tokens ran out of an H100's 80 GB, the logits alone 12 GB in float32);
  - TRL:         SFTTrainer (in a child process), prompt/completion rows, padding_free=True (sdpa reads the rows'
                 boundaries from position_ids), bf16, gradient checkpointing off as ours, no saving or logging;
  - TRL + Liger: the same with use_liger_kernel=True (CUDA only: Liger's kernels are Triton's).
  Steady figures beside the loop's (StepClock): the steps after the first 3 (CUDA's first calls, the allocator,
  AdamW's state), timed by CUDA events at each optimizer step's end, with their share of the tokens (the ids fed).
  MFU: FLOPs over seconds over --peak-tflops (the H100's 989 dense bf16). FLOPs as torchtitan counts them: 6 N a
  token for a full fine-tune, 4 N for LoRA (the frozen weights get no gradient), N the parameters that multiply
  (every linear layer, the tied head once; not the embedding's lookup), plus 12 x layers x hidden x length for
  each token's attention (not halved for the causal mask). Peak memory: torch.cuda's peak allocated.
Generation (--prompts prompts of 32-512 tokens, up to --new-tokens new tokens, greedy; a row stops at EOS or at
  one of a fixed 1/--stop-every of the words: the random model's tokens spread over the vocabulary, so outputs run
  from 1 token to --new-tokens, about --stop-every on average):
  - ours:           transform's Generate predictor, generation_batching='auto' (continuous batching on a GPU,
                    sorted, left-padded generate() calls by a token budget on a CPU), and the other way of the two
                    (ours_padded on a GPU, ours_continuous on a CPU);
  - generate @ b:   model.generate over left-padded batches of b prompts sorted by length (b = 64, 128; 32 on
                    the CPU only: the slowest on the GPU);
  - generate_batch: transformers' continuous batching (paged KV cache; rows leave and join at every step).
  tokens/s = the tokens each way generated (its texts tokenized again, the same count for every way) over its
  seconds; each way warmed up on a few prompts first; texts compared with generate's.
Embeddings (--texts texts of 16-512 tokens, mean pooling over the mask, bf16 base model): ours (transform's
  Embedding predictor) against a hand loop over batches of 64 texts sorted by length; the vectors compared.
Profile (first pass, last): ours' full fine-tune of 8 steps under torch.profiler, steps 4-7 recorded: the GPU's
  busy share, its kernels' seconds by kind, the 30 costliest (profile_full.txt beside the JSON); the store in
  memory (the end's 15 GB checkpoint is not what is asked there).
GRPO's sampling (second pass only): 16 prompts x 8 completions of up to 64 tokens (a stop word ends some), ours
  against generate()'s own sampling in the same calls and against one call a prompt (`grpo_rows`).
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import numpy as np  # noqa: E402
import torch  # noqa: E402

SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128_256),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=4096),
}
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
LR, CLIP, MAX_LENGTH = 1e-4, 1.0, 2048


# ---------------------------------------------------------------- the model, its tokenizer, the rows
def vocabulary(count):
    """`count` made-up words, the same on every machine."""
    syllables = [a + b for a in "bdfgklmnprstvz" for b in "aeiou"]
    rng = random.Random(7)
    found, seen = [], set()
    while len(found) < count:
        word = "".join(rng.choice(syllables) for _ in range(rng.randint(1, 3)))
        if word not in seen:
            seen.add(word)
            found.append(word)
    return found


def words_of(shape):
    """A word for every id of the model's vocabulary but the specials: every id the model emits decodes."""
    return vocabulary(SHAPES[shape]["vocab_size"] - len(SPECIALS))


def build(folder, shape, device):
    """The model folder: config, bf16 weights (drawn on `device`), a word-level tokenizer of SHAPES' words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = words_of(shape)
    vocab = {w: i for i, w in enumerate(SPECIALS + words)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                        unk_token="<unk>")
    tokenizer.save_pretrained(folder)
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=4096, rope_theta=500_000.0,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(folder)
    del model
    free(device)
    return folder, words


def rows_of(words, count, low, high, seed):
    """(prompt, response) pairs whose word counts total low..high (log-uniform), a quarter the prompt."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        total = int(math.exp(rng.uniform(math.log(low), math.log(high))))
        prompt = max(4, total // 4)
        text = [rng.choice(words) for _ in range(total)]
        rows.append((" ".join(text[:prompt]), " ".join(text[prompt:])))
    return rows


def texts_of(words, count, low, high, seed):
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(low, high))) for _ in range(count)]


def free(device):
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def synchronize(device):
    if device == "cuda":
        torch.cuda.synchronize()


def lora():
    from peft import LoraConfig

    return LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")


def counted(path):
    """(N: parameters that multiply, layers, hidden) of the folder's config, for the FLOPs."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(path)
    d, f, kv = c.hidden_size, c.intermediate_size, c.num_key_value_heads * (c.hidden_size // c.num_attention_heads)
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * f
    return per_layer * c.num_hidden_layers + d * c.vocab_size, c.num_hidden_layers, d


def train_flops(path, lengths, full):
    n, layers, hidden = counted(path)
    return (6 if full else 4) * n * sum(lengths) + 12 * layers * hidden * sum(x * x for x in lengths)


# ---------------------------------------------------------------- fine-tuning: the steady state
WARM_STEPS = 3  # the steps a run's steady figure leaves out (CUDA's and the allocator's first calls, AdamW's state)


class StepClock:
    """Each optimizer step's end and the tokens fed before it, for a fine-tune's steady figure (its loop's seconds
    count the first steps' warm-up too: on 2026-11-28 a 1B row's loop was 32 steps). Global hooks, so that they
    reach the optimizer and the model that our rank, HF's Trainer (TRL) or the plain loop build: after each step
    of a torch.optim optimizer (an Accelerate wrapper's step is not counted twice), a CUDA event (a CPU's clock);
    before each lookup of an embedding of the vocabulary's size, the non-pad ids it gets, summed on the device.
    No host sync: read once the run is over (`steady`)."""

    def __init__(self, vocabulary, pad=0):
        self.vocabulary, self.pad, self.ends, self.fed = vocabulary, pad, [], []
        self.count = None

    def __enter__(self):
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.hooks = [register_optimizer_step_post_hook(self.stepped),
                      torch.nn.modules.module.register_module_forward_pre_hook(self.looked_up)]
        return self

    def __exit__(self, *exc):
        for hook in self.hooks:
            hook.remove()

    def looked_up(self, module, inputs):
        if isinstance(module, torch.nn.Embedding) and module.num_embeddings == self.vocabulary and inputs:
            ids = inputs[0]
            counted = (ids != self.pad).sum()
            self.count = counted if self.count is None else self.count + counted

    def stepped(self, optimizer, args, kwargs):
        if not type(optimizer).__module__.startswith("torch.optim"):
            return
        if self.count is None:  # a step without a lookup seen (a wrapper's): nothing to time against
            return
        if torch.cuda.is_available() and self.count.is_cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        else:
            end = time.perf_counter()
        self.ends.append(end)
        self.fed.append(self.count.clone())

    def steady(self):
        """{steps, steady_steps, steady_seconds, steady_share}: the steps after the first WARM_STEPS, their
        seconds (end to end) and their share of the run's tokens (by the ids fed); Bench.row makes the steady
        tokens/s and MFU of them, the FLOPs in the same share (the attention term, a few percent at these
        lengths, taken as even over the tokens)."""
        if len(self.ends) <= WARM_STEPS + 1:
            return {"steps": len(self.ends), "steady_steps": 0}
        first, last = self.ends[WARM_STEPS - 1], self.ends[-1]
        if isinstance(last, float):
            seconds = last - first
        else:
            last.synchronize()
            seconds = first.elapsed_time(last) / 1000.0
        fed = [float(x) for x in self.fed]
        return {"steps": len(self.ends), "steady_steps": len(self.ends) - WARM_STEPS, "steady_seconds": seconds,
                "steady_share": (fed[-1] - fed[WARM_STEPS - 1]) / fed[-1]}


# ---------------------------------------------------------------- fine-tuning: the ways
def tokenized(tokenizer, rows):
    """Our rank's own tokenization of the rows: {prompt.input_ids, prompt.attention_mask, response (labels)}."""
    from estimator.core.spec import LMSpec
    from estimator.data.rows import PromptResponse
    from estimator.data.lm import CausalLMTokenize

    return CausalLMTokenize(tokenizer, LMSpec(PromptResponse("prompt", "response")), MAX_LENGTH)(
        {"prompt": np.array([p for p, _ in rows], dtype=object),
         "response": np.array([r for _, r in rows], dtype=object)})


def ours_sft(args, path, rows, full, dtype, checkpointing=False, store_url=None):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from estimator.core.adapters import with_adapters
    from estimator.core.pickling import dumps, user_objects
    from estimator.core.spec import DataSpec, LMSpec, TrainSpec
    from estimator.data.rows import PromptResponse
    from estimator.data.parquet import list_pieces
    from estimator.launch.local import LocalLauncher
    from estimator.train.objectives.tokens import TokenObjective
    from store import Store

    store = Store.create(store_url or tempfile.mkdtemp(prefix="store-", dir=args.work))
    store.makedirs(store.path("train"))
    table = pa.table({"prompt": [p for p, _ in rows], "response": [r for _, r in rows]})
    with store.fs.open(store.path("train", "part.parquet"), "wb") as handle:
        pq.write_table(table, handle, row_group_size=args.batch)
    packed = args.device == "cuda"
    lm = LMSpec(PromptResponse("prompt", "response"), packed=packed)
    data = DataSpec(store, list_pieces(store, store.path("train")), (), ("prompt",), ("response",), lm=lm,
                    max_length=MAX_LENGTH)
    peft = None if full else lora()
    factory = functools.partial(AutoModelForCausalLM.from_pretrained, path, dtype=dtype)
    objs = user_objects(with_adapters(factory(), peft), functools.partial(torch.optim.AdamW, lr=LR), [], [], [],
                        model_factory=factory, tokenizer=AutoTokenizer.from_pretrained(path), peft_config=peft,
                        objective=TokenObjective)
    precision = "bf16-mixed" if args.device == "cuda" else "32"
    spec = TrainSpec(data, dumps(objs, "model", roots=[factory]), store.run("sft"), args.batch, args.batch, 1,
                     seed=3, shuffle=False, use_gpu=args.device == "cuda", precision=precision, verbose=0,
                     gradient_clip_val=CLIP, checkpoint_async=True, gradient_checkpointing=checkpointing)
    del objs
    free(args.device)
    with StepClock(SHAPES[args.shape]["vocab_size"]) as clock:
        result = LocalLauncher().run(spec, 1)[0]
    # the rank's time beside its loop: the end of the fit waits for the last checkpoint (a 1B full fine-tune's
    # weights and AdamW's state: 15 GB; 58 of the row's 68 s on 2026-11-28)
    return {"seconds": result.train_loop_seconds, "data_wait": result.data_wait_seconds / result.train_loop_seconds,
            "packed": packed, "rank_seconds": result.seconds, "checkpoint_wait_seconds": result.checkpoint_wait_seconds,
            **clock.steady()}


def plain_sft(args, path, rows, full, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(args.device)
    if not full:
        from peft import get_peft_model

        model = get_peft_model(model, lora())
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR)
    steps = []  # per optimizer step of --batch rows: its micro-batches of --plain-micro rows, padded each
    for start in range(0, len(rows), args.batch):
        step = rows[start:start + args.batch]
        micro = []
        for m in range(0, len(step), args.plain_micro):
            b = tokenized(tokenizer, step[m:m + args.plain_micro])
            micro.append([torch.from_numpy(b[k]).to(args.device)
                          for k in ("prompt.input_ids", "prompt.attention_mask", "response")])
        labelled = sum(int((labels[:, 1:] != -100).sum()) for _, _, labels in micro)
        steps.append((micro, labelled))
    autocast = torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.device == "cuda")
    synchronize(args.device)
    with StepClock(SHAPES[args.shape]["vocab_size"]) as clock:
        started = time.perf_counter()
        for micro, labelled in steps:
            for ids, mask, labels in micro:  # the step's mean over its labelled tokens, as one batch would give
                with autocast:
                    logits = model(input_ids=ids, attention_mask=mask).logits
                loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(),
                                                         labels[:, 1:].flatten(), ignore_index=-100,
                                                         reduction="sum") / labelled
                loss.backward()
            torch.nn.utils.clip_grad_norm_(params, CLIP)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        synchronize(args.device)
        seconds = time.perf_counter() - started
    padded = sum(int(ids.numel()) for micro, _ in steps for ids, _, _ in micro)
    del model, optimizer, steps
    return {"seconds": seconds, "padded_positions": padded, "micro_batch_rows": args.plain_micro, **clock.steady()}


def trl_sft(args, path, full, liger):
    """TRL's SFTTrainer in a child process (Liger patches transformers' Llama classes for the whole process)."""
    command = [sys.executable, os.path.abspath(__file__), "--trl-child", "--path", path, "--work", args.work,
               "--device", args.device, "--shape", args.shape, "--sft-rows", str(args.sft_rows), "--batch",
               str(args.batch)] + (["--full"] if full else []) + (["--liger"] if liger else [])
    done = subprocess.run(command, capture_output=True, text=True, timeout=max(90, args.deadline - time.time()))
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"TRL's child exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")


def trl_child(args):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    import trl

    words = words_of(args.shape)
    rows = rows_of(words, args.sft_rows, 64, 1500, seed=1)
    gpu = args.device == "cuda"
    dtype = torch.float32 if args.full else (torch.bfloat16 if gpu else torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.path)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_pretrained(args.path, dtype=dtype)
    data = Dataset.from_dict({"prompt": [p for p, _ in rows], "completion": [" " + r for _, r in rows]})
    config = SFTConfig(output_dir=os.path.join(args.work, "trl"), per_device_train_batch_size=args.batch,
                       num_train_epochs=1, learning_rate=LR, max_grad_norm=CLIP, bf16=gpu, padding_free=True,
                       max_length=None, gradient_checkpointing=False, use_liger_kernel=args.liger,
                       logging_steps=10 ** 6, save_strategy="no", report_to="none", lr_scheduler_type="constant",
                       warmup_steps=0, use_cpu=not gpu, dataloader_num_workers=0, seed=3)
    trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer,
                         peft_config=None if args.full else lora())
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    with StepClock(SHAPES[args.shape]["vocab_size"]) as clock:
        out = trainer.train()
    result = {"seconds": out.metrics["train_runtime"], "trl": trl.__version__, **clock.steady()}
    if gpu:
        result["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
    print("RESULT " + json.dumps(result), flush=True)


# ---------------------------------------------------------------- where a full fine-tune's step goes
PROFILE_STEPS = (2, 1, 4)  # torch.profiler's schedule: steps waited, warmed, recorded (of 8)
KERNEL_KINDS = (("attention", ("flash", "fmha", "attention")), ("matmul", ("gemm", "xmma", "nvjet", "cutlass",
                "cublas", "sm90", "sm80")), ("optimizer", ("multi_tensor", "adam", "foreach")),
                ("copy", ("memcpy", "memset", "copy")), ("reduction", ("reduce", "norm")))


def kernel_kind(name):
    low = name.lower()
    return next((kind for kind, marks in KERNEL_KINDS if any(m in low for m in marks)), "elementwise and other")


def profiled_full(args, path, rows, folder):
    """Ours' full fine-tune of 8 steps (the first 8 x --batch rows) under torch.profiler, steps 4-7 recorded
    (PROFILE_STEPS): the recorded steps' seconds (CUDA events), the GPU's busy share (its kernels' time over
    them), the kernels' time by kind, and the table of the 30 costliest kernels and ops (profile_full.txt in
    `folder`). The store in this process's memory (memory://, removed after): the run's end writes the 15 GB
    checkpoint, which took 58 s to a disk on 2026-11-28 and is not what is asked here."""
    from fsspec.implementations.memory import MemoryFileSystem
    from torch.autograd import DeviceType
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.profiler import ProfilerActivity, profile, schedule

    wait, warm, active = PROFILE_STEPS
    found = {}
    gpu = args.device == "cuda"

    def ready(prof):
        averages = prof.key_averages()
        found["table"] = averages.table(sort_by="self_device_time_total" if gpu else "self_cpu_time_total",
                                        row_limit=30, max_name_column_width=70)
        kinds = {}
        for event in averages:
            if event.device_type == DeviceType.CUDA:
                kind = kernel_kind(event.key)
                kinds[kind] = kinds.get(kind, 0.0) + event.self_device_time_total / 1e6
        found["kernel_seconds"] = kinds

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=activities, schedule=schedule(wait=wait, warmup=warm, active=active, repeat=1),
                 on_trace_ready=ready) as prof, StepClock(SHAPES[args.shape]["vocab_size"]) as clock:
        hook = register_optimizer_step_post_hook(lambda *_: prof.step())
        try:
            steps = wait + warm + active + 1  # rows repeated where there are fewer (--shape tiny's 64)
            wanted = (rows * -(-steps * args.batch // len(rows)))[:steps * args.batch]
            out = ours_sft(args, path, wanted, True, torch.float32, store_url="memory://profile")
        finally:
            hook.remove()
            MemoryFileSystem().rm("/profile", recursive=True)
    first, last = clock.ends[wait + warm - 1], clock.ends[wait + warm + active - 1]
    seconds = last - first if isinstance(last, float) else first.elapsed_time(last) / 1000.0
    with open(os.path.join(folder, "profile_full.txt"), "w") as handle:
        handle.write(found.get("table", "no table: the profiler's schedule did not complete"))
    kinds = found.get("kernel_seconds", {})
    return {"seconds": out["seconds"], "profiled_steps": active, "profiled_seconds": seconds,
            "gpu_busy_share": sum(kinds.values()) / seconds if gpu else None,
            "kernel_seconds_by_kind": kinds, "table": "profile_full.txt"}


# ---------------------------------------------------------------- generation and embeddings
def generated_count(row, stops):
    """The tokens a row generated: up to and with its first stop, else all (the rest is padding)."""
    for n, t in enumerate(row):
        if t in stops:
            return n + 1
    return len(row)


def generation_rows(args, bench, path, words):
    import pyarrow as pa
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from estimator.data.text import Tokenize
    from estimator.lm.continuous import release
    from estimator.predict import inference
    from estimator.predict.kinds.generate import Generate

    gpu = args.device == "cuda"
    names = ["ours", "ours_padded" if gpu else "ours_continuous", "generate@64", "generate_batch", "generate@128",
             *([] if gpu else ["generate@32"])]
    if not bench.has_rows("generation", names):
        return
    tokenizer = AutoTokenizer.from_pretrained(path)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16 if args.device == "cuda"
                                                 else torch.float32).to(args.device).eval()
    prompts = texts_of(words, args.prompts, 32, 512, seed=2)
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    # the stop: one word id in --stop-every ends a row (the random model's greedy tokens spread over the whole
    # vocabulary): outputs of mixed lengths, about --stop-every tokens on average, some reaching --new-tokens
    stops = sorted(random.Random(3).sample(range(len(SPECIALS), len(SPECIALS) + len(words)),
                                           max(1, len(words) // args.stop_every))) + [eos]
    texts = {}

    def counted_tokens(found):
        lengths = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in found]
        return sum(lengths), {"min": min(lengths), "median": float(np.median(lengths)), "max": max(lengths)}

    def ours(batching):
        layout = Generate(feature_cols=("prompt",), batch_size=None, use_gpu=args.device == "cuda",
                          tokenize=Tokenize(tokenizer, ()), max_new_tokens=args.new_tokens,
                          generate_kwargs={"eos_token_id": stops}, batching=batching)
        key = f"bench-{id(model)}"
        inference._CACHE[(key, inference.device_for(layout.use_gpu))] = model
        column = pa.array(prompts, pa.string())
        inference.predict_arrow(key, b"", layout, column.slice(0, 8))  # warm
        synchronize(args.device)
        started = time.perf_counter()
        out = inference.predict_arrow(key, b"", layout, column)
        synchronize(args.device)
        seconds = time.perf_counter() - started
        release(model)  # a kept manager's paged cache freed for the next rows
        name = "ours" if batching == "auto" else f"ours_{batching}"
        texts[name] = out.field(0).to_pylist()
        tokens, spread = counted_tokens(texts[name])
        return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds, "lengths": spread}

    def padded(batch):
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))

        def run(rows):
            width = max(len(ids[i]) for i in rows)
            x = torch.full((len(rows), width), pad, dtype=torch.long)
            m = torch.zeros_like(x)
            for j, i in enumerate(rows):
                x[j, width - len(ids[i]):] = torch.tensor(ids[i])
                m[j, width - len(ids[i]):] = 1
            out = model.generate(input_ids=x.to(args.device), attention_mask=m.to(args.device),
                                 max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=pad,
                                 eos_token_id=stops)
            return out[:, width:].cpu()

        with torch.inference_mode():
            run(order[:min(batch, 8)])
            synchronize(args.device)
            started = time.perf_counter()
            outs = [(order[s:s + batch], run(order[s:s + batch])) for s in range(0, len(order), batch)]
            synchronize(args.device)
        seconds = time.perf_counter() - started
        found = [""] * len(ids)
        for rows, out in outs:
            for j, i in enumerate(rows):
                found[i] = tokenizer.decode(out[j, :generated_count(out[j].tolist(), set(stops))],
                                            skip_special_tokens=True)
        texts[f"generate@{batch}"] = found
        tokens, spread = counted_tokens(found)
        return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds, "lengths": spread}

    def continuous():
        config = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=stops,
                                  pad_token_id=pad)
        # not under inference_mode: the manager's thread updates its own tensors in place (transformers 5.17 on a
        # GPU: "Inplace update to inference tensor outside InferenceMode", every request dropped)
        started = time.perf_counter()
        model.generate_batch(inputs=ids[:8], generation_config=config, progress_bar=False)
        synchronize(args.device)
        warm = time.perf_counter() - started
        started = time.perf_counter()
        out = model.generate_batch(inputs=ids, generation_config=config, progress_bar=False)
        synchronize(args.device)
        seconds = time.perf_counter() - started
        if len(out) != len(ids):
            raise RuntimeError(f"generate_batch returned {len(out)} of {len(ids)} requests (see its log above)")
        found = [""] * len(ids)
        for i, request in enumerate(sorted(out, key=lambda r: int(str(r).split("_")[-1]))):
            found[i] = tokenizer.decode(out[request].generated_tokens, skip_special_tokens=True)
        texts["generate_batch"] = found
        tokens, spread = counted_tokens(found)
        return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds, "lengths": spread,
                "warmup_seconds": warm, "request_ids": [str(r) for r in list(out)[:3]]}

    bench.row("generation", "ours", lambda: ours("auto"))  # continuous batching on a GPU, generate() on a CPU
    bench.row("generation", "ours_padded" if args.device == "cuda" else "ours_continuous",
              lambda: ours("padded" if args.device == "cuda" else "continuous"))
    bench.row("generation", "generate@64", lambda: padded(64))
    bench.row("generation", "generate_batch", continuous)
    bench.row("generation", "generate@128", lambda: padded(128))
    if args.device != "cuda":  # on an H100 at 1B: 459 tokens/s against 694 at 64 and 901 at 128 (RESULTS.md)
        bench.row("generation", "generate@32", lambda: padded(32))
    base = next((k for k in ("generate@64", "generate@128", "generate@32") if k in texts), None)
    if base:  # each pass's texts against its own generate() call's
        bench.results[f"generation_same_text_as_{base}_{bench.phase}"] = {
            k: sum(a == b for a, b in zip(v, texts[base])) for k, v in texts.items()}
        bench.results["generation_prompts"] = len(prompts)
    model = None  # noqa: F841 - the GPU's memory back for the next rows (the closures above are done)
    inference._CACHE.clear()
    free(args.device)


def embedding_rows(args, bench, path, words):
    from transformers import AutoModel, AutoTokenizer

    from estimator.data.text import Tokenize
    from estimator.predict import inference
    from estimator.predict.kinds.embedding import Embedding

    if not bench.has_rows("embeddings", ["ours", "hand, sorted batches of 64"]):
        return
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, dtype=torch.bfloat16 if args.device == "cuda"
                                      else torch.float32).to(args.device).eval()
    texts = texts_of(words, args.texts, 16, 512, seed=4)
    tokens = sum(len(tokenizer(t)["input_ids"]) for t in texts)
    vectors = {}

    def ours():
        layout = Embedding(feature_cols=("text",), batch_size=1024, use_gpu=args.device == "cuda",
                           tokenize=Tokenize(tokenizer, ()))
        seconds, out = timed_predictor(args, model, layout, texts)
        vectors["ours"] = np.array(out.field(0).to_pylist(), dtype=np.float32)
        return {"seconds": seconds, "tokens_per_s": tokens / seconds, "texts_per_s": len(texts) / seconds}

    def hand():
        def run(rows):
            batch = tokenizer([texts[i] for i in rows], padding=True, return_tensors="pt").to(args.device)
            hidden = model(**batch).last_hidden_state.float()
            mask = batch["attention_mask"].unsqueeze(-1).float()
            return ((hidden * mask).sum(1) / mask.sum(1)).cpu().numpy()

        vectors["hand"] = np.zeros((len(texts), model.config.hidden_size), dtype=np.float32)
        seconds = timed_sorted_batches(args, [len(t) for t in texts], run, vectors["hand"])
        return {"seconds": seconds, "tokens_per_s": tokens / seconds, "texts_per_s": len(texts) / seconds}

    bench.row("embeddings", "ours", ours)
    bench.row("embeddings", "hand, sorted batches of 64", hand)
    if len(vectors) == 2:
        bench.results["embeddings_max_abs_difference"] = float(np.abs(vectors["ours"] - vectors["hand"]).max())
    bench.results["embedding_texts"], bench.results["embedding_tokens"] = len(texts), tokens
    model = None  # noqa: F841 - the GPU's memory back for the next rows (the closures above are done)
    inference._CACHE.clear()
    free(args.device)


def score_rows(args, bench, path, words):
    """Issue 67: each text's log-likelihood (output_kind='score', whole texts: every token after the first and
    the EOS) against a hand loop over batches of 64 texts sorted by length, padded, the vocabulary's log-softmax
    over every position at once."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from estimator.data.rows import Text
    from estimator.data.text import Tokenize
    from estimator.predict import inference
    from estimator.predict.kinds.score import Score

    if not bench.has_rows("scores", ["ours", "hand, sorted batches of 64"]):
        return
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16 if args.device == "cuda"
                                                 else torch.float32).to(args.device).eval()
    texts = texts_of(words, args.texts, 16, 512, seed=5)
    encoded = [tokenizer(t)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
    tokens = sum(len(e) - 1 for e in encoded)
    found = {}

    def ours():
        layout = Score(feature_cols=("text",), batch_size=1024, use_gpu=args.device == "cuda",
                       tokenize=Tokenize(tokenizer, ()), rows=Text("text"))
        seconds, out = timed_predictor(args, model, layout, texts)
        found["ours"] = np.array(out.field("logprob").to_pylist())
        return {"seconds": seconds, "tokens_per_s": tokens / seconds, "texts_per_s": len(texts) / seconds}

    def hand():
        def run(rows):
            width = max(len(encoded[i]) for i in rows)
            ids = torch.tensor([encoded[i] + [tokenizer.pad_token_id] * (width - len(encoded[i])) for i in rows],
                               device=args.device)
            mask = torch.tensor([[1] * len(encoded[i]) + [0] * (width - len(encoded[i])) for i in rows],
                                device=args.device)
            logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits[:, :-1].float(), -1)
            picked = logp.gather(2, ids[:, 1:, None]).squeeze(2) * mask[:, 1:]
            return picked.sum(1).double().cpu().numpy()

        found["hand"] = np.zeros(len(texts))
        seconds = timed_sorted_batches(args, [len(e) for e in encoded], run, found["hand"])
        return {"seconds": seconds, "tokens_per_s": tokens / seconds, "texts_per_s": len(texts) / seconds}

    bench.row("scores", "ours", ours)
    bench.row("scores", "hand, sorted batches of 64", hand)
    if len(found) == 2:
        bench.results["scores_max_relative_difference"] = float(
            np.max(np.abs(found["ours"] - found["hand"]) / np.maximum(np.abs(found["hand"]), 1.0)))
    bench.results["score_texts"], bench.results["score_tokens"] = len(texts), tokens
    model = None  # noqa: F841 - the GPU's memory back for the next rows
    inference._CACHE.clear()
    free(args.device)


def grpo_rows(args, bench, path, words):
    """GRPO's sampling (issue 66, batched this session): a rank's prompts x G completions drawn by ours
    (sampled_groups: calls sorted by length within the generation budget, each prompt read once for its group's
    rows, each row's noise its own) against the same calls with generate()'s own sampling (torch.multinomial, one
    generator, each row reading its prompt), and against one call a prompt (how GRPO sampled before).
    Completion tokens/s."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from estimator.lm.generation import batches, sampled_groups

    names = ["ours (each row's stream)", "the same calls, generate's sampling", "one call a prompt"]
    if not bench.has_rows("grpo_sampling", names):
        return
    gpu = args.device == "cuda"
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16 if gpu else torch.float32
                                                 ).to(args.device).eval()
    prompts = [tokenizer(t)["input_ids"] for t in texts_of(words, 16 if gpu else 8, 32, 256, seed=6)]
    group, new = 8, 64 if gpu else 16
    stops = sorted(random.Random(3).sample(range(len(SPECIALS), len(SPECIALS) + len(words)),
                                           max(1, len(words) // args.stop_every))) + [tokenizer.eos_token_id]
    kwargs = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "pad_token_id": tokenizer.pad_token_id,
              "eos_token_id": stops}

    def counted(completions, seconds):
        tokens = sum(len(c) for c in completions)
        return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
                "completions": len(completions)}

    def ours():
        sampled_groups(model, prompts[:2], group, [1, 2], 4, kwargs, args.device)  # warm
        synchronize(args.device)
        started = time.perf_counter()
        out = sampled_groups(model, prompts, group, list(range(len(prompts))), new, kwargs, args.device)
        synchronize(args.device)
        return counted(out, time.perf_counter() - started)

    def theirs(calls):
        def run(call):
            width = max(len(prompts[i]) for i in call)
            rows = [i for i in call for _ in range(group)]
            x = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
            m = torch.zeros_like(x)
            for j, i in enumerate(rows):
                x[j, width - len(prompts[i]):] = torch.tensor(prompts[i])
                m[j, width - len(prompts[i]):] = 1
            out = model.generate(input_ids=x.to(args.device), attention_mask=m.to(args.device), do_sample=True,
                                 max_new_tokens=new, **kwargs)[:, width:].tolist()
            return [row[:next((n + 1 for n, t in enumerate(row) if t in stops), len(row))] for row in out]

        with torch.inference_mode():
            run(calls[0][:1])
            synchronize(args.device)
            started = time.perf_counter()
            out = [c for call in calls for c in run(call)]
            synchronize(args.device)
        return counted(out, time.perf_counter() - started)

    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    together = batches([len(p) * group for p in prompts], order, None, new * group, args.device)
    bench.row("grpo_sampling", names[0], ours)
    bench.row("grpo_sampling", names[1], lambda: theirs(together))
    bench.row("grpo_sampling", names[2], lambda: theirs([[i] for i in range(len(prompts))]))
    bench.results["grpo_sampling_shape"] = {"prompts": len(prompts), "group": group, "max_new_tokens": new}
    model = None  # noqa: F841 - the GPU's memory back for the next rows
    free(args.device)


def timed_predictor(args, model, layout, texts):
    """transform's UDF body (an output kind's predictor) over `texts`, the model cached as an executor's Python
    worker holds it, after a warm-up on 8 texts: (seconds, the Arrow struct it returned)."""
    import pyarrow as pa

    from estimator.predict import inference

    key = f"bench-{type(layout).__name__}-{id(model)}"
    inference._CACHE[(key, inference.device_for(layout.use_gpu))] = model
    column = pa.array(texts, pa.string())
    inference.predict_arrow(key, b"", layout, column.slice(0, 8))
    synchronize(args.device)
    started = time.perf_counter()
    out = inference.predict_arrow(key, b"", layout, column)
    synchronize(args.device)
    return time.perf_counter() - started, out


def timed_sorted_batches(args, lengths, run, out):
    """A hand loop: `run(rows)` over the rows sorted by `lengths`, 64 at a time (a warm-up on the 8 shortest
    first), each batch's results written at its rows of `out`: the seconds."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    with torch.inference_mode():
        run(order[:8])
        synchronize(args.device)
        started = time.perf_counter()
        for s in range(0, len(order), 64):
            out[order[s:s + 64]] = run(order[s:s + 64])
        synchronize(args.device)
    return time.perf_counter() - started


# ---------------------------------------------------------------- the run
# The rows that answer issue 65's targets, run first in every section (the rest in a second pass, while the
# budget lasts): one device call of a few minutes reaches each target's figure before the secondary rows
FIRST = {"lora": {"ours", "ours, gradient_checkpointing='selective'", "TRL + Liger"},
         "generation": {"ours", "generate@128"}, "full": {"ours"},
         "embeddings": {"ours", "hand, sorted batches of 64"}, "scores": {"ours", "hand, sorted batches of 64"},
         "profile": {"ours, full fine-tune"}}


class Bench:
    """Rows tried one by one, each recorded (or its error), the JSON rewritten after each; in two passes
    (`phase`): the FIRST rows of every section, then the others."""

    def __init__(self, args, results):
        self.args, self.results, self.phase = args, results, "first"

    def runs(self, section, name):
        """Whether this pass runs that row."""
        return (name in FIRST.get(section, ())) == (self.phase == "first")

    def has_rows(self, section, names):
        """Whether this pass runs any of the section's rows (else the section's setup is not worth its time)."""
        return any(self.runs(section, name) for name in names)

    def row(self, section, name, fn, flops=None, tokens=None):
        if not self.runs(section, name):
            return
        found = self.results.setdefault(section, {})
        if time.time() > self.args.deadline:
            found[name] = {"skipped": "the budget's seconds had passed"}
            print(f"{section} / {name}: skipped (budget)", flush=True)
            return
        gpu = self.args.device == "cuda"
        free(self.args.device)
        if gpu:
            torch.cuda.reset_peak_memory_stats()
        started = time.time()
        try:
            out = fn()
        except Exception as error:  # a row's failure is recorded; the others still run
            traceback.print_exc()
            out = {"error": f"{type(error).__name__}: {str(error)[:2000]}"}
        out["wall_seconds"] = time.time() - started
        if gpu and "peak_gb" not in out and "error" not in out:
            out["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
        if "seconds" in out and tokens:
            out["tokens_per_s"] = tokens / out["seconds"]
        if "seconds" in out and flops:
            out["tflops"] = flops / out["seconds"] / 1e12
            out["mfu"] = flops / out["seconds"] / (self.args.peak_tflops * 1e12)
        if out.get("steady_steps") and tokens:  # the steps after the warm-up (StepClock)
            out["steady_tokens_per_s"] = tokens * out["steady_share"] / out["steady_seconds"]
            if flops:
                out["steady_mfu"] = flops * out["steady_share"] / out["steady_seconds"] / (
                    self.args.peak_tflops * 1e12)
        found[name] = out
        print(f"{section} / {name}: {json.dumps(out)}", flush=True)
        self.save()

    def save(self):
        if self.args.json:
            with open(self.args.json, "w") as handle:
                json.dump(self.results, handle, indent=1)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    parser.add_argument("--shape", default=None, choices=tuple(SHAPES))
    parser.add_argument("--budget", type=float, default=330.0, help="seconds after which rows are skipped")
    parser.add_argument("--sft-rows", type=int, default=None)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--plain-micro", type=int, default=None, help="the plain loop's rows a forward (the "
                        "step's --batch rows in micro-batches; default 4 on a GPU, where 16 padded rows of a 1B "
                        "model ran out of an H100's memory, else --batch)")
    parser.add_argument("--prompts", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--texts", type=int, default=None)
    parser.add_argument("--stop-every", type=int, default=64, help="one word in this many stops a generated row")
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--skip", default="", help="comma-separated sections to leave out: lora,generation,full,"
                                                   "embeddings,scores,grpo,profile")
    parser.add_argument("--json")
    parser.add_argument("--work")
    parser.add_argument("--trl-child", action="store_true")
    parser.add_argument("--path")
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--liger", action="store_true")
    args = parser.parse_args(argv)
    gpu = args.device == "cuda"
    args.shape = args.shape or ("1b" if gpu else "tiny")
    args.sft_rows = args.sft_rows or (512 if gpu else 64)
    args.plain_micro = args.plain_micro or (4 if gpu else args.batch)
    if args.trl_child:
        return trl_child(args)
    args.prompts = args.prompts or (256 if gpu else 48)
    args.new_tokens = args.new_tokens or (128 if gpu else 24)
    args.texts = args.texts or (4000 if gpu else 200)
    args.deadline = time.time() + args.budget
    args.work = args.work or tempfile.mkdtemp(prefix="bench-gpu-lm-")
    skip = set(filter(None, args.skip.split(",")))
    import transformers

    results = {"device": torch.cuda.get_device_name(0) if gpu else f"{os.cpu_count()} CPU cores",
               "torch": torch.__version__, "transformers": transformers.__version__, "shape": args.shape,
               "batch_rows": args.batch, "sft_rows": args.sft_rows}
    from importlib import metadata

    for name in ("peft", "trl", "liger-kernel", "datasets"):
        try:
            results[name] = metadata.version(name)
        except Exception as error:  # noqa: BLE001 - recorded, the rows that need it fail on their own
            results[name] = f"not importable: {type(error).__name__}"
    bench = Bench(args, results)
    started = time.time()
    path, words = build(os.path.join(args.work, "llama"), args.shape, args.device)
    n, layers, hidden = counted(path)
    results.update(parameters_that_multiply=n, build_seconds=time.time() - started)
    print(f"built {args.shape}: {n / 1e9:.3f}B multiplying parameters in {time.time() - started:.1f} s", flush=True)
    bench.save()
    rows = rows_of(words, args.sft_rows, 64, 1500, seed=1)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    masks = tokenized(tokenizer, rows)["prompt.attention_mask"]
    lengths = [int(x) for x in masks.sum(axis=1)]
    tokens = sum(lengths)
    results.update(sft_tokens=tokens, sft_mean_row_tokens=tokens / len(rows), sft_longest_row=max(lengths))
    base_dtype = torch.bfloat16 if gpu else torch.float32
    for bench.phase in ("first", "rest"):
        for section in ("lora", "generation", "full"):
            if section in skip:
                continue
            if section == "generation":
                generation_rows(args, bench, path, words)
                continue
            full = section == "full"
            flops = train_flops(path, lengths, full)
            dtype = torch.float32 if full else base_dtype
            bench.row(section, "ours", lambda: ours_sft(args, path, rows, full, dtype), flops, tokens)
            bench.row(section, "ours, gradient_checkpointing='selective'",
                      lambda: ours_sft(args, path, rows, full, dtype, "selective"), flops, tokens)
            if gpu:
                bench.row(section, "TRL + Liger", lambda: trl_sft(args, path, full, True), flops, tokens)
            bench.row(section, "plain HF, padded" if full else "plain HF+PEFT, padded",
                      lambda: plain_sft(args, path, rows, full, dtype), flops, tokens)
            bench.row(section, "TRL SFTTrainer, padding-free", lambda: trl_sft(args, path, full, False), flops,
                      tokens)
        if "embeddings" not in skip:
            embedding_rows(args, bench, path, words)
        if "scores" not in skip:
            score_rows(args, bench, path, words)
        if "grpo" not in skip:
            grpo_rows(args, bench, path, words)
        if "profile" not in skip:
            bench.row("profile", "ours, full fine-tune", lambda: profiled_full(
                args, path, rows, os.path.dirname(os.path.abspath(args.json or args.work))))
        if "lora" not in skip and gpu:
            bench.row("lora", "ours, float32 base", lambda: ours_sft(args, path, rows, False, torch.float32),
                      train_flops(path, lengths, False), tokens)
    results["total_seconds"] = time.time() - started
    bench.save()
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
