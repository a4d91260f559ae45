"""A causal LM's fine-tuning and generation on CUDA (`bash .ci/gpu`): LoRA SFT on the GPU equals a plain PEFT loop
there, bf16-mixed trains, and transform's generation (sorted, left-padded batches, and continuous batching)
writes what model.generate writes for each prompt alone; DPO with its reference precomputed trains as with the
adapters off; GRPO samples the CPU's completions. Skipped without a CUDA device; no Spark (LocalLauncher,
inference's batch function)."""
import pyarrow as pa
import pytest
import torch

from estimator.launch.local import LocalLauncher
from estimator.train.checkpoint import restore
from lm_helpers import color_facts, lm_rows, lm_train_spec, plain_causal_lm, save_pretrained_llama

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]
peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_pretrained_llama(str(tmp_path_factory.mktemp("llama") / "tiny"), [p + r for p, r in color_facts()])


def lora():
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")


def test_lora_sft_on_the_gpu_equals_a_plain_peft_loop_there(llama, store):
    from transformers import AutoTokenizer

    from estimator.core.spec import LMSpec
    from estimator.data.rows import PromptResponse
    from estimator.data.lm import CausalLMTokenize
    import numpy as np

    rows, batch = lm_rows(16), 4
    (result,) = LocalLauncher().run(lm_train_spec(store, llama, rows, batch=batch, epochs=1, peft_config=lora(),
                                                  use_gpu=True), 1)
    assert result.device == "cuda:0"
    tokenizer = AutoTokenizer.from_pretrained(llama)
    plain = plain_causal_lm(llama, lora()).to("cuda:0")
    optimizer = torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=1e-2)
    for start in range(0, len(rows), batch):
        part = rows[start:start + batch]
        b = CausalLMTokenize(tokenizer, LMSpec(PromptResponse("prompt", "response")), None)(
            {"prompt": np.array([p for p, _ in part], dtype=object),
             "response": np.array([r for _, r in part], dtype=object)})
        b = {k: torch.from_numpy(v).to("cuda:0") for k, v in b.items()}
        plain(input_ids=b["prompt.input_ids"], attention_mask=b["prompt.attention_mask"],
              labels=b["response"]).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    trained = plain_causal_lm(llama, lora(), seed=0)
    restore(store, store.run("r"), store.run("r").checkpoint, trained, None)
    expected = {k: v.cpu() for k, v in plain.state_dict().items()}
    for name, value in trained.state_dict().items():
        if "lora_" in name:
            assert torch.allclose(value, expected[name], atol=1e-4), name
    (mixed,) = LocalLauncher().run(lm_train_spec(store, llama, rows, batch=batch, epochs=2, peft_config=lora(),
                                                 use_gpu=True, precision="bf16-mixed", run="bf16"), 1)
    assert mixed.history[-1]["loss"] < mixed.history[0]["loss"]


@pytest.mark.parametrize("batching", ["padded", "auto"])
def test_generation_in_transform_on_the_gpu_writes_what_generate_writes(llama, batching):
    """'auto' on a GPU: transformers' continuous batching (its manager kept on the model), as the padded batches."""
    from transformers import AutoTokenizer

    from estimator.data.text import Tokenize
    from estimator.predict import inference
    from estimator.predict.kinds.generate import Generate

    tokenizer = AutoTokenizer.from_pretrained(llama)
    model = plain_causal_lm(llama).to("cuda").eval()
    prompts = [p for p, _ in lm_rows(12)] + ["What is it?"]
    layout = Generate(feature_cols=("prompt",), batch_size=5, use_gpu=True, tokenize=Tokenize(tokenizer, ()),
                      max_new_tokens=8, batching=batching)
    inference._CACHE[("gpu-lm", "cuda")] = model
    got = inference.predict_arrow("gpu-lm", b"", layout, pa.array(prompts, pa.string())).field(0).to_pylist()
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            ids = tokenizer([prompt], return_tensors="pt").to("cuda")
            out = model.generate(**ids, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id)
            expected.append(tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))
    assert got == expected
    assert (getattr(model, "_estimator_continuous", None) is not None) == (batching == "auto")
    inference._CACHE.clear()


