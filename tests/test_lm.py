"""Fine-tuning a causal LM (SFT) on the rank side, without Spark (LocalLauncher): the labels of prompt/response
and chat rows, the token-weighted loss (2 ranks of batch b = one plain PEFT loop of batch 2b), LoRA checkpoints
(the adapters only, resumed exactly), fsdp + LoRA = ddp + LoRA, gradient checkpointing."""
import copy
import dataclasses
import functools
import re

import numpy as np
import pytest
import torch

from estimator.core.spec import LMSpec
from estimator.data.rows import Chat, PromptResponse, Text
from estimator.data.lm import IGNORE, CausalLMTokenize, chat_tokens
from estimator.launch.local import LocalLauncher
from estimator.train.checkpoint import load_checkpoint, restore
from lm_helpers import CHAT_TEMPLATE, color_facts, lm_rows, lm_train_spec, plain_causal_lm, save_pretrained_llama

peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    facts = color_facts()
    return save_pretrained_llama(str(tmp_path_factory.mktemp("llama") / "tiny"), [p + r for p, r in facts] * 4)


@pytest.fixture(scope="module")
def tokenizer(llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llama)


def lora(dropout=0.0):
    return peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules="all-linear", task_type="CAUSAL_LM")


def tokenized(tokenizer, rows, max_length=None):
    batch = {"prompt": np.array([p for p, _ in rows], dtype=object),
             "response": np.array([r for _, r in rows], dtype=object)}
    return CausalLMTokenize(tokenizer, LMSpec(PromptResponse("prompt", "response")), max_length)(batch)


def test_the_prompt_and_the_padding_carry_no_loss_and_the_response_and_eos_do(tokenizer):
    rows = lm_rows(3)
    batch = tokenized(tokenizer, rows)
    ids, mask, labels = batch["prompt.input_ids"], batch["prompt.attention_mask"], batch["response"]
    for i, (prompt, response) in enumerate(rows):
        p = len(tokenizer(prompt)["input_ids"])
        r = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        assert (labels[i, :p] == IGNORE).all()  # the prompt: no loss
        assert labels[i, p:p + len(r)].tolist() == r == ids[i, p:p + len(r)].tolist()  # the response and eos
        assert (labels[i, p + len(r):] == IGNORE).all() and (mask[i, p + len(r):] == 0).all()  # padding
        assert mask[i, :p + len(r)].all()
    cut = tokenized(tokenizer, rows, max_length=9)  # the response loses its end first
    assert cut["prompt.input_ids"].shape[1] == 9 and (cut["response"] != IGNORE).sum() > 0


def test_a_text_column_learns_every_token_and_completion_only_loss_false_learns_the_prompt_too(tokenizer):
    texts = {"text": np.array(["The kettle is teal.", "Drums are red and loud."], dtype=object)}
    batch = CausalLMTokenize(tokenizer, LMSpec(Text("text")), None)(texts)
    ids, labels, mask = batch["text.input_ids"], batch["text.labels"], batch["text.attention_mask"]
    assert (labels[mask == 1] == ids[mask == 1]).all() and (labels[mask == 0] == IGNORE).all()
    assert tokenizer.decode(ids[0][mask[0] == 1], skip_special_tokens=False).endswith("teal.</s>")
    rows = {"prompt": np.array(["What color is the kettle?"], dtype=object),
            "response": np.array([" The kettle is teal."], dtype=object)}
    only = CausalLMTokenize(tokenizer, LMSpec(PromptResponse("prompt", "response")), None)(rows)
    every = CausalLMTokenize(tokenizer, LMSpec(PromptResponse("prompt", "response"), every_token=True), None)(rows)
    assert (only["prompt.input_ids"] == every["prompt.input_ids"]).all()
    assert (every["response"] == every["prompt.input_ids"]).all() and (only["response"] == IGNORE).sum() > 3


