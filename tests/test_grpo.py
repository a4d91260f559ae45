"""GRPO's rewards and advantages on a rank (estimator.train.objectives.rewards), without Spark or a model: the
reward functions called as TRL calls them, their scores checked by name, each completion's advantage within its
prompt's group as TRL's GRPOTrainer computes it (sum_then_normalize; scale_rewards 'group', 'batch', 'none')."""
import math

import numpy as np
import pytest
import torch

from estimator.failures import FailureKind, failure_kind
from estimator.train.objectives.rewards import RewardFailed, Rewards, advantages


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
    got = rewards.score(["Q1", "Q1", "Q2", "Q2"], ["red car", "", "blue", "green"], [[5, 6], [], [7], [8]],
                        {"answer": ["red", "red", "blue", "blue"], "level": [1, 1, 2, 2]})
    assert seen == {"prompts": ["Q1", "Q1", "Q2", "Q2"], "completion_ids": [[5, 6], [], [7], [8]],
                    "level": [1, 1, 2, 2]}
    np.testing.assert_array_equal(got[:, 0], [1, 0, 1, 0])
    assert math.isnan(got[1, 1]) and got[0, 1] == pytest.approx(-0.7)
    assert Rewards.of([exact, exact]).names == ("exact", "exact_2")  # each its own metrics


@pytest.mark.parametrize("returned, message", [
    (lambda n: [1.0] * (n - 1), r"'bad' returned 3 scores for 4 completions"),
    (lambda n: [1.0, float("nan"), 0.0, 0.0], r"'bad' returned nan for completion 1 of the prompt 'Q1'.*or None"),
    (lambda n: [1.0, "yes", 0.0, 0.0], r"'bad' returned 'yes' \(str\) for completion 1 .*return a float"),
    (lambda n: 3.0, r"'bad' returned float, not a list"),
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


def test_each_prompts_group_is_sampled_under_its_own_seed_whatever_is_sampled_beside_it(tmp_path):
    """k ranks sample what one process does: a prompt's completions depend on its seed only; the torch random
    state is left as it was; each completion ends at its stop."""
    from transformers import AutoTokenizer

    from estimator.lm.generation import sampled_groups
    from lm_helpers import color_facts, lm_rows, plain_causal_lm, save_pretrained_llama

    path = save_pretrained_llama(str(tmp_path / "tiny"), [p + r for p, r in color_facts()])
    tokenizer, model = AutoTokenizer.from_pretrained(path), plain_causal_lm(path).eval()
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