def test_the_chunked_loss_on_the_gpu_equals_the_plain_loss_in_float32_and_under_bf16_autocast(llama):
    """The fit's causal-LM loss (the output head applied chunk by chunk to the labelled positions: issue 53) on CUDA:
    the plain float32 cross entropy over the model's logits and its gradients, and under bf16 autocast the plain
    loss of the bf16 logits upcast (what a model's own loss does) within bf16's rounding."""
    import numpy as np
    from transformers import AutoTokenizer

    from estimator.core.spec import LMSpec
    from estimator.data.rows import PromptResponse
    from estimator.data.lm import CausalLMTokenize
    from estimator.lm import chunked_loss
    from estimator.train.objectives.tokens import TokenObjective, token_loss

    rows = lm_rows(8)
    tokens = CausalLMTokenize(AutoTokenizer.from_pretrained(llama), LMSpec(PromptResponse("prompt", "response")), None)(
        {"prompt": np.array([p for p, _ in rows], dtype=object), "response": np.array([r for _, r in rows],
                                                                                      dtype=object)})
    ids, mask, labels = (torch.from_numpy(tokens[k]).to("cuda") for k in ("prompt.input_ids",
                                                                          "prompt.attention_mask", "response"))
    batch = ([{"input_ids": ids, "attention_mask": mask}], [labels], None)
    model = plain_causal_lm(llama, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                   task_type="CAUSAL_LM", init_lora_weights=False)).to("cuda")
    assert chunked_loss.output_head(model.train())[0] is not None

    def grads(loss):
        model.zero_grad(set_to_none=True)
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    for dtype in (None, torch.bfloat16):
        with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
            want = token_loss(model(**batch[0][0]).logits, labels)[0]
        want_grads = grads(want)
        with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
            got = TokenObjective().on_batch(model, batch)[0]
        got_grads = grads(got)
        tolerance = 1e-5 if dtype is None else 2e-2
        assert got.dtype == torch.float32 and got.item() == pytest.approx(want.item(), rel=tolerance)
        for name, value in want_grads.items():
            error = (got_grads[name] - value).abs().max().item()
            assert error <= tolerance * max(value.abs().max().item(), 1e-6), (dtype, name, error)


@pytest.mark.parametrize("mode", ["bf16", "bf16-autocast", "fp32"])
def test_packed_rows_on_the_gpu_each_get_the_logits_they_get_alone(llama, store, monkeypatch, mode):
    """packing=True on CUDA: a bf16 model, or float32 under bf16 autocast, goes through torch's variable-length
    flash attention (where this torch has it) and float32 through the row-by-row path; either way each packed
    row's logits are those it gets alone (bf16's rounding apart), and a packed LoRA fit in bf16-mixed trains."""
    import contextlib

    import numpy as np
    from transformers import AutoTokenizer

    from estimator.core.spec import LMSpec
    from estimator.data.rows import PromptResponse
    from estimator.data.lm import CausalLMTokenize
    from estimator.lm import packed_attention

    flash = []
    original = packed_attention.flash_rows
    monkeypatch.setattr(packed_attention, "flash_rows",
                        lambda *a: flash.append(original(*a)) or flash[-1])
    rows = lm_rows(7)
    batch = {"prompt": np.array([p for p, _ in rows], dtype=object),
             "response": np.array([r for _, r in rows], dtype=object)}
    pack = CausalLMTokenize(AutoTokenizer.from_pretrained(llama), LMSpec(PromptResponse("prompt", "response"), packed=True),
                            None)(batch)
    ids, positions, bounds = (torch.from_numpy(pack[f"prompt.{k}"]).to("cuda")
                              for k in ("input_ids", "position_ids", "cu_seq_lens_q"))
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    alone_model = plain_causal_lm(llama).to("cuda", dtype).eval()
    model = plain_causal_lm(llama).to("cuda", dtype).eval()
    packed_attention.use_packed_attention(model)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if mode == "bf16-autocast"
                else contextlib.nullcontext())
    with torch.no_grad(), autocast:
        logits = model(input_ids=ids, position_ids=positions, cu_seq_lens_q=bounds, use_cache=False).logits[0]
        for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
            alone = alone_model(input_ids=ids[:, a:b]).logits[0]
            scale = alone.float().abs().max().item()
            error = (logits[a:b].float() - alone.float()).abs().max().item()
            assert error <= (3e-2 if mode != "fp32" else 1e-4) * scale, (mode, a, error)
    used_flash = any(out is not None for out in flash)
    assert used_flash == (mode != "fp32" and packed_attention.varlen_attention() is not None), (mode, len(flash))
    print(f"packed attention on {torch.cuda.get_device_name()} ({mode}): flash={used_flash}, torch {torch.__version__}")
    if mode == "bf16-autocast":
        (fit,) = LocalLauncher().run(lm_train_spec(store, llama, lm_rows(32), batch=8, epochs=3, peft_config=lora(),
                                                   use_gpu=True, precision="bf16-mixed", packed=True, run="packed"), 1)
        assert fit.history[-1]["loss"] < fit.history[0]["loss"]