@pytest.mark.parametrize("text", [False, True], ids=["prompt-response", "whole-text"])
def test_a_packed_batch_gives_each_row_its_own_logits_and_the_unpacked_loss(llama, tokenizer, text):
    """packing=True: a batch's rows in one sequence with no padding, positions from 0 per row, their boundaries
    given, no attention_mask: through the packed attention each row's logits are those it has alone, and the
    loss sums (loss, labelled tokens, rows) are the unpacked batch's; whole texts too (every token labelled: no
    row learns the next's)."""
    from estimator.lm.packed_attention import use_packed_attention
    from estimator.train.objectives.tokens import ModelFailed, TokenObjective, check_packed

    rows = lm_rows(7)
    batch = ({"text": np.array([p + r for p, r in rows], dtype=object)} if text else
             {"prompt": np.array([p for p, _ in rows], dtype=object),
              "response": np.array([r for _, r in rows], dtype=object)})
    spec = LMSpec(Text("text")) if text else LMSpec(PromptResponse("prompt", "response"))
    plain = CausalLMTokenize(tokenizer, spec, None)(batch)
    pack = CausalLMTokenize(tokenizer, dataclasses.replace(spec, packed=True), None)(batch)
    col = spec.column
    ids, positions, bounds = pack[f"{col}.input_ids"], pack[f"{col}.position_ids"], pack[f"{col}.cu_seq_lens_q"]
    mask = plain[f"{col}.attention_mask"]
    assert f"{col}.attention_mask" not in pack and ids.shape == (1, mask.sum())  # no padding at all
    assert list(bounds) == [0, *np.cumsum(mask.sum(axis=1))] and list(np.flatnonzero(positions[0] == 0)) == \
        list(bounds[:-1])
    unpacked = plain_causal_lm(llama).eval()
    model = plain_causal_lm(llama).eval()
    use_packed_attention(model)
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(ids), position_ids=torch.from_numpy(positions),
                       cu_seq_lens_q=torch.from_numpy(bounds), use_cache=False).logits[0]
        for row, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
            assert list(plain[f"{col}.input_ids"][row][mask[row] == 1]) == list(ids[0, a:b])
            alone = unpacked(input_ids=torch.from_numpy(plain[f"{col}.input_ids"][row:row + 1, :b - a])).logits[0]
            assert torch.allclose(logits[a:b], alone, atol=1e-4), row

    def sums(arrays, on):
        features = {k.split(".", 1)[1]: torch.from_numpy(v) for k, v in arrays.items()
                    if k.startswith(col + ".") and k != spec.labels_key}
        return TokenObjective().on_batch(on, ([features], [torch.from_numpy(arrays[spec.labels_key])], None))[1]

    with torch.no_grad():
        want, got = sums(plain, unpacked), sums(pack, model)
    assert got[1:].tolist() == want[1:].tolist() and got[0].item() == pytest.approx(want[0].item(), rel=1e-5)

    features = {k.split(".", 1)[1]: torch.from_numpy(v) for k, v in pack.items() if k != spec.labels_key}
    check_packed(model, features)  # a Llama keeps each packed row to itself

    class NoPositions(torch.nn.Module):  # a model whose attention ignores packed rows: refused, by name
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, position_ids, cu_seq_lens_q, use_cache):
            return self.inner(input_ids=input_ids, use_cache=use_cache)

    with pytest.raises(ModelFailed, match="packing=True: a row packed after another got other logits"):
        check_packed(NoPositions(unpacked), features)
    with pytest.raises(ValueError, match="not one packed sequence with its rows' boundaries"):
        model(input_ids=torch.from_numpy(ids), position_ids=torch.from_numpy(positions))


def test_chat_rows_label_only_the_assistant_turns_with_their_end(tokenizer):
    messages = [{"role": "system", "content": "Answer with a color."},
                {"role": "user", "content": "What color is the kettle?"}, {"role": "assistant", "content": "teal"},
                {"role": "user", "content": "And the drum?"}, {"role": "assistant", "content": "red"}]
    ids, labels = chat_tokens(tokenizer, messages, "chat")
    assert tokenizer.decode([i for i, l in zip(ids, labels) if l != IGNORE]) == "teal</s>red</s>"
    assert [l for l in labels if l != IGNORE] == [i for i, l in zip(ids, labels) if l != IGNORE]
    with pytest.raises(ValueError, match="'role' and 'content'"):
        CausalLMTokenize(tokenizer, LMSpec(Chat("chat")), None)({"chat": np.array([[{"role": "user"}]], dtype=object)})


