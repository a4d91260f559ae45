"""Preference tuning (DPO, IPO: estimator.train.objectives.preference) on the ranks, against hand computations and
a plain loop, with a tiny Llama built here."""
import contextlib
import copy
import dataclasses
import os
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from estimator.core.spec import LMSpec
from estimator.data.rows import Pairs
from estimator.data.lm import IGNORE, CausalLMTokenize
from estimator.launch.local import LocalLauncher
from estimator.train.checkpoint import load_checkpoint, restore
from lm_helpers import color_facts, lm_train_spec, plain_causal_lm
from sft_example import COLORS
from test_lm import llama, lora, tokenizer  # noqa: F401 - the tiny Llama, its tokenizer, the LoRA config

SPEC = LMSpec(Pairs("prompt", "chosen", "rejected"))


def pairs(count, seed=0):
    """(prompt, chosen, rejected): each fact's colour, and another colour (answers of different lengths)."""
    rng, facts = random.Random(seed), color_facts()
    out = []
    for i in range(count):
        prompt, chosen = facts[i % len(facts)]
        noun, colour = chosen[len(" The "):-1].split(" is ")
        wrong = rng.choice([c for c in COLORS if c != colour])
        out.append((prompt, chosen + " Really." * (i % 3), f" The {noun} is {wrong}."))
    return out


def batch_of(tokenizer, triples):
    raw = {k: np.array([t[i] for t in triples], dtype=object) for i, k in enumerate(("prompt", "chosen", "rejected"))}
    out = CausalLMTokenize(tokenizer, SPEC, None)(raw)
    return {k: torch.from_numpy(v) for k, v in out.items()}


def answer_logp(model, tokenizer, prompt, answer, mean=False):
    """An answer's log-probability after its prompt, the row alone (no padding), token by token."""
    ids = tokenizer(prompt)["input_ids"] + tokenizer(answer, add_special_tokens=False)["input_ids"]
    ids.append(tokenizer.eos_token_id)
    start = len(tokenizer(prompt)["input_ids"])
    logps = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), -1)
    picked = [float(logps[t - 1, ids[t]]) for t in range(start, len(ids))]
    return sum(picked) / len(picked) if mean else sum(picked)


def trained_adapters(llama, seed=1):
    """A LoRA model whose adapters are not zero (the policy differs from the reference)."""
    model = plain_causal_lm(llama, lora())
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    return model.eval()


@pytest.mark.parametrize("loss_type, sft_weight", [("sigmoid", 0.0), ("ipo", 0.0), ("sigmoid", 0.7)])
def test_a_batch_loss_and_rewards_equal_a_hand_computation_with_the_frozen_base_as_reference(llama, tokenizer,
                                                                                             loss_type, sft_weight):
    """The reference is the trained model with its adapters off: the same scores as a separate copy of the base
    (no adapters at all), each answer scored alone, unpadded, token by token."""
    from estimator.train.objectives.preference import DPO

    triples, beta = pairs(5), 0.3
    policy, base = trained_adapters(llama), plain_causal_lm(llama).eval()
    dpo = DPO(beta=beta, loss_type=loss_type, sft_weight=sft_weight)
    b = batch_of(tokenizer, triples)
    features = [{"input_ids": b["prompt.input_ids"], "attention_mask": b["prompt.attention_mask"]}]
    with torch.no_grad():
        loss, sums = dpo.on_batch(policy, (features, [b["chosen"]], None))
    want_losses, rewards = [], []
    with torch.no_grad():
        for prompt, chosen, rejected in triples:
            pc, pr = (answer_logp(policy, tokenizer, prompt, a) for a in (chosen, rejected))
            rc, rr = (answer_logp(base, tokenizer, prompt, a) for a in (chosen, rejected))
            if loss_type == "sigmoid":
                want_losses.append(-np.log(1 / (1 + np.exp(-beta * ((pc - pr) - (rc - rr))))))
            else:  # IPO over the mean token log-probabilities (TRL's); the rewards from the sums either way
                (mc, mr), (nc, nr) = ([answer_logp(m, tokenizer, prompt, a, mean=True) for a in (chosen, rejected)]
                                      for m in (policy, base))
                want_losses.append(((mc - mr) - (nc - nr) - 1 / (2 * beta)) ** 2)
            if sft_weight:  # the chosen answer's mean token NLL, weighted
                want_losses[-1] -= sft_weight * answer_logp(policy, tokenizer, prompt, chosen, mean=True)
            rewards.append((beta * (pc - rc), beta * (pr - rr)))
    chosen_r, rejected_r = np.array(rewards).T
    assert float(loss) == pytest.approx(sum(want_losses), rel=1e-4)
    named = dict(zip(DPO.layout.slots, sums.tolist()))
    assert named["loss_weight"] == named["rows"] == 5
    assert named["metric:rewards/chosen"] == pytest.approx(chosen_r.sum(), rel=1e-4, abs=1e-6)
    assert named["metric:rewards/rejected"] == pytest.approx(rejected_r.sum(), rel=1e-4, abs=1e-6)
    assert named["metric:rewards/accuracies"] == (chosen_r > rejected_r).sum()
    assert 0 < named["metric:rewards/accuracies"] < 5  # both outcomes in the batch: the count is checked
    assert named["metric:rewards/margins"] == pytest.approx((chosen_r - rejected_r).sum(), rel=1e-4, abs=1e-6)
    assert policy.base_model.model.model.layers[0].self_attn.q_proj.lora_B["default"].weight.abs().sum() > 0