def test_selective_checkpointing_on_the_gpu_trains_the_packed_lora_fit_as_without_it(llama, store):
    """gradient_checkpointing='selective' on CUDA, packed rows through the variable-length flash attention (kept,
    not recomputed) under bf16-mixed: the same losses and adapters as the fit that kept every activation."""
    from estimator.train.checkpoint import load_checkpoint

    runs, adapters = {}, {}
    for mode in (False, "selective"):
        (runs[mode],) = LocalLauncher().run(lm_train_spec(
            store, llama, lm_rows(32), batch=8, epochs=2, peft_config=lora(), use_gpu=True, precision="bf16-mixed",
            packed=True, gradient_checkpointing=mode, run=f"sac-{mode}"), 1)
        adapters[mode] = load_checkpoint(store, store.run(f"sac-{mode}").checkpoint)["model"]
    assert [h["loss"] for h in runs["selective"].history] == pytest.approx(
        [h["loss"] for h in runs[False].history], rel=1e-5)
    for name, value in adapters[False].items():
        assert torch.allclose(adapters["selective"][name], value, atol=1e-5), name


def test_the_frozen_linears_kept_in_bf16_on_the_gpu_train_as_kept_in_float32(llama, store, monkeypatch):
    """ddp under bf16-mixed on CUDA: the base's frozen linear layers stored in bf16 (what autocast casts them to
    at each forward) give the history and the adapters of the fit that kept them in float32."""
    from estimator.train.checkpoint import load_checkpoint
    from estimator.train.precision import Precision

    casting = Precision.frozen_linears_cast.__func__
    histories, adapters, counts = {}, {}, []
    for cast in (True, False):
        monkeypatch.setattr(Precision, "frozen_linears_cast", classmethod(
            lambda cls, model: counts.append(casting(cls, model)) or counts[-1] if cast else 0))
        (fit,) = LocalLauncher().run(lm_train_spec(store, llama, lm_rows(32), batch=8, epochs=2, peft_config=lora(),
                                                   use_gpu=True, precision="bf16-mixed", run=f"frozen-{cast}"), 1)
        histories[cast] = [h["loss"] for h in fit.history]
        adapters[cast] = load_checkpoint(store, store.run(f"frozen-{cast}").checkpoint)["model"]
    assert counts and counts[0] > 0
    assert histories[True] == pytest.approx(histories[False], rel=1e-6)
    for name, value in adapters[False].items():
        assert torch.allclose(adapters[True][name], value, atol=1e-6), name


def test_dpo_on_the_gpu_with_its_reference_precomputed_trains_as_with_the_adapters_off(llama, store):
    """bf16-mixed DPO under LoRA on the GPU: the reference read from the table the rank computed before training
    (under the same autocast) trains as the reference computed live with the adapters off, to bf16's noise."""
    from sft_example import COLORS

    from estimator.train.objectives.preference import DPO

    rows = [(p, r, r.replace(c, COLORS[(COLORS.index(c) + 1) % len(COLORS)]))
            for p, r in lm_rows(16) for c in [next(c for c in COLORS if c in r)]]
    histories = {}
    for reference in ("adapters", "precomputed"):
        (result,) = LocalLauncher().run(lm_train_spec(store, llama, rows, batch=4, epochs=2, peft_config=lora(),
                                                      objective=DPO(beta=0.5, reference=reference), use_gpu=True,
                                                      precision="bf16-mixed", run=reference, reference_key="gpu"), 1)
        assert result.device == "cuda:0"
        histories[reference] = [row["loss"] for row in result.history]
    assert histories["precomputed"] == pytest.approx(histories["adapters"], rel=2e-2)
    assert histories["adapters"][-1] < histories["adapters"][0]


def test_grpo_sampling_on_the_gpu_draws_the_cpus_noise_and_completions(llama):
    """Each row's noise is a hash (integers only): the same uniforms on CUDA as on the CPU, bit for bit; and the
    completions sampled on the GPU in float32 are those sampled on the CPU (one call of three prompts on each)."""
    from transformers import AutoTokenizer

    from estimator.lm.generation import sampled_groups
    from estimator.lm.sampling import uniforms

    seeds = torch.tensor([1, 2, -5, 2 ** 62])
    assert torch.equal(uniforms(seeds, 7, 5000), uniforms(seeds.cuda(), 7, 5000).cpu())
    tokenizer = AutoTokenizer.from_pretrained(llama)
    prompts = [tokenizer(p)["input_ids"] for p, _ in lm_rows(3)]
    kwargs = {"temperature": 1.2, "top_k": 0, "top_p": 0.95, "pad_token_id": tokenizer.pad_token_id,
              "eos_token_id": tokenizer.eos_token_id}
    model = plain_causal_lm(llama).eval()
    on_cpu = sampled_groups(model, prompts, 4, [11, 12, 13], 8, kwargs, "cpu")
    on_gpu = sampled_groups(model.to("cuda:0"), prompts, 4, [11, 12, 13], 8, kwargs, "cuda:0")
    assert on_gpu == on_cpu