TOOL_TEMPLATE = (
    "{% if tools %}<|system|>tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}</s>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{% if m['name'] is defined %}[{{ m['name'] }}] {% endif %}"
    "{{ m['content'] }}{% if m['tool_calls'] is defined %}{% for c in m['tool_calls'] %}"
    "<call>{{ c['function']['name'] }}({{ c['function']['arguments'] }})</call>{% endfor %}{% endif %}</s>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]


def test_a_chat_with_tool_calls_renders_as_its_template_does_and_the_calls_are_learned(tokenizer):
    """Messages as a Spark struct column gives them (every field, null where a message has none): the assistant's
    tool_calls, the tool's name and chat_tools reach the template; the call is labelled, the tool's answer not."""
    from estimator.lm.generation import generate_texts
    from estimator.predict.language_checks import check_chat_fields

    tokenizer = copy_with_template(tokenizer, TOOL_TEMPLATE)
    call = [{"type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]
    row = [{"role": "user", "content": "Weather in Oslo?", "tool_calls": None, "name": None},
           {"role": "assistant", "content": None, "tool_calls": np.array(call, dtype=object), "name": None},
           {"role": "tool", "content": "rain", "tool_calls": None, "name": "weather"},
           {"role": "assistant", "content": "It rains.", "tool_calls": None, "name": None}]
    batch = CausalLMTokenize(tokenizer, LMSpec(Chat("chat", tuple(TOOLS))), None)(
        {"chat": np.array([row], dtype=object)})
    ids, labels = batch["chat.input_ids"][0], batch["chat.labels"][0]
    as_template = [{k: v for k, v in m.items() if v is not None} for m in row]
    as_template[1] = {"role": "assistant", "content": "", "tool_calls": call}
    want = tokenizer.apply_chat_template(as_template, tools=TOOLS, tokenize=True, return_dict=False)
    assert list(ids) == list(want)
    text = tokenizer.decode(ids)
    assert "tools: weather" in text and '<call>weather({"city": "Oslo"})</call>' in text and "[weather] rain" in text
    learned = tokenizer.decode([i for i, l in zip(ids, labels) if l != IGNORE])
    assert learned == '<call>weather({"city": "Oslo"})</call></s>It rains.</s>'  # the call and the answer
    check_chat_fields(tokenizer, "chat", ["role", "content", "tool_calls", "name"], TOOLS)  # all read: no error
    with pytest.raises(ValueError, match=r"messages hold \['tool_calls', 'name'\].*never reads them"):
        check_chat_fields(copy_with_template(tokenizer, CHAT_TEMPLATE), "chat", ["role", "content", "tool_calls",
                                                                               "name"], None)
    with pytest.raises(ValueError, match="chat_tools is set.*never reads 'tools'"):
        check_chat_fields(copy_with_template(tokenizer, CHAT_TEMPLATE), "chat", ["role", "content"], TOOLS)
    prompt = np.array([row[:3]], dtype=object)  # generation continues after the tool's answer, the tools shown
    model = plain_causal_lm_of(tokenizer)
    (text,) = generate_texts(model, tokenizer, prompt, True, "chat", None, "cpu", 4, None, TOOLS)
    rendered = tokenizer.apply_chat_template(as_template[:3], tools=TOOLS, add_generation_prompt=True,
                                             tokenize=True, return_dict=False)
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([rendered]), max_new_tokens=4, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    assert text == tokenizer.decode(out[0, len(rendered):], skip_special_tokens=True)


def copy_with_template(tokenizer, template):
    import copy

    other = copy.deepcopy(tokenizer)
    other.chat_template, other.model_max_length = template, 256  # the tools make a conversation longer than 64
    return other


def plain_causal_lm_of(tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    return LlamaForCausalLM(config).eval()


def test_rows_left_without_a_response_token_are_counted_over_the_whole_table(llama, tokenizer, store):
    from estimator.fit.language import check_room, rows_without_room

    rows = lm_rows(40)
    for at in (20, 33, 39):  # beyond the dry run's first rows
        rows[at] = ("Tell me " * 4 + rows[at][0], rows[at][1])
    data = lm_train_spec(store, llama, rows, batch=4, epochs=1, max_length=24).data
    labelled = (tokenized(tokenizer, rows, max_length=24)["response"] != IGNORE).sum(axis=1)
    assert rows_without_room(data, data.train, tokenizer, 24)[:3] == (40, int((labelled == 0).sum()), 0) == (40, 3, 0)
    with pytest.raises(ValueError, match=r"column 'prompt' .* max_length=24: 3 of 40 training rows\. .*raise "
                                         r"max_length above \d+ \(the longest prompt's tokens\) or drop those rows"):
        check_room(data, tokenizer, None)
    check_room(dataclasses.replace(data, max_length=None), tokenizer, None)  # the tokenizer's 64: room in each
    # a completion sampled on the ranks (GRPO's max_new_tokens) after the longest prompt, within the positions
    model, whole = plain_causal_lm(llama), dataclasses.replace(data, max_length=None)
    longest = rows_without_room(whole, whole.train, tokenizer, None)[3]
    check_room(whole, tokenizer, model, 64 - longest)
    with pytest.raises(ValueError, match=rf"The longest prompt of column 'prompt' takes {longest} tokens, and a "
                       rf"completion of max_new_tokens={65 - longest} after it passes the model's 64 positions: .* "
                       rf"longer than {longest - 1} tokens, or set max_new_tokens to at most {64 - longest}\."):
        check_room(whole, tokenizer, model, 65 - longest)
    user = {"role": "user", "content": "What color is the kettle?"}
    chats = [[user, {"role": "assistant", "content": "teal"}], [user], [user, {"role": "user", "content": "Well?"}]]
    chat = lm_train_spec(store, llama, chats, batch=4, epochs=1, chat=True, run="c").data
    with pytest.raises(ValueError, match=r"2 of 3 training rows \(2 of them chats with no assistant turn\)\. Such a "
                                         r"row trains nothing: drop those rows first\.$"):
        check_room(chat, tokenizer, None)
    shared = [[{"role": "human", "content": "What color is the kettle?"}, {"role": "gpt", "content": "teal"}]] * 3
    chat = lm_train_spec(store, llama, shared, batch=4, epochs=1, chat=True, run="g").data  # ShareGPT's roles
    with pytest.raises(ValueError, match=r"3 of 3 training rows \(3 of them chats with no assistant turn\).* roles "
                       r"include 'gpt', 'human'; .*F\.transform\('chat', lambda m: m\.withField\('role', "
                       r"F\.when\(m\.role == 'gpt', 'assistant'\)\.when\(m\.role == 'human', 'user'\)\."
                       r"otherwise\(m\.role\)\)\)"):
        check_room(chat, tokenizer, None)


@pytest.mark.parametrize("batch, every, packed", [(4, 1, False), (2, 2, False), (4, 1, True)],
                         ids=["batch-4", "accumulated", "packed"])
def test_two_ranks_of_lora_sft_equal_one_plain_peft_loop_of_batch_2b(llama, tokenizer, store, batch, every, packed):
    """The loss is averaged over response tokens of the whole step (both ranks, and every batch of an
    accumulation window), not over each rank's batch: the rows' responses differ in length, so a mean of the
    ranks' means would train other weights. Packed (each rank's 4 rows in fewer sequences), the same."""
    ranks, steps, epochs, lr = 2, 4, 2, 1e-2
    rows = lm_rows(ranks * 4 * steps)
    results = LocalLauncher().run(lm_train_spec(store, llama, rows, batch=batch, epochs=epochs, peft_config=lora(),
                                                lr=lr, backward_passes_per_step=every, packed=packed), ranks)
    batch = batch * every  # each rank's rows of one optimizer step
    plain = plain_causal_lm(llama, lora())
    optimizer = torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=lr)
    half, losses = len(rows) // ranks, []
    for _ in range(epochs):
        total, tokens = 0.0, 0
        for step in range(steps):  # step s: batch s of every rank, together
            part = [rows[r * half + step * batch + i] for r in range(ranks) for i in range(batch)]
            b = {k: torch.from_numpy(v) for k, v in tokenized(tokenizer, part).items()}
            out = plain(input_ids=b["prompt.input_ids"], attention_mask=b["prompt.attention_mask"],
                        labels=b["response"])  # the model's own loss: the mean over the labelled tokens
            out.loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            count = int((b["response"][:, 1:] != IGNORE).sum())
            total, tokens = total + out.loss.item() * count, tokens + count
        losses.append(total / tokens)
    history = results[0].history
    assert [row["loss"] for row in history] == pytest.approx(losses, rel=1e-5)
    assert history[-1]["perplexity"] == pytest.approx(np.exp(losses[-1]), rel=1e-5)
    trained = plain_causal_lm(llama, lora(), seed=0)
    restore(store, store.run("r"), store.run("r").checkpoint, trained, None)
    state, expected = trained.state_dict(), plain.state_dict()
    for name in (n for n, p in plain.named_parameters() if p.requires_grad):
        difference = (state[name] - expected[name]).abs().max()
        assert torch.allclose(state[name], expected[name], atol=2e-5), (name, difference)
    start = plain_causal_lm(llama, lora())
    assert not torch.allclose(start.state_dict()[name], state[name])  # it trained


def test_a_lora_checkpoint_holds_the_adapters_and_resumes_exactly(llama, store):
    rows = lm_rows(24)
    LocalLauncher().run(lm_train_spec(store, llama, rows, batch=4, epochs=2, peft_config=lora(), run="whole"), 2)
    once = lm_train_spec(store, llama, rows, batch=4, epochs=1, peft_config=lora(), run="split")
    LocalLauncher().run(once, 2)
    LocalLauncher().run(dataclasses.replace(once, epochs=2, resume_from=store.run("split").checkpoint), 2)
    whole, split = (load_checkpoint(store, store.run(r).checkpoint) for r in ("whole", "split"))
    base = plain_causal_lm(llama)
    assert set(whole["model"]) == {n for n, p in plain_causal_lm(llama, lora()).named_parameters() if p.requires_grad}
    assert all("lora_" in name for name in whole["model"]) and whole["contents"] == "trainable"
    adapter_bytes = sum(t.numel() * t.element_size() for t in whole["model"].values())
    base_bytes = sum(t.numel() * t.element_size() for t in base.state_dict().values())
    assert len(store.read_bytes(store.run("whole").checkpoint)) < base_bytes / 2  # no frozen weight in the file
    assert adapter_bytes < base_bytes / 4
    for name, value in whole["model"].items():
        assert torch.equal(value, split["model"][name]), name
    assert [r["loss"] for r in whole["history"]] == [r["loss"] for r in split["history"]]


def test_balanced_windows_keep_the_drawn_rows_and_batch_sizes_and_even_out_the_batches():
    """packing=True with shuffle: each window of batches holds the rows drawn, each once, in batches of the drawn
    sizes, about equally long (the longest less the shortest: 27 characters, drawn 180-472); a resumed epoch's batches are the
    uninterrupted epoch's from where it stopped."""
    from estimator.data.balance import balance

    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 200, size=8 * 4 + 3)  # 8 batches of 4, a last batch of 3
    rows = np.array(["x" * int(n) for n in lengths], dtype=object)
    drawn = [{"prompt": rows[i:i + 4], "response": np.array([""] * len(rows[i:i + 4]), dtype=object),
              "id": np.arange(i, min(i + 4, len(rows)))} for i in range(0, len(rows), 4)]
    spec = LMSpec(PromptResponse("prompt", "response"), packed=True)
    out = list(balance(iter(drawn), spec, window=4))
    assert [len(b["id"]) for b in out] == [len(b["id"]) for b in drawn]
    for w in range(0, len(drawn), 4):
        assert sorted(np.concatenate([b["id"] for b in out[w:w + 4]])) == list(
            np.concatenate([b["id"] for b in drawn[w:w + 4]]))
    def spreads(batches):  # per full window of 4, the longest batch's characters less the shortest's
        return [max(sums) - min(sums) for sums in ([sum(len(r) for r in b["prompt"]) for b in batches[w:w + 4]]
                                                   for w in (0, 4))]

    assert spreads(drawn) == [472, 180] and spreads(out) == [27, 27]  # within the longest row (199): LPT's bound
    for b in out:
        assert [len(r) for r in b["prompt"]] == [lengths[i] for i in b["id"]]  # the columns stay together
    for skip in (1, 3, 4, 6):
        start = skip - skip % 4
        again = list(balance(iter(drawn[start:]), spec, drop=skip - start, window=4))
        assert [b["id"].tolist() for b in again] == [b["id"].tolist() for b in out[skip:]]


def test_a_packed_run_cut_inside_an_epoch_resumes_to_the_uninterrupted_runs_weights(llama, store):
    """packing=True, shuffled (the batches balanced in windows of 8), 24 rows in batches of 4 (6 steps), a
    checkpoint every 2 steps, the run cut before step 5 and resumed from its checkpoint at step 4, inside the
    window: the same adapters and loss as the run never cut."""
    from estimator.core.faults import Fault
    from estimator.failures import RankFailed

    rows = lm_rows(24)
    LocalLauncher().run(lm_train_spec(store, llama, rows, batch=4, epochs=1, peft_config=lora(), run="whole",
                                      packed=True, shuffle=True), 1)
    cut = lm_train_spec(store, llama, rows, batch=4, epochs=1, peft_config=lora(), run="cut", packed=True,
                        checkpoint_steps=2, shuffle=True)
    with pytest.raises(RankFailed):
        LocalLauncher(faults=(Fault("step", 0, "raise", step=5),)).run(cut, 1)
    assert load_checkpoint(store, cut.run.checkpoint)["position"]["step"] == 4
    LocalLauncher().run(dataclasses.replace(cut, resume_from=cut.run.checkpoint, attempt=1, launch_id="again"), 1)
    whole, again = (load_checkpoint(store, store.run(r).checkpoint) for r in ("whole", "cut"))
    for name, value in whole["model"].items():
        assert torch.allclose(value, again["model"][name], atol=1e-6), name
    assert again["history"][-1]["loss"] == pytest.approx(whole["history"][-1]["loss"], rel=1e-6)


@pytest.mark.parametrize("adapters", [True, False], ids=["lora", "whole"])
def test_fsdp_with_lora_trains_as_ddp_with_lora(llama, store, adapters):
    """Also the whole model trained (its output head too: the chunked loss's gradients reach fsdp's shards)."""
    rows, config = lm_rows(16), (lora() if adapters else None)
    for strategy in ("ddp", "fsdp"):
        LocalLauncher().run(lm_train_spec(store, llama, rows, batch=4, epochs=1, peft_config=config,
                                          run=f"{strategy}-{adapters}", strategy=strategy, lr=1e-3), 2)
    models = {}
    for strategy in ("ddp", "fsdp"):
        models[strategy] = plain_causal_lm(llama, config, seed=0)
        run = store.run(f"{strategy}-{adapters}")
        restore(store, run, run.checkpoint, models[strategy], None)
    ddp, fsdp = (m.state_dict() for m in models.values())
    untrained = plain_causal_lm(llama, config, seed=0).state_dict()
    assert any("lora_" in k for k in ddp) == adapters
    assert not torch.equal(ddp["lm_head.weight" if not adapters else next(k for k in ddp if "lora_B" in k)],
                           untrained["lm_head.weight" if not adapters else next(k for k in ddp if "lora_B" in k)])
    for name in ddp:
        assert torch.allclose(ddp[name], fsdp[name], atol=1e-5), (name, (ddp[name] - fsdp[name]).abs().max())


def test_fsdp_under_bf16_mixed_keeps_the_frozen_base_in_bf16_and_changes_no_number(llama, tokenizer, monkeypatch):
    """The policy gathers every parameter in bf16 for compute: a frozen base stored in bf16 gives the same loss and
    gradients bit for bit, in half the bytes; the adapters stay float32 (the optimizer steps on them)."""
    import torch.distributed as dist

    from estimator.train import sharding
    from estimator.train.distributed import forget_sharding_specs

    batch = tokenized(tokenizer, lm_rows(4))
    inputs = dict(input_ids=torch.tensor(batch["prompt.input_ids"]),
                  attention_mask=torch.tensor(batch["prompt.attention_mask"]), labels=torch.tensor(batch["response"]))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    got = {}
    try:
        for cast in (True, False):
            monkeypatch.setattr(sharding, "is_adapted", lambda model: cast)  # False: as before, the base in float32
            model = plain_causal_lm(llama, lora(), seed=0)
            sharding.shard(model, None, "bf16-mixed", torch.device("cpu"), 1)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(**inputs).loss
            loss.backward()
            params = dict(model.named_parameters())
            got[cast] = (loss.detach(), {n: p.grad.full_tensor() for n, p in params.items() if p.requires_grad},
                         {(p.requires_grad, p.dtype) for p in params.values()},
                         sum(p.to_local().numel() * p.element_size() for p in params.values() if not p.requires_grad))
    finally:
        dist.destroy_process_group()
        forget_sharding_specs()
    (loss, grads, dtypes, frozen), (loss32, grads32, dtypes32, frozen32) = got[True], got[False]
    assert dtypes == {(False, torch.bfloat16), (True, torch.float32)} and dtypes32 == {(False, torch.float32),
                                                                                     (True, torch.float32)}
    assert frozen * 2 == frozen32
    assert torch.equal(loss, loss32) and grads.keys() == grads32.keys() and len(grads) > 0
    for name in grads:
        assert torch.equal(grads[name], grads32[name]), name


@pytest.mark.parametrize("objective", ["sft", "dpo", "grpo"])
def test_ddp_under_bf16_mixed_keeps_the_frozen_linears_in_bf16_and_changes_no_number(llama, store, monkeypatch,
                                                                                      objective):
    """precision='bf16-mixed' under ddp: the base's frozen linear layers are stored in bf16 on the rank (what
    autocast computes them in anyway; the embeddings, norms and adapters stay float32). The history and the
    adapters are those of the run that kept them in float32, bit for bit: SFT's steps and validation, DPO's
    reference pass, GRPO's sampling and its reference (now under autocast as the steps are)."""
    from estimator.train.objectives.grpo import GRPO
    from estimator.train.objectives.preference import DPO
    from estimator.train.precision import Precision
    from test_grpo import colour_rows, low_ids, names_answer
    from test_preference import pairs

    casting = Precision.frozen_linears_cast.__func__
    cast_counts = []
    rows, make = {"sft": (lm_rows(8), lambda: None), "dpo": (pairs(8), lambda: DPO(beta=0.5)),
                  "grpo": (colour_rows(6), lambda: GRPO([low_ids, names_answer], num_generations=2,
                                                         max_new_tokens=5, beta=0.04))}[objective]
    runs, trained = {}, {}
    for cast in (True, False):
        monkeypatch.setattr(Precision, "frozen_linears_cast", classmethod(
            lambda cls, model: cast_counts.append(casting(cls, model)) or cast_counts[-1] if cast else 0))
        run = f"frozen-{objective}-{cast}"
        runs[cast] = LocalLauncher().run(lm_train_spec(store, llama, rows[:6], batch=2, epochs=2, run=run,
                                                       peft_config=lora(), objective=make(), val_rows=rows[6:],
                                                       precision="bf16-mixed"), 1)[0].history
        trained[cast] = load_checkpoint(store, store.run(run).checkpoint)["model"]
    from transformers import AutoConfig

    layers = AutoConfig.from_pretrained(llama).num_hidden_layers
    assert cast_counts == [7 * layers + 1]  # each layer's 7 projections and the untied head
    timeless = [[{k: v for k, v in row.items() if k != "data_wait"} for row in runs[c]] for c in (True, False)]
    assert timeless[0] == timeless[1] and len(timeless[0][0]) > 3
    assert trained[True].keys() == trained[False].keys() and all(
        t.dtype == torch.float32 for t in trained[True].values())
    for name, value in trained[False].items():
        assert torch.equal(trained[True][name], value), name


def test_the_frozen_linears_cast_leaves_a_tied_head_the_norms_and_the_adapters_and_computes_the_same(llama):
    from transformers import AutoModelForCausalLM

    from estimator.train.precision import BF16Mixed, Precision

    torch.manual_seed(0)
    tied = AutoModelForCausalLM.from_pretrained(llama)
    tied.lm_head.weight = tied.model.embed_tokens.weight  # one tensor: the embedding's lookup and the head's
    model = peft.get_peft_model(tied, lora())
    before = copy.deepcopy(model)
    assert Precision.frozen_linears_cast(model) == 0  # precision='32': nothing
    layers = model.config.num_hidden_layers
    assert BF16Mixed.frozen_linears_cast(model) == 7 * layers  # the head is the embedding's: left
    for name, param in model.named_parameters():
        linear_base = "base_layer" in name and "layers." in name
        assert param.dtype == (torch.bfloat16 if linear_base else torch.float32), name
    ids = torch.arange(20).reshape(2, 10) % 40 + 3
    got = []
    for m in (model, before):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
            text = m.generate(input_ids=ids[:1, :4], max_new_tokens=6, do_sample=False, pad_token_id=0)
        got.append((loss.detach(), {n: p.grad for n, p in m.named_parameters() if p.requires_grad}, text))
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][2], got[1][2])
    for name, grad in got[1][1].items():
        assert torch.equal(got[0][1][name], grad), name


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_gradient_checkpointing_all_or_selective_changes_no_number(llama, store, packed):
    """The recomputation in backward repeats the forward's ops on the same inputs (dropout's draws too): the loss
    and the trained adapters are those of the run that kept every activation, bit for bit, under bf16 autocast
    (and through the packed attention, whose rows' boundaries the recomputed forward reads again)."""
    rows = lm_rows(8)
    runs, trained = {}, {}
    for mode in (False, True, "selective"):
        run = f"gc-{packed}-{mode}"
        runs[mode] = LocalLauncher().run(lm_train_spec(store, llama, rows, batch=4, epochs=1, run=run, packed=packed,
                                                       peft_config=lora(dropout=0.1), precision="bf16-mixed",
                                                       gradient_checkpointing=mode), 1)[0]
        trained[mode] = load_checkpoint(store, store.run(run).checkpoint)["model"]
    for mode in (True, "selective"):
        assert runs[mode].history[0]["loss"] == runs[False].history[0]["loss"], mode
        assert trained[mode].keys() == trained[False].keys()
        for name in trained[mode]:
            assert torch.equal(trained[mode][name], trained[False][name]), (mode, name)