def plain_dpo_loss(model, b, beta, frozen=None):
    """DPO's loss, the mean over the batch's pairs, from one padded forward with the adapters and one without (or
    one of a `frozen` copy of the base)."""
    def scores(logits):
        target = b["chosen"][:, 1:]
        logps = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, target.clamp(min=0)[..., None])[..., 0]
        return (logps * (target != IGNORE)).sum(1)

    inputs = dict(input_ids=b["prompt.input_ids"], attention_mask=b["prompt.attention_mask"])
    with torch.no_grad(), (contextlib.nullcontext() if frozen is not None else model.disable_adapter()):
        (frozen or model).eval()
        reference = scores((frozen or model)(**inputs).logits)
        model.train()
    policy = scores(model(**inputs).logits)
    n = len(policy) // 2
    h = (policy[:n] - policy[n:]) - (reference[:n] - reference[n:])
    return -F.logsigmoid(beta * h).mean()


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_of_dpo_pairs_equal_one_plain_loop_of_twice_the_pairs(llama, tokenizer, store, strategy):
    """2 ranks x 2 pairs = one process of 4 pairs: the loss is a mean over the step's pairs on all ranks; the
    adapters trained and the history's loss are the plain loop's (ddp with gradient checkpointing, fsdp with the
    selective one, the checkpoint holding the adapters only), TensorBoard's epoch scalars the history's. Under fsdp too (the base sharded, the reference its forward with the
    adapters off)."""
    from estimator.train.objectives.preference import DPO

    ranks, batch, steps, epochs, lr, beta = 2, 2, 3, 2, 1e-2, 0.5
    rows = pairs(ranks * batch * steps)
    results = LocalLauncher().run(lm_train_spec(store, llama, rows, batch=batch, epochs=epochs, peft_config=lora(),
                                                lr=lr, objective=DPO(beta=beta), strategy=strategy,
                                                gradient_checkpointing=True if strategy == "ddp" else "selective",
                                                tensorboard=True), ranks)
    assert load_checkpoint(store, store.run("r").checkpoint)["contents"] == "trainable"  # the adapters only
    losses, plain = plain_dpo_run(llama, tokenizer, rows, ranks, batch, epochs, lr, beta, lora())
    history = results[0].history
    assert [row["loss"] for row in history] == pytest.approx(losses, rel=1e-5)
    assert {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins"} <= set(history[-1])
    events = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator").EventAccumulator(
        store.run("r").logs)
    events.Reload()
    for key in ("loss", "rewards/margins", "rewards/accuracies"):  # TensorBoard's epoch scalars: the history's
        assert [p.value for p in events.Scalars(f"epoch/{key}")] == pytest.approx([row[key] for row in history]), key
    assert history[0]["loss"] == pytest.approx(losses[0]) and losses[-1] < losses[0]  # it learned
    trained = plain_causal_lm(llama, lora(), seed=0)
    restore(store, store.run("r"), store.run("r").checkpoint, trained, None)
    state, expected = trained.state_dict(), plain.state_dict()
    for name in (n for n, p in plain.named_parameters() if p.requires_grad):
        assert torch.allclose(state[name], expected[name], atol=2e-5), (name, (state[name] - expected[name]).abs().max())


