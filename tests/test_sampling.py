"""Each row's draws from a stream of its own (estimator.lm.sampling): the hash is splitmix64's, the draws follow
softmax of the warped scores, and a row's draws depend on its seed and the token's index only."""
import math

import pytest
import torch

from estimator.lm.sampling import RowDraws, mixed, row_seeds, uniforms, warpers

MASK = (1 << 64) - 1


def splitmix64(x):
    """The reference, on Python's unbounded ints."""
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def test_the_hash_is_splitmix64_on_unsigned_64_bit_words():
    values = [0, 1, 2, 12345, (1 << 62) - 1, (1 << 63) - 1, -1, -(1 << 63)]
    found = mixed(torch.tensor(values, dtype=torch.int64)).tolist()
    assert [f & MASK for f in found] == [splitmix64(v & MASK) for v in values]


def test_a_rows_uniforms_depend_on_its_seed_and_the_index_only():
    u = uniforms(torch.tensor([5, 6, 5]), 3, 1000)
    assert u.dtype == torch.float64 and bool(((u > 0) & (u < 1)).all())
    assert torch.equal(u[0], u[2]) and not torch.equal(u[0], u[1])
    assert torch.equal(uniforms(torch.tensor([6]), 3, 1000)[0], u[1])  # alone or beside others
    assert not torch.equal(uniforms(torch.tensor([5]), 4, 1000)[0], u[0])  # the next token's
    assert abs(float(u.mean()) - 0.5) < 0.02 and abs(float(u.var()) - 1 / 12) < 0.005
    seeds = row_seeds([7, 8], 3)
    assert len(set(seeds)) == 6 and seeds[:3] == row_seeds([7], 3)  # prompt-major, each of its prompt's


def draws(scores, warp, rows=20_000, index=0):
    processor = RowDraws(range(rows), 0, warp, "cpu")
    out = processor(torch.zeros((rows, index)), scores.expand(rows, -1).clone())
    assert bool((torch.isfinite(out).sum(-1) == 1).all())  # one finite score a row: greedy's pick
    return torch.bincount(out.argmax(-1), minlength=scores.shape[-1]).double() / rows


@pytest.mark.parametrize("kwargs, expected", [
    ({}, torch.softmax(torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0]), -1)),
    ({"temperature": 0.5}, torch.softmax(torch.tensor([4.0, 2.0, 1.0, 0.0, -2.0]), -1)),
    ({"top_k": 2}, torch.softmax(torch.tensor([2.0, 1.0]), -1).tolist() + [0.0] * 3),
    ({"top_p": 0.8}, torch.softmax(torch.tensor([2.0, 1.0, 0.5]), -1).tolist() + [0.0] * 2),
])
def test_the_draws_follow_softmax_of_the_warped_scores(kwargs, expected):
    """20,000 rows, one draw each: every frequency within 4.5 standard errors of its probability (a token the
    warpers cut: never drawn)."""
    scores = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    found = draws(scores, warpers(None, kwargs))
    expected = torch.as_tensor(expected, dtype=torch.float64)
    for f, p in zip(found.tolist(), expected.tolist()):
        assert abs(f - p) <= 4.5 * math.sqrt(max(p * (1 - p), 1e-12) / 20_000), (found, expected)


def test_the_model_generation_configs_warpers_apply_unless_given():
    from transformers import GenerationConfig

    class Model:
        generation_config = GenerationConfig(temperature=0.7, top_k=5, min_p=0.1)

    names = [type(w).__name__ for w in warpers(Model(), {"top_k": 0})]
    assert names == ["TemperatureLogitsWarper", "MinPLogitsWarper"]


def test_rows_drawn_in_chunks_draw_what_they_draw_at_once(monkeypatch):
    import estimator.lm.sampling as sampling

    scores = torch.randn(7, 50, generator=torch.Generator().manual_seed(0))
    whole = RowDraws(range(7), 2, [], "cpu")(torch.zeros((7, 5)), scores.clone())
    monkeypatch.setitem(sampling.NOISE_ELEMENTS, "cpu", 100)  # 2 rows at a time
    assert torch.equal(RowDraws(range(7), 2, [], "cpu")(torch.zeros((7, 5)), scores.clone()), whole)