def test_selective_checkpointing_keeps_the_projections_and_attention_and_recomputes_the_adapters_and_the_rest(
        llama, monkeypatch):
    """gradient_checkpointing='selective': a layer keeps the outputs of its 7 projections (q, k, v, o, gate, up,
    down) and of its attention, and nothing else; the adapters' two low-rank products a projection (rank 4 against
    widths of 32-128) and every elementwise op are recomputed, under autocast as without it."""
    from collections import Counter

    from torch.utils.checkpoint import CheckpointPolicy

    from estimator.train import memory

    decided = []

    def recorded(ctx, op, *args, **kwargs):
        policy = kept(ctx, op, *args, **kwargs)
        if not ctx.is_recompute:
            decided.append((op.name(), policy))
        return policy

    kept = memory.kept
    monkeypatch.setattr(memory, "kept", recorded)
    model = plain_causal_lm(llama, lora()).train()
    assert memory.checkpoint_activations(model, None, "selective") == "hugging face, selective"
    layers = model.config.num_hidden_layers
    ids = torch.arange(24).reshape(2, 12) % 50 + 3
    for autocast in (False, True):
        decided.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss.backward()
        saved = Counter(name for name, policy in decided if policy == CheckpointPolicy.MUST_SAVE)
        assert saved == {"aten::mm": 7 * layers, "aten::_scaled_dot_product_flash_attention_for_cpu": layers}
        recomputed = Counter(name for name, policy in decided if policy == CheckpointPolicy.PREFER_RECOMPUTE)
        assert recomputed["aten::mm"] == 2 * 7 * layers and len(recomputed) > 5, recomputed


