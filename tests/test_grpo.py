"""GRPO's rewards and advantages on a rank (estimator.train.objectives.rewards), without Spark or a model: the
reward functions called as TRL calls them, their scores checked by name, each completion's advantage within its
prompt's group as TRL's GRPOTrainer computes it (sum_then_normalize; scale_rewards 'group', 'batch', 'none')."""
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from estimator.failures import FailureKind, failure_kind
from estimator.train.objectives.rewards import RewardFailed, Rewards, advantages
from test_lm import llama, tokenizer  # noqa: F401 - the tiny Llama and its tokenizer


def exact(prompts, completions, answer, **_):
    return [1.0 if c.strip().split()[:1] == [a] else 0.0 for c, a in zip(completions, answer)]


def short(completions, **_):
    return [None if not c else -len(c) / 10 for c in completions]


def test_reward_functions_get_the_columns_as_keyword_lists_and_none_is_unscored():
    seen = {}

    def spy(prompts, completions, completion_ids, answer, level):
        seen.update(prompts=prompts, completion_ids=completion_ids, level=level)
        return [float(len(c)) for c in completions]

    rewards = Rewards.of([exact, short, spy], [1.0, 0.5, 0.0])
    assert rewards.names == ("exact", "short", "spy") and rewards.weights == (1.0, 0.5, 0.0)
    got = rewards.score(["Q1", "Q1", "Q2", "Q2"], ["red car", "", "blue", "green"],  # numpy's, as a rank's rows
                        [np.array([5, 6]), [], [np.int64(7)], [8]],
                        {"answer": ["red", "red", "blue", "blue"], "level": list(np.array([1, 1, 2, 2]))})
    assert seen == {"prompts": ["Q1", "Q1", "Q2", "Q2"], "completion_ids": [[5, 6], [], [7], [8]],
                    "level": [1, 1, 2, 2]}
    json.dumps(seen)  # Python values, as TRL gives them (a wheel trial's json.dumps failed on numpy.int64)
    np.testing.assert_array_equal(got[:, 0], [1, 0, 1, 0])
    assert math.isnan(got[1, 1]) and got[0, 1] == pytest.approx(-0.7)
    assert Rewards.of([exact, exact]).names == ("exact", "exact_2")  # each its own metrics


@pytest.mark.parametrize("returned, message", [
    (lambda n: [1.0] * (n - 1), r"'bad' returned 3 scores for 4 completions \(the batch's first prompt: 'Q1'\)"),
    (lambda n: [1.0, float("nan"), 0.0, 0.0], r"'bad' returned nan for completion 1 of the prompt 'Q1'.*or None"),
    (lambda n: [1.0, "yes", 0.0, 0.0], r"'bad' returned 'yes' \(str\) for completion 1 .*return a float"),
    (lambda n: 3.0, r"'bad' returned float, not a list, for a batch whose first prompt is 'Q1'"),
])
def test_a_reward_function_that_breaks_its_contract_is_refused_by_name_and_never_retried(returned, message):
    def bad(completions, **_):
        return returned(len(completions))

    with pytest.raises(RewardFailed, match=message) as info:
        Rewards.of(bad).score(["Q1", "Q1", "Q2", "Q2"], ["a", "b", "c", "d"], [[1]] * 4, {})
    assert failure_kind(info.value) is FailureKind.USAGE and not FailureKind.USAGE.retryable


def test_a_reward_function_that_raises_is_named_with_the_batchs_first_prompt():
    def boom(completions, answer, **_):
        return [float(c == answer[i]) for i, c in enumerate(completions[:1])] + [1 / 0]

    with pytest.raises(RewardFailed, match=r"'boom' raised on a batch of 2 completions \(its first prompt: "
                                           r"'What is 2\+2\?'\): ZeroDivisionError"):
        Rewards.of(boom).score(["What is 2+2?"] * 2, ["4", "5"], [[1], [2]], {"answer": ["4", "4"]})
    with pytest.raises(ValueError, match=r"item 1, 3, is not callable"):
        Rewards.of([exact, 3])
    with pytest.raises(ValueError, match=r"reward_weights=\[1.0\]\): one finite number for each of the 2"):
        Rewards.of([exact, short], [1.0])