def plain_dpo_run(llama, tokenizer, rows, ranks, batch, epochs, lr, beta, peft_config):
    """The plain loop of what `ranks` ranks of `batch` pairs train (unshuffled), the reference a frozen base: the
    per-epoch losses, and the model."""
    plain = plain_causal_lm(llama, peft_config)
    frozen = None if peft_config is not None else copy.deepcopy(plain).requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=lr)
    half, steps, losses = len(rows) // ranks, len(rows) // (ranks * batch), []
    for _ in range(epochs):
        total = 0.0
        for step in range(steps):
            part = [rows[r * half + step * batch + i] for r in range(ranks) for i in range(batch)]
            loss = plain_dpo_loss(plain, batch_of(tokenizer, part), beta, frozen)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            total += float(loss.detach()) * len(part)
        losses.append(total / len(rows))
    return losses, plain


@pytest.mark.parametrize("strategy, adapters, reference", [("ddp", False, None), ("fsdp", False, None),
                                                           ("ddp", True, "precomputed"), ("ddp", False, "copy")])
def test_a_reference_computed_before_training_trains_as_a_frozen_base_beside_the_model(llama, tokenizer, store,
                                                                                       strategy, adapters, reference):
    """Without adapters the reference log-probabilities are computed once by the model as built, on the ranks, and
    stored beside the rows: 2 ranks train as a plain loop of twice the pairs whose reference is a frozen copy of the
    base (the whole model trained; under fsdp sharded, 7 pairs so that the ranks score different counts of
    batches). The table holds every pair's log-probabilities as the base scores it alone; reference='copy' holds
    that copy on the ranks instead."""
    from estimator.data.reference import ReferenceTable, pair_keys
    from estimator.train.objectives.preference import DPO

    ranks, batch, epochs, lr, beta = 2, 2, 2, 1e-3, 0.5
    rows = pairs(8 if strategy == "ddp" else 7)
    val = pairs(1, seed=5)  # 5 batches of pairs to score: rank 1 joins the last forward with a spare one
    config = lora() if adapters else None
    spec = lm_train_spec(store, llama, rows, batch=batch, epochs=epochs, peft_config=config, lr=lr,
                         objective=DPO(beta=beta, reference=reference), strategy=strategy, val_rows=val,
                         reference_key=f"ref-{strategy}-{adapters}")
    results = LocalLauncher().run(spec, ranks)
    history = results[0].history
    folder = os.path.join(store.root, "reference", f"ref-{strategy}-{adapters}")
    if reference != "copy":  # every training and validation pair, as the base scores it alone
        base = plain_causal_lm(llama).eval()
        raw = {k: np.array([t[i] for t in rows + val], dtype=object) for i, k in enumerate(("prompt", "chosen",
                                                                                             "rejected"))}
        stored = ReferenceTable(store, folder).lookup(pair_keys(raw, SPEC.rows)).reshape(2, -1)
        with torch.no_grad():
            want = [[answer_logp(base, tokenizer, p, c) for p, c, _ in rows + val],
                    [answer_logp(base, tokenizer, p, r) for p, _, r in rows + val]]
        assert stored == pytest.approx(np.array(want), rel=1e-4)
    else:
        assert not os.path.exists(folder)
    if strategy == "fsdp":  # 7 pairs: rank 1 holds 3 and draws a last short batch; compared through the table above
        assert len(history) == epochs and history[-1]["loss"] < history[0]["loss"]
        return
    losses, plain = plain_dpo_run(llama, tokenizer, rows, ranks, batch, epochs, lr, beta, config)
    assert [row["loss"] for row in history] == pytest.approx(losses, rel=1e-4)
    trained = plain_causal_lm(llama, config, seed=0)
    restore(store, store.run("r"), store.run("r").checkpoint, trained, None)
    state, expected = trained.state_dict(), plain.state_dict()
    for name in [n for n, p in plain.named_parameters() if p.requires_grad][:12]:
        assert torch.allclose(state[name], expected[name], atol=2e-5), (name, (state[name] - expected[name]).abs().max())