def test_sampling_with_a_seed_writes_the_same_text_again_and_another_seed_another(llama, tokenizer):
    from estimator.lm.generation import generate_texts

    model, prompts = plain_causal_lm(llama).eval(), [p for p, _ in lm_rows(6)]

    def texts(**kwargs):
        return generate_texts(model, tokenizer, prompts, False, "prompt", 4, "cpu", 12, kwargs).tolist()

    sampled = texts(do_sample=True, top_k=0, temperature=2.0, seed=7)
    assert texts(do_sample=True, top_k=0, temperature=2.0, seed=7) == sampled
    assert texts(do_sample=True, top_k=0, temperature=2.0, seed=8) != sampled != texts()
    assert texts() == texts()  # greedy without a seed


def test_a_prompt_that_leaves_no_room_for_max_new_tokens_in_the_positions_is_refused_by_its_row(
        llama, tokenizer, monkeypatch):
    """Past max_position_embeddings transformers only warns and writes garbage: a prompt's tokens plus
    max_new_tokens up to the positions generate, one more is refused with the longest prompt and both fixes."""
    from estimator.lm.generation import generate_texts

    model = plain_causal_lm(llama).eval()
    long = "What is " + "the very long and winding thing " * 2 + "?"
    prompts = [p for p, _ in lm_rows(4)] + [long]
    tokens = len(tokenizer(long)["input_ids"])
    monkeypatch.setattr(model.config, "max_position_embeddings", tokens + 4)
    assert len(generate_texts(model, tokenizer, prompts, False, "prompt", None, "cpu", 4, None)) == 5
    with pytest.raises(ValueError, match=rf"1 of the 5 prompts of column 'prompt' in this batch leave no room for "
                       rf"max_new_tokens=5 in the model's {tokens + 4} positions .*'What is the very.* takes "
                       rf"{tokens} tokens.*at most {tokens - 1} tokens, or lower max_new_tokens to 4 or less"):
        generate_texts(model, tokenizer, prompts, False, "prompt", None, "cpu", 5, None)