def plain_advantages(scores, weights, group, scale):
    """The same by hand in numpy: weighted sums (NaN left out), group means, std with ddof=1."""
    rewards = np.array([np.nan if np.isnan(r).all() else np.nansum(r * weights) for r in scores])
    out = np.zeros_like(rewards)
    for start in range(0, len(rewards), group):
        g = rewards[start:start + group]
        mean = np.nanmean(g)
        if scale == "group":
            std = np.nanstd(g, ddof=1)
        elif scale == "batch":
            std = np.nanstd(rewards, ddof=1)
        else:
            std = None
        found = g - mean if std is None else (g - mean) / (std + 1e-4)
        out[start:start + group] = np.nan_to_num(found, nan=0.0)
    return out, rewards


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_are_each_completions_reward_against_its_groups_as_trl_computes_them(scale):
    scores = np.array([[1.0, 0.2], [0.0, np.nan], [1.0, 0.4], [0.0, 0.0],  # a group of 4
                       [1.0, 0.1], [1.0, 0.1], [1.0, 0.1], [1.0, 0.1],  # all alike: std 0, advantage 0
                       [np.nan, np.nan], [0.0, 1.0], [1.0, 0.0], [0.5, 0.5]])  # one unscored
    weights = np.array([1.0, 0.5])
    found, rewards, zero = advantages(torch.tensor(scores), torch.tensor(weights), 4, scale)
    expected, expected_rewards = plain_advantages(scores, weights, 4, scale)
    np.testing.assert_allclose(found.numpy(), expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(rewards.numpy(), expected_rewards, rtol=1e-12)
    assert found[8] == 0 and (found[4:8] == 0).all()
    if scale != "batch":
        assert zero.tolist() == [False] * 4 + [True] * 4 + [False] * 4


def trl_loss(logps, old, adv, mask, loss_type, eps_low, eps_high, beta, ref, max_len):
    """TRL's _compute_loss for one process without accumulation, written out token by token."""
    rows, width = logps.shape
    per = torch.zeros(rows, width, dtype=torch.float64)
    for i in range(rows):
        for t in range(width):
            r = math.exp(logps[i, t] - old[i, t])
            c = min(max(r, 1 - eps_low), 1 + eps_high)
            loss = -min(r * adv[i], c * adv[i])
            if beta:
                g = ref[i, t] - logps[i, t]
                loss += beta * (math.exp(g) - g - 1)
            per[i, t] = loss * mask[i, t]
    if loss_type == "grpo":
        return sum(per[i].sum() / max(mask[i].sum(), 1) for i in range(rows)) / rows
    if loss_type == "dr_grpo":
        return per.sum() / (rows * max_len)
    return per.sum() / mask.sum()


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_the_policy_loss_over_its_weight_is_trls_and_two_halves_sum_to_the_whole(loss_type, beta):
    from estimator.lm.policy import policy_loss

    g = torch.Generator().manual_seed(0)
    logps = (-torch.rand(6, 5, generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    old = logps.detach() + torch.randn(6, 5, generator=g, dtype=torch.float64) * 0.3  # some tokens clipped
    ref = logps.detach() + torch.randn(6, 5, generator=g, dtype=torch.float64) * 0.2
    adv = torch.tensor([1.2, -0.7, 0.0, 0.4, -1.5, 0.9], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0],
                         [0, 0, 0, 0, 0]], dtype=torch.float64)  # the last completion is empty
    args = (loss_type, 0.2, 0.28, beta, ref, 5)
    whole = policy_loss(logps, old, adv, mask, loss_type, 0.2, 0.28, beta, ref, 5)
    expected = trl_loss(logps.detach(), old, adv, mask, *args)
    assert float(whole.loss / whole.weight) == pytest.approx(float(expected), rel=1e-12)
    halves = [policy_loss(logps[s], old[s], adv[s], mask[s], loss_type, 0.2, 0.28, beta, ref[s], 5)
              for s in (slice(0, 3), slice(3, 6))]
    total = sum(h.weight for h in halves)
    (sum(h.loss for h in halves) / total).backward()  # two ranks' sums over the window's weight
    split = logps.grad.clone()
    logps.grad = None
    (whole.loss / whole.weight).backward()
    torch.testing.assert_close(split, logps.grad, rtol=1e-12, atol=1e-15)
    ratio = torch.exp(logps.detach() - old)
    low = ((ratio < 0.8) & (adv[:, None] < 0) & (mask > 0)).sum()
    high = ((ratio > 1.28) & (adv[:, None] > 0) & (mask > 0)).sum()
    assert whole.low_clipped == low > 0 and whole.high_clipped == high > 0
    assert whole.region_clipped == low + high and whole.tokens == mask.sum()
    assert (whole.kl is None) == (beta == 0)


def test_each_prompts_group_is_sampled_under_its_own_seed_whatever_is_sampled_beside_it(llama, tokenizer):
    """k ranks sample what one process does: a prompt's completions depend on its seed only; the torch random
    state is left as it was; each completion ends at its stop."""
    from estimator.lm.generation import sampled_groups
    from lm_helpers import lm_rows, plain_causal_lm

    model = plain_causal_lm(llama).eval()
    prompts = [tokenizer(p)["input_ids"] for p, _ in lm_rows(3)]
    kwargs = {"temperature": 1.5, "top_k": 0, "pad_token_id": tokenizer.pad_token_id,
              "eos_token_id": tokenizer.eos_token_id}
    state = torch.random.get_rng_state()
    together = sampled_groups(model, prompts, 4, [11, 12, 13], 10, kwargs, "cpu")
    assert torch.equal(torch.random.get_rng_state(), state)
    apart = [c for i in (2, 0, 1) for c in sampled_groups(model, [prompts[i]], 4, [11 + i], 10, kwargs, "cpu")]
    assert apart == together[8:] + together[:8]  # prompt 2's group alone, then 0's and 1's: the same completions
    assert len(together) == 12 and len({tuple(c) for c in together[:4]}) > 1  # a group's completions differ
    assert sampled_groups(model, prompts[:1], 4, [99], 10, kwargs, "cpu") != together[:4]  # another seed
    stops = {tokenizer.eos_token_id, tokenizer(" the", add_special_tokens=False)["input_ids"][-1]}
    cut = sampled_groups(model, prompts, 4, [11, 12, 13], 10, {**kwargs, "eos_token_id": sorted(stops)}, "cpu")
    assert all(len(c) <= 10 and all(t not in stops for t in c[:-1]) for c in cut)


def test_a_groups_prompt_is_read_once_and_its_completions_are_those_of_each_row_reading_it(llama, tokenizer,
                                                                                         monkeypatch):
    """The prompts' KV cache computed once a prompt and repeated for its group's rows gives the completions each
    row's own prefill gives (sampled and greedy), in float32 to the bit; the model reads each prompt once, its
    group's rows then one token at a time."""
    from estimator.lm import generation
    from lm_helpers import lm_rows, plain_causal_lm

    model = plain_causal_lm(llama).eval()
    prompts = [tokenizer(p)["input_ids"] for p, _ in lm_rows(5)]
    kwargs = {"temperature": 1.5, "top_k": 0, "pad_token_id": tokenizer.pad_token_id,
              "eos_token_id": tokenizer.eos_token_id}
    seen = []
    model.register_forward_pre_hook(lambda m, args, kw: seen.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    shared = [(seeds, generation.sampled_groups(model, prompts, 4, seeds, 12, kwargs, "cpu"))
              for seeds in ([21, 22, 23, 24, 25], None)]
    width = max(len(p) for p in prompts)
    assert seen[0] == (5, width - 1) and all(rows == 20 and length == 1 for rows, length in seen[1:12]), seen[:3]
    monkeypatch.setattr(generation, "prefilled", lambda *args: {})  # each row's prompt read by generate()
    seen.clear()
    for seeds, found in shared:
        assert generation.sampled_groups(model, prompts, 4, seeds, 12, kwargs, "cpu") == found
    assert seen[0] == (20, width)


@pytest.mark.parametrize("architecture", ["gpt2", "bloom", "mistral"])
def test_a_prompt_read_once_gives_each_rows_completions_whatever_places_its_tokens(architecture, monkeypatch):
    """Learned absolute positions (GPT-2: left padding moves them), ALiBi without position ids (Bloom) and a
    sliding window shorter than the prompts (Mistral): the shared prefill gives each row's own completions."""
    from transformers import (BloomConfig, BloomForCausalLM, GPT2Config, GPT2LMHeadModel, MistralConfig,
                              MistralForCausalLM)

    from estimator.lm import generation

    torch.manual_seed(0)
    special = dict(vocab_size=300, pad_token_id=0, eos_token_id=2, bos_token_id=1)
    model = {"gpt2": lambda: GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, **special)),
             "bloom": lambda: BloomForCausalLM(BloomConfig(hidden_size=32, n_layer=2, n_head=2, **special)),
             "mistral": lambda: MistralForCausalLM(MistralConfig(
                 hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, sliding_window=4, **special))}[architecture]().eval()
    prompts = [[5, 6, 7, 8, 9, 10, 11], [9, 10], [11, 12, 13, 14, 15, 16]]
    kwargs = {"temperature": 1.0, "pad_token_id": 0, "eos_token_id": 2}
    assert generation.prefilled(model, *generation.left_padded(prompts, 0), 3)  # the cache is shared
    shared = [generation.sampled_groups(model, prompts, 3, seeds, 8, kwargs, "cpu") for seeds in ([1, 2, 3], None)]
    monkeypatch.setattr(generation, "prefilled", lambda *args: {})
    assert [generation.sampled_groups(model, prompts, 3, seeds, 8, kwargs, "cpu")
            for seeds in ([1, 2, 3], None)] == shared