@pytest.mark.parametrize("adapters", [True, False], ids=["lora-adapters-off", "whole-precomputed"])
def test_packed_pairs_train_as_padded_ones(llama, store, adapters):
    """packing=True: a batch's chosen and rejected rows in one sequence, each attending to itself only, score and
    train as the padded batch does (answers of different lengths): the loss, the rewards and the weights, the
    reference live with the adapters off, or precomputed (its pass over packed batches too)."""
    from estimator.train.objectives.preference import DPO

    rows, config, runs = pairs(16), (lora() if adapters else None), {}
    for packed in (False, True):
        run = f"packed-{packed}"
        runs[packed] = LocalLauncher().run(lm_train_spec(store, llama, rows, batch=2, epochs=1, peft_config=config,
                                                         lr=1e-3, objective=DPO(beta=0.5), run=run, packed=packed,
                                                         reference_key=run), 1)[0].history
    for key in ("loss", "rewards/margins", "rewards/chosen"):
        assert runs[True][-1][key] == pytest.approx(runs[False][-1][key], rel=1e-4, abs=1e-6), key
    padded, packed = (plain_causal_lm(llama, config, seed=0) for _ in range(2))
    for model, run in ((padded, "packed-False"), (packed, "packed-True")):
        restore(store, store.run(run), store.run(run).checkpoint, model, None)
    want = padded.state_dict()
    for name, value in packed.state_dict().items():
        assert torch.allclose(value, want[name], atol=1e-5), (name, (value - want[name]).abs().max())


def test_a_stored_reference_is_reused_by_a_later_fit_and_refused_when_the_model_changed(llama, tokenizer, store,
                                                                                        tmp_path):
    """A second fit of the same rows and reference reads the table (no part rewritten); a model folder changed
    under the same key is found by the ranks' check against a forward, and refused by name."""
    from transformers import AutoModelForCausalLM

    from estimator.train.objectives.preference import DPO

    rows = pairs(8)
    make = dict(batch=2, epochs=1, lr=1e-3, objective=DPO(beta=0.5), reference_key="k")
    LocalLauncher().run(lm_train_spec(store, llama, rows, run="first", **make), 1)
    parts = sorted(store.find(os.path.join(store.root, "reference", "k"), ".parquet"))
    written = [os.stat(p).st_mtime_ns for p in parts]
    assert len(parts) == 1
    LocalLauncher().run(lm_train_spec(store, llama, rows, run="second", **make), 1)
    assert [os.stat(p).st_mtime_ns for p in parts] == written
    other = tmp_path / "other"
    model = AutoModelForCausalLM.from_pretrained(llama)
    torch.manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(other)
    tokenizer.save_pretrained(other)
    with pytest.raises(Exception, match=r"reference log-probabilities stored in .* are not what this model computes"):
        LocalLauncher().run(lm_train_spec(store, str(other), rows, run="third", **make), 1)


@pytest.mark.parametrize("objective", ["sft", "dpo"])
def test_a_packed_runs_attention_is_the_packed_attention_whatever_the_objective(llama, store, monkeypatch, objective):
    """The rank switches the model to the packed attention before any forward (DPO's precomputing pass included).
    transformers' own attention keeps this tiny Llama's packed rows apart by their position_ids alone, so the
    equality tests would pass without it: here its calls are counted (one rank runs in this process)."""
    from transformers import AutoConfig

    from estimator.lm import packed_attention as module
    from estimator.train.objectives.preference import DPO
    from lm_helpers import lm_rows

    calls = []
    real = module.packed_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "packed_attention", counted)
    rows, more = (pairs(4), dict(objective=DPO(beta=0.5), reference_key="attention")) if objective == "dpo" else (
        lm_rows(4), {})
    LocalLauncher().run(lm_train_spec(store, llama, rows, batch=2, epochs=1, packed=True, run=objective, **more), 1)
    layers = AutoConfig.from_pretrained(llama).num_hidden_layers
    assert len(calls) >= 2 * layers, (len(calls), layers)  # every layer of at least 2 forwards


def test_a_model_saved_again_to_its_folder_names_a_table_of_its_own(llama, tokenizer, tmp_path):
    """The driver names the precomputed table by the factory's folder's files too (the user's usual loop: SFT saved
    to a folder, DPO from it, SFT run again into the same folder): the same folder gives the same name, a model
    saved again there a new one, computed afresh rather than refused."""
    import functools
    import shutil

    from transformers import AutoModelForCausalLM

    from estimator.core.recipe import built_on_meta
    from estimator.train.objectives.reference import reference_key

    folder = str(tmp_path / "sft")
    shutil.copytree(llama, folder)
    factory = functools.partial(AutoModelForCausalLM.from_pretrained, folder)

    def key():
        return reference_key(dict(model_factory=factory, model=built_on_meta(factory), tokenizer=tokenizer,
                                  max_length=64, precision=None, weights_folder=None))

    first = key()
    assert key() == first
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        next(model.parameters()).add_(0.01)
    model.save_pretrained(folder)
    assert key() != first