def test_generation_batched_by_tokens_keeps_each_call_within_the_bound_and_writes_each_prompts_own_text(
        llama, tokenizer, monkeypatch):
    """inference_batch_size=None: each generate() call takes the shortest prompts left while rows x (their longest
    prompt + max_new_tokens) stays within the CPU's GENERATE_TOKENS (here 120); the texts are those of one prompt a
    call."""
    from estimator.lm import generation

    model = plain_causal_lm(llama).eval()
    prompts = [p for p, _ in lm_rows(10)] + ["What is " + "the very long and winding thing " * 2 + "?"]
    shapes = []
    real = model.generate

    def counted(**kwargs):
        shapes.append(tuple(kwargs["input_ids"].shape))
        return real(**kwargs)

    monkeypatch.setattr(model, "generate", counted)
    monkeypatch.setitem(generation.GENERATE_TOKENS, "cpu", 120)
    got = generation.generate_texts(model, tokenizer, prompts, False, "prompt", None, "cpu", 8, None).tolist()
    assert len(shapes) > 1 and max(rows for rows, _ in shapes) > 1 and sum(rows for rows, _ in shapes) == 11
    assert all(rows * (width + 8) <= 120 for rows, width in shapes), shapes
    one_by_one = generation.generate_texts(model, tokenizer, prompts, False, "prompt", 1, "cpu", 8, None).tolist()
    assert got == one_by_one and len(set(got)) > 1