def low_ids(completion_ids, **_):
    """A reward every completion gets a different share of: its tokens' share below id 200."""
    return [sum(t < 200 for t in c) / max(len(c), 1) for c in completion_ids]


def names_answer(completions, answer, **_):
    return [1.0 if a in c else None if not c.strip() else 0.0 for c, a in zip(completions, answer)]


def colour_rows(count):
    from lm_helpers import color_facts

    return [(p, r[len(" The "):-1].split(" is ")[1]) for p, r in color_facts()[:count]]


def plain_grpo_run(llama, tokenizer, rows, ranks, batch, epochs, lr, objective, peft_config):
    """The plain loop of what `ranks` ranks of `batch` prompts train (unshuffled): each prompt's group sampled under
    its seed, scored, its advantages; the step's dapo loss over all its completion tokens, num_iterations steps on
    each sample (the first step's log-probabilities the old policy's). The per-epoch losses, mean rewards and
    completions' mean lengths, the model and the count of clipped tokens."""
    from estimator.lm.generation import sampled_groups
    from estimator.lm.policy import policy_loss
    from estimator.train.objectives.grpo import prompt_seed
    from estimator.train.objectives.rewards import advantages
    from lm_helpers import plain_causal_lm

    model = plain_causal_lm(llama, peft_config)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    half, steps, group = len(rows) // ranks, len(rows) // (ranks * batch), objective.num_generations
    kwargs = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id,
              "temperature": objective.temperature, "top_p": 1.0, "top_k": 0}
    losses, rewards, lengths, global_step, clipped = [], [], [], 0, 0.0
    for epoch in range(epochs):
        total = weight = reward = scored = length = count = 0.0
        for step in range(steps):
            part = [rows[r * half + step * batch + i] for r in range(ranks) for i in range(batch)]
            prompts = [tokenizer(p)["input_ids"] for p, _ in part]
            model.eval()
            completions = sampled_groups(model, prompts, group, [prompt_seed(3, epoch + 1, global_step, p)
                                                                 for p in prompts], objective.max_new_tokens,
                                         kwargs, "cpu")
            texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
            length, count = length + sum(len(c) for c in completions), count + len(completions)
            repeated = [part[i // group] for i in range(len(completions))]
            scores = torch.from_numpy(objective.rewards.score([p for p, _ in repeated], texts, completions,
                                                              {"answer": [a for _, a in repeated]}))
            adv, found, _ = advantages(scores, torch.tensor(objective.rewards.weights, dtype=torch.float64), group,
                                       "group")
            model.train()
            old = None
            for _ in range(objective.num_iterations):
                per_row = []
                for i, c in enumerate(completions):
                    ids = torch.tensor([prompts[i // group] + c])
                    logits = model(input_ids=ids).logits[0, :-1].float()
                    logps = torch.log_softmax(logits, -1)[torch.arange(ids.shape[1] - 1), ids[0, 1:]]
                    mask = torch.zeros(ids.shape[1] - 1)
                    mask[len(prompts[i // group]) - 1:] = 1
                    per_row.append((logps, mask))
                width = max(len(lp) for lp, _ in per_row)
                logps = torch.stack([F.pad(lp, (0, width - len(lp))) for lp, _ in per_row])
                mask = torch.stack([F.pad(m, (0, width - len(m))) for _, m in per_row])
                old = logps.detach() if old is None else old
                found_loss = policy_loss(logps, old, adv.float(), mask, "dapo", objective.epsilon,
                                         objective.epsilon_high)
                (found_loss.loss / found_loss.weight).backward()
                optimizer.step()
                optimizer.zero_grad()
                global_step += 1
                total, weight = total + float(found_loss.loss), weight + float(found_loss.weight)
                clipped += float(found_loss.region_clipped)
            ok = ~torch.isnan(found)
            reward, scored = reward + float(found[ok].sum()), scored + float(ok.sum())
        losses.append(total / weight)
        rewards.append(reward / scored)
        lengths.append(length / count)
    return losses, rewards, lengths, model, clipped


@pytest.mark.parametrize("iterations, accumulated", [(1, 1), (2, 1), (2, 2)])
def test_two_ranks_of_grpo_prompts_equal_one_plain_loop_of_twice_the_prompts(llama, tokenizer, store, iterations,
                                                                             accumulated):
    """2 ranks x 2 prompts = one process of 4: each prompt's completions sampled under its own seed, the rewards
    and advantages within its group, the dapo loss over the step's completion tokens on all ranks; the history's
    loss and rewards and the adapters trained are the plain loop's. With num_iterations=2, two steps on each
    sample, the second's ratio to the sampling policy clipped at 1 +- epsilon (some tokens are). With
    backward_passes_per_step=2 over batches of 1 prompt, the same: both batches sampled before the first step,
    and each of the two steps accumulated over both."""
    from estimator.launch.local import LocalLauncher
    from estimator.train.checkpoint import restore
    from estimator.train.objectives.grpo import GRPO
    from lm_helpers import lm_train_spec, plain_causal_lm
    from test_lm import lora

    ranks, batch, epochs, lr = 2, 2, 2, 1e-2
    objective = GRPO([low_ids, names_answer], reward_weights=[1.0, 0.5], num_generations=4, max_new_tokens=6,
                     num_iterations=iterations, epsilon=0.05)
    rows = colour_rows(ranks * batch * 2)
    results = LocalLauncher().run(lm_train_spec(store, llama, rows, batch=batch // accumulated, epochs=epochs,
                                                peft_config=lora(), lr=lr, objective=objective,
                                                backward_passes_per_step=accumulated), ranks)
    history = results[0].history
    losses, rewards, lengths, plain, clipped = plain_grpo_run(llama, tokenizer, rows, ranks, batch, epochs, lr, objective,
                                                     lora())
    # the loss: a mean of terms of about 1 that cancel to about 0.02, so its float error is absolute (seen: 4e-7)
    assert [row["loss"] for row in history] == pytest.approx(losses, rel=1e-5, abs=2e-6)
    assert [row["reward"] for row in history] == pytest.approx(rewards, rel=1e-9)  # the same completions
    assert [row["completions/mean_length"] for row in history] == pytest.approx(lengths, rel=1e-12)
    assert {"reward_std", "rewards/low_ids/mean", "rewards/names_answer/mean", "completions/mean_length",
            "completions/clipped_ratio", "frac_reward_zero_std", "clip_ratio/region_mean"} <= set(history[-1])
    assert "reward_sq" not in history[-1]
    assert (clipped > 0 and history[-1]["clip_ratio/region_mean"] > 0) if iterations > 1 else (
        clipped == 0 and history[-1]["clip_ratio/region_mean"] == 0)  # once: ratio 1, none clipped
    trained = plain_causal_lm(llama, lora(), seed=0)
    restore(store, store.run("r"), store.run("r").checkpoint, trained, None)
    state, expected = trained.state_dict(), plain.state_dict()
    moved = 0
    # atol: the same completions, and still the sums' float order (the ranks' padded batches, the loop's rows one at
    # a time) grows through AdamW's first steps, whose second moments are near zero, at lr 1e-2: seen up to 3.2e-4,
    # as much as the sampling's other draws give (another seed key, per-prompt calls: 1.4e-4). A completion or an
    # advantage of another prompt's moves the adapters by about the lr a step.
    for name in (n for n, p in plain.named_parameters() if p.requires_grad):
        assert torch.allclose(state[name], expected[name], atol=1e-3), (name, (state[name] - expected[name]).abs().max())
        moved += int("lora_B" in name and state[name].abs().max() > 0)
    assert moved  # the adapters trained


@pytest.mark.timeout(300)  # a rank stepped by transformers' synced_gpus hangs on the other's collectives
def test_grpo_sharded_by_fsdp_trains_what_ddp_does_with_a_kl_term_and_uneven_validation(llama, store):
    """strategy='fsdp': each rank samples from the gathered weights (no collective per token: transformers'
    synced_gpus off), the reference is the adapters off, and 3 validation prompts on 2 ranks (one rank generates
    twice, the other once) do not hang; the history and the adapters are ddp's."""
    from estimator.launch.local import LocalLauncher
    from estimator.train.checkpoint import restore
    from estimator.train.objectives.grpo import GRPO
    from lm_helpers import lm_train_spec, plain_causal_lm
    from test_lm import lora

    rows, models, histories = colour_rows(9), {}, {}
    for strategy in ("ddp", "fsdp"):
        objective = GRPO([low_ids, names_answer], reward_weights=[1.0, 0.5], num_generations=2, max_new_tokens=6,
                         beta=0.04)
        spec = lm_train_spec(store, llama, rows[:6], batch=2, epochs=1, peft_config=lora(), lr=1e-2, run=strategy,
                             objective=objective, strategy=strategy, val_rows=rows[6:], collective_timeout=120.0)
        histories[strategy] = LocalLauncher().run(spec, 2)[0].history
        models[strategy] = plain_causal_lm(llama, lora(), seed=0)
        restore(store, store.run(strategy), store.run(strategy).checkpoint, models[strategy], None)
    for key in ("loss", "reward", "kl", "val_reward", "val_rewards/low_ids/mean"):
        assert [r[key] for r in histories["fsdp"]] == pytest.approx([r[key] for r in histories["ddp"]], rel=1e-5), key
    assert histories["ddp"][-1]["kl"] > 0
    # validation: one greedy completion a prompt and no step, so no clipping, KL or group spread to report
    assert not {"val_kl", "val_clip_ratio/region_mean", "val_frac_reward_zero_std", "val_loss"} & set(
        histories["ddp"][-1])
    ddp, fsdp = (m.state_dict() for m in models.values())
    for name in (n for n in ddp if "lora_" in n):
        assert torch.allclose(ddp[name], fsdp[name], atol=1e-5), name
    assert any(fsdp[n].abs().max() > 0 for n in fsdp if "lora_B" in n)


def test_reward_functions_that_cannot_take_their_arguments_are_refused_by_name():
    given = ("prompts", "completions", "completion_ids", "answer")
    Rewards.of([exact, short, lambda completions, **kw: [0.0] * len(completions)]).check_arguments(given)

    def no_kwargs(completions, answer):
        return [0.0] * len(completions)

    def needs_level(completions, level, **_):
        return [0.0] * len(completions)

    with pytest.raises(ValueError, match=r"'no_kwargs' takes no \['prompts', 'completion_ids'\].*add \*\*kwargs"):
        Rewards.of(no_kwargs).check_arguments(given)
    with pytest.raises(ValueError, match=r"'needs_level' needs \['level'\], which nothing gives.*label_cols"):
        Rewards.of(needs_level).check_arguments(given)


def test_a_reward_that_raises_on_a_rank_fails_the_fit_by_name_and_is_not_retried(llama, store):
    from estimator.failures import RankFailed
    from estimator.launch.local import LocalLauncher
    from estimator.train.objectives.grpo import GRPO
    from lm_helpers import lm_train_spec
    from test_lm import lora

    def parse(completions, **_):
        raise KeyError("score")

    spec = lm_train_spec(store, llama, colour_rows(2), batch=1, epochs=1, peft_config=lora(),
                         objective=GRPO(parse, num_generations=2, max_new_tokens=3))
    with pytest.raises(RankFailed, match=r"RewardFailed: The reward function 'parse' raised on a batch of 2 "
                                         r"completions \(its first prompt: 'What color is the kettle\?'\): KeyError") \
            as info:
        LocalLauncher().run(spec, 1)
    assert info.value.kind is FailureKind.USAGE and not info.value.kind.retryable


@pytest.mark.parametrize("iterations, every, cut, batches, accumulated, steps",
                         [(1, 2, 5, 1, 1, 4), (2, 3, 11, 2, 1, 10), (2, 2, 9, 2, 2, 8)])
def test_a_grpo_run_cut_inside_an_epoch_resumes_to_the_uninterrupted_runs_adapters(llama, store, iterations, every,
                                                                                   cut, batches, accumulated, steps):
    """Shuffled prompts, 3 batches an epoch, a checkpoint every 2 steps, the run cut before step 5 (inside the
    second epoch) and resumed after its first batch; with num_iterations=2 (2 steps a batch) and a checkpoint every
    3 steps, due inside a batch and taken at its end, cut before step 11 and resumed after the second epoch's
    second batch: the same samples (each prompt's seed is the run's, the epoch's and the step's), losses, rewards
    and adapters as the run never cut. With batches of 1 prompt and backward_passes_per_step=2 as well (a window
    of 2 batches, then 2 steps over both), cut before step 9 and resumed after the window that ended at step 8.
    Validation's greedy completions are scored by the same rewards (`val_reward`), here a closure over a
    dict, pickled by value to the ranks."""
    import dataclasses

    from estimator.core.faults import Fault
    from estimator.failures import RankFailed
    from estimator.launch.local import LocalLauncher
    from estimator.train.checkpoint import load_checkpoint
    from estimator.train.objectives.grpo import GRPO
    from lm_helpers import lm_train_spec
    from test_lm import lora

    bonus = {"violet": 0.5, "amber": 0.25}  # two of the four validation rows' answers

    def named(completions, answer, **_):
        return [(1.0 if a in c else 0.0) + bonus.get(a, 0.0) for c, a in zip(completions, answer)]

    objective = GRPO([named, low_ids], num_generations=2, max_new_tokens=4, num_iterations=iterations)
    rows = colour_rows(10)

    def spec(run):
        return lm_train_spec(store, llama, rows[:6], batch=2 // accumulated, epochs=2, peft_config=lora(), run=run,
                             shuffle=True, objective=objective, val_rows=rows[6:], checkpoint_steps=every,
                             backward_passes_per_step=accumulated)

    LocalLauncher().run(spec("whole"), 1)
    cut_run = spec("cut")
    with pytest.raises(RankFailed):
        LocalLauncher(faults=(Fault("step", 0, "raise", step=cut),)).run(cut_run, 1)
    checkpoint = load_checkpoint(store, cut_run.run.checkpoint)
    assert checkpoint["position"]["step"] == batches  # after the second epoch's first (second) batch
    assert checkpoint["global_step"] == steps
    LocalLauncher().run(dataclasses.replace(cut_run, resume_from=cut_run.run.checkpoint, attempt=1,
                                            launch_id="again"), 1)
    whole, again = (load_checkpoint(store, store.run(r).checkpoint) for r in ("whole", "cut"))
    moved = 0
    for name, value in whole["model"].items():
        assert torch.allclose(value, again["model"][name], atol=1e-6), name
        moved += int("lora_B" in name and value.abs().max() > 0)
    assert moved
    last, resumed = whole["history"][-1], again["history"][-1]
    for key in ("loss", "reward", "rewards/named/mean", "completions/mean_length", "val_reward"):
        assert resumed[key] == pytest.approx(last[key], rel=1e-6), key
    assert {"val_reward", "val_rewards/named/mean", "val_rewards/low_ids/mean"} <= set(last)
    assert last["val_rewards/named/mean"] >= 0.75 / 4  # the dict's bonus at least: the closure reached the rank