def test_a_run_with_a_stored_reference_cut_inside_an_epoch_resumes_to_the_uninterrupted_runs_weights(llama, store):
    """The whole model trained, its reference precomputed: cut after step 3 of 4 (a checkpoint every 2 steps) and
    resumed, the ranks check the stored table against the model as built, before the checkpoint is restored into
    it, and train on to the weights and loss of the run never cut."""
    from estimator.core.faults import Fault
    from estimator.failures import RankFailed
    from estimator.train.objectives.preference import DPO

    rows, make = pairs(16), dict(batch=4, epochs=1, lr=1e-3, objective=DPO(beta=0.5))
    LocalLauncher().run(lm_train_spec(store, llama, rows, run="whole", reference_key="whole", **make), 1)
    cut = lm_train_spec(store, llama, rows, run="cut", reference_key="cut", checkpoint_steps=2, **make)
    with pytest.raises(RankFailed):
        LocalLauncher(faults=(Fault("step", 0, "raise", step=3),)).run(cut, 1)
    assert load_checkpoint(store, cut.run.checkpoint)["position"]["step"] == 2
    LocalLauncher().run(dataclasses.replace(cut, resume_from=cut.run.checkpoint, attempt=1, launch_id="again"), 1)
    whole, again = (load_checkpoint(store, store.run(r).checkpoint) for r in ("whole", "cut"))
    for name, value in whole["model"].items():
        assert torch.allclose(value, again["model"][name], atol=1e-6), name
    assert again["history"][-1]["loss"] == pytest.approx(whole["history"][-1]["loss"], rel=1e-6)


def test_dpo_params_are_checked_by_name():
    from estimator.train.objectives.preference import DPO

    for bad in (0, -0.1, float("nan"), True, "0.1"):
        with pytest.raises(ValueError, match=r"beta .* must be a number > 0"):
            DPO(beta=bad)
    with pytest.raises(ValueError, match=r"loss_type='hinge'\): one of \['sigmoid', 'ipo'\]"):
        DPO(loss_type="hinge")
    for bad in (-1, float("inf"), None):
        with pytest.raises(ValueError, match=r"sft_weight=.* must be a number >= 0"):
            DPO(sft_weight=bad)
    assert DPO(0.2) == DPO(beta=0.2, loss_type="sigmoid") != DPO(0.2, "ipo") != DPO(0.2, sft_weight=1)
    assert repr(DPO(0.2, sft_weight=1)) == "DPO(beta=0.2, loss_type='sigmoid', sft_weight=1.0)"


def test_pairs_of_message_lists_label_only_the_answers_tokens_as_the_template_renders_them(tokenizer):
    """The prompt's messages (an earlier assistant turn too) carry no label; each answer's rendered tokens do,
    with their end; the ids are the template's rendering of the prompt and the answer."""
    from estimator.data.lm import render

    prompt = [{"role": "user", "content": "What color is the kettle?"},
              {"role": "assistant", "content": " The kettle is red."},
              {"role": "user", "content": "Are you sure?"}]
    chosen, rejected = [{"role": "assistant", "content": " Yes, red."}], [{"role": "assistant", "content": " No."}]
    spec = LMSpec(Pairs("prompt", "chosen", "rejected", as_messages=True))
    raw = {"prompt": np.array([prompt], dtype=object), "chosen": np.array([chosen], dtype=object),
           "rejected": np.array([rejected], dtype=object)}
    out = CausalLMTokenize(tokenizer, spec, None)(raw)
    ids, labels = out["prompt.input_ids"], out["chosen"]
    assert ids.shape[0] == 2  # the chosen row, then the rejected one
    before = render(tokenizer, prompt, True)
    for row, answer in enumerate((chosen, rejected)):
        full = render(tokenizer, prompt + answer, False)
        assert ids[row, :len(full)].tolist() == full
        kept = [int(t) for t in labels[row] if t != IGNORE]
        assert kept == full[len(before):] and tokenizer.decode(kept) == answer[0]["content"] + "</s>"
        assert (labels[row, :len(before)] == IGNORE).all()