def stops_and_prompts(model, tokenizer, count, new_tokens):
    """Prompts, and stop tokens taken from their greedy texts at different steps: rows end at different steps."""
    from estimator.lm.generation import generate_texts

    prompts = [p for p, _ in lm_rows(count)] + ["Tell me " * 6]
    texts = generate_texts(model, tokenizer, prompts, False, "prompt", None, "cpu", new_tokens, None,
                           batching="padded")
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    return prompts, sorted({ids[0][2], ids[1][5], ids[2][9], tokenizer.eos_token_id})


def test_continuous_batching_writes_model_generates_texts_and_keeps_its_manager_between_batches(llama, tokenizer):
    """generation_batching='continuous' (transformers' manager on a paged cache, rows leaving as they end): greedy,
    the texts the padded generate() writes, for the base and with LoRA adapters, rows ending at different steps;
    the manager kept on the model for the next Arrow batch, built anew for other generate_kwargs."""
    from estimator.lm.generation import generate_texts

    base = plain_causal_lm(llama).eval()
    adapted = plain_causal_lm(llama, lora()).eval()
    with torch.no_grad():  # adapters that change the text (peft starts lora_B at zero)
        for name, value in adapted.named_parameters():
            if "lora_B" in name:
                value.normal_(0, 0.5)
    prompts, stops = stops_and_prompts(base, tokenizer, 12, 16)
    found = {}
    for model in (base, adapted):
        def texts(batching, **kwargs):
            return generate_texts(model, tokenizer, prompts, False, "prompt", None, "cpu", 16,
                                  {"eos_token_id": stops, **kwargs}, batching=batching).tolist()

        padded, continuous = texts("padded"), texts("continuous")
        assert continuous == padded
        assert len({len(t) for t in padded}) > 4 and len(set(padded)) == len(padded)  # mixed lengths, own texts
        kept = model._cached_continuous_batching_manager
        assert texts("continuous") == padded and model._cached_continuous_batching_manager is kept
        assert texts("continuous", top_k=5) == padded  # greedy: top_k changes no pick, but another manager
        assert model._cached_continuous_batching_manager is not kept
        found[model] = continuous
    assert found[base] != found[adapted]  # the adapters count


def test_continuous_batching_samples_by_the_seed_and_honours_top_k(llama, tokenizer):
    from estimator.lm.generation import generate_texts

    model, prompts = plain_causal_lm(llama).eval(), [p for p, _ in lm_rows(6)]

    def texts(batching="continuous", **kwargs):
        return generate_texts(model, tokenizer, prompts, False, "prompt", None, "cpu", 12, kwargs,
                              batching=batching).tolist()

    sampled = texts(do_sample=True, top_k=0, temperature=2.0, seed=7)
    assert texts(do_sample=True, top_k=0, temperature=2.0, seed=7) == sampled
    assert texts(do_sample=True, top_k=0, temperature=2.0, seed=8) != sampled != texts()
    assert texts(do_sample=True, top_k=1, temperature=2.0, seed=8) == texts("padded")  # top_k=1 is greedy


def test_generation_batching_auto_takes_continuous_batching_on_a_gpu_where_it_can_and_continuous_is_refused_where_not(
        llama):
    from estimator.lm.generation import batching_for
    from estimator.predict.language_checks import check_generation_batching

    model = plain_causal_lm(llama)
    assert batching_for("auto", model, "cuda:0", {"do_sample": True, "top_p": 0.9, "seed": 1}) == "continuous"
    assert batching_for("auto", model, "cpu", None) == "padded"  # slower there (benchmarks/RESULTS.md)
    assert batching_for("auto", model, "cuda", {"num_beams": 2}) == "padded"
    assert batching_for("auto", torch.nn.Linear(2, 2), "cuda", None) == "padded"
    assert batching_for("padded", model, "cuda", None) == "padded"
    assert batching_for("continuous", model, "cpu", None) == "continuous"
    p = {"model": model, "generation_batching": "continuous", "generate_kwargs": {"repetition_penalty": 1.2}}
    with pytest.raises(ValueError, match=r"'generation_batching' parameter of TorchModel is 'continuous', and "
                                         r"generate_kwargs \['repetition_penalty'\] are model.generate's only.*"
                                         r"set generation_batching='padded'"):
        check_generation_batching(p, "TorchModel")
    with pytest.raises(ValueError, match="Linear has no continuous_batching_context_manager"):
        check_generation_batching({**p, "model": torch.nn.Linear(2, 2), "generate_kwargs": None})
    check_generation_batching({**p, "generation_batching": "auto"})  # auto falls back instead


def test_an_eos_token_in_generate_kwargs_ends_the_text_where_it_is_written(llama, tokenizer):
    """generate_kwargs' own eos_token_id (a chat's end-of-turn token) and pad_token_id win over the tokenizer's."""
    from estimator.lm.generation import generate_texts

    model, prompt = plain_causal_lm(llama).eval(), lm_rows(1)[0][0]
    ids = tokenizer([prompt], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        greedy = model.generate(input_ids=ids, max_new_tokens=12, do_sample=False,
                                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    second = int(greedy[0, ids.shape[1] + 1])  # the second token it writes, made the end

    def text(**kwargs):
        return generate_texts(model, tokenizer, [prompt], False, "prompt", 1, "cpu", 12, kwargs)[0]

    full, cut = text(), text(eos_token_id=second, pad_token_id=second)
    assert full.startswith(cut) and len(cut) < len(full), (full, cut)


def test_stop_strings_end_the_text_with_the_models_own_tokenizer_not_passed_again(llama, tokenizer):
    """generate() matches stop_strings in the decoded text and asks for the tokenizer to do it; transform has the
    model's, and a wheel trial's generate_kwargs={'stop_strings': [...]} failed on the executors asking for it."""
    from estimator.lm.generation import generate_texts

    model, prompt = plain_causal_lm(llama).eval(), lm_rows(1)[0][0]
    full = generate_texts(model, tokenizer, [prompt], False, "prompt", 1, "cpu", 12, {})[0]
    stop = re.search(r"[a-z]{2}", full[len(full) // 3:])  # letters of the text's later part (the random model's)
    assert stop, full
    cut = generate_texts(model, tokenizer, [prompt], False, "prompt", 1, "cpu", 12, {"stop_strings": [stop[0]]})[0]
    assert full.startswith(cut) and stop[0] in cut and len(cut) < len(full), (full, cut)  # ends in its token



def test_a_handle_whose_base_is_gone_says_where_it_is_built_and_what_to_do(tmp_path):
    """transform builds a LoRA fit's base on each executor from its factory (estimator.core.handle): a folder moved
    since the fit is named there with the fixes, not left to transformers' 'Repo id must be in the form...'."""
    from transformers import AutoModelForCausalLM

    from estimator.core.handle import BaseUnavailable, ModelHandle

    missing = str(tmp_path / "moved")
    handle = ModelHandle(functools.partial(AutoModelForCausalLM.from_pretrained, missing), lora(), b"")
    with pytest.raises(BaseUnavailable, match="each executor for transform.*moved.*" + re.escape(missing) +
                       "|" + re.escape(missing) + ".*each executor for transform.*moved or deleted.*"
                       "save_pretrained"):
        handle.build()


def test_two_classes_from_one_folder_are_two_models_to_the_executors_cache(tmp_path):
    """The executors keep built models by the handle's key: AutoModelForCausalLM.from_pretrained and
    AutoModel.from_pretrained are one function bound to two classes, and a generate transform followed by an
    embedding one over the same folder was given the causal LM (a wheel trial: 'it returned
    CausalLMOutputWithPast'). Their keys differ; the same class and folder keep one key."""
    from transformers import AutoModel, AutoModelForCausalLM

    from estimator.core.handle import ModelHandle

    folder = str(tmp_path / "base")

    def key(cls, **kwargs):
        return ModelHandle(functools.partial(cls.from_pretrained, folder, **kwargs), None, b"").key

    assert key(AutoModelForCausalLM) != key(AutoModel)
    assert key(AutoModelForCausalLM) == key(AutoModelForCausalLM) != key(AutoModelForCausalLM, dtype=torch.bfloat16)
