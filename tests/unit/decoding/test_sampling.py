"""Sampling params, logit processing and the lossless acceptance rule on hand-made distributions."""
import numpy as np
import pytest
import torch
from scipy import stats

from dspark.config import ConfigError, validate_config
from dspark.decoding.sampling import SamplingParams, accept_drafts, sample, to_probs


@pytest.mark.parametrize("bad", [{"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1},
                                 {"temp": 1.0}])
def test_sampling_params_reject_bad_values(bad):
    with pytest.raises(ConfigError):
        validate_config(SamplingParams, bad)


def test_to_probs_greedy_is_one_hot_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    probs = to_probs(logits, SamplingParams(temperature=0))
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))


def test_to_probs_temperature_top_k_top_p():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    plain = to_probs(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(plain, torch.softmax(logits / 0.5, -1))
    top2 = to_probs(logits, SamplingParams(top_k=2))
    assert torch.allclose(top2[:2], torch.softmax(logits[:2], -1)) and top2[2:].sum() == 0
    full = torch.softmax(logits, -1)  # ≈ [.53, .20, .12, .07, .03]
    nucleus = to_probs(logits, SamplingParams(top_p=0.8))  # .53 + .20 < .8 -> the third is needed
    assert (nucleus > 0).sum() == 3
    assert torch.allclose(nucleus[:3], full[:3] / full[:3].sum())
    assert torch.allclose(to_probs(logits, SamplingParams(top_p=0.01)), torch.tensor([1.0, 0, 0, 0, 0]))


def test_sample_is_deterministic_under_a_generator():
    probs = torch.full((4, 10), 0.1)
    a = sample(probs, torch.Generator().manual_seed(3))
    b = sample(probs, torch.Generator().manual_seed(3))
    assert a.shape == (4,) and torch.equal(a, b)


def _emitted_first_token(p_t: torch.Tensor, p_d: torch.Tensor, runs: int, seed: int = 0) -> np.ndarray:
    """Draw x1 ~ p_d, run accept_drafts with one more (bonus) row, return counts of the first emitted token."""
    gen = torch.Generator().manual_seed(seed)
    counts = np.zeros(p_t.shape[-1])
    bonus = torch.full_like(p_t, 1.0 / p_t.shape[-1])
    for _ in range(runs):
        x = sample(p_d, gen).reshape(1)
        n_acc, nxt = accept_drafts(x, p_d[None], torch.stack([p_t, bonus]), gen)
        counts[int(x) if n_acc == 1 else nxt] += 1
    return counts


def test_accept_drafts_emits_the_target_distribution():
    p_t = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    p_d = torch.tensor([0.1, 0.2, 0.3, 0.2, 0.2])  # gives mass to a token the target forbids
    runs = 6000
    counts = _emitted_first_token(p_t, p_d, runs)
    assert counts[4] == 0
    expected = p_t[:4].double().numpy()
    p = stats.chisquare(counts[:4], runs * expected / expected.sum()).pvalue
    print(f"accept_drafts single-position chi2 p-value = {p:.4f}")
    assert p > 1e-3


def test_accept_drafts_bonus_and_first_rejection():
    tokens = torch.tensor([0, 1])
    p_d = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    agree = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    assert accept_drafts(tokens, p_d, agree, torch.Generator()) == (2, 2)  # all accepted -> bonus row
    disagree = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    assert accept_drafts(tokens, p_d, disagree, torch.Generator()) == (1, 2)  # residual = p_t at position 2
    empty = accept_drafts(torch.zeros(0, dtype=torch.long), torch.zeros(0, 3), agree[:1], torch.Generator())
    assert empty == (0, 0)  # nothing verified: the token comes from the target alone


def test_accept_drafts_greedy_is_argmax_match():
    target_logits = torch.tensor([[0.0, 5.0, 1.0], [2.0, 0.0, 1.0]])
    greedy = SamplingParams(temperature=0)
    t_probs = to_probs(target_logits, greedy)
    d_probs = to_probs(torch.tensor([[0.0, 9.0, 1.0]]), greedy)
    assert accept_drafts(torch.tensor([1]), d_probs, t_probs, torch.Generator()) == (1, 0)
    d_probs = to_probs(torch.tensor([[0.0, 1.0, 9.0]]), greedy)
    assert accept_drafts(torch.tensor([2]), d_probs, t_probs, torch.Generator()) == (0, 1)


def test_accept_drafts_rejects_bad_shapes():
    with pytest.raises(ValueError, match="target_probs"):
        accept_drafts(torch.tensor([0, 1]), torch.rand(2, 4), torch.rand(2, 4), torch.Generator())


@pytest.mark.parametrize("scale", [0.05, 1.0, 4.0])
def test_nucleus_shortcut_equals_a_full_sort(scale, monkeypatch):
    """top-p searched among the top-k candidates (peaked rows) or over the whole vocabulary (flat
    rows, scale 0.05) gives exactly the full-sort result."""
    import dspark.decoding.sampling as sampling

    logits = torch.randn(6, 5000, generator=torch.Generator().manual_seed(1)) * scale
    sp = SamplingParams(temperature=0.8, top_p=0.9)
    fast = to_probs(logits, sp)
    monkeypatch.setattr(sampling, "TOP_P_CANDIDATES", 10**9)
    assert torch.equal(fast, to_probs(logits, sp))


def test_counter_based_draws_are_functions_of_seed_and_position_and_follow_the_distribution():
    """keyed_uniform / keyed_gumbel (device-side, no generator): the same (seed, position) gives the same value
    whatever else is in the call; sample_keyed's inverse-CDF and Gumbel-max draws follow to_probs exactly
    (χ² over 20k positions), and its Gumbel rows are KeyedNoise's tokens."""
    from dspark.decoding.counter_random import keyed_gumbel, keyed_uniform
    from dspark.decoding.sampling import KeyedNoise, sample_keyed

    seeds, positions = torch.tensor([7, 7, 8, -3]), torch.tensor([0, 1, 0, 5])
    u = keyed_uniform(seeds, positions)
    assert torch.equal(u[1:2], keyed_uniform(seeds[1:2], positions[1:2])) and len(set(u.tolist())) == 4
    g = keyed_gumbel(seeds, positions, 11)
    assert torch.equal(g[3], keyed_gumbel(seeds[3:], positions[3:], 11)[0]) and g.shape == (4, 11)
    sp, logits = SamplingParams(temperature=1.0), torch.tensor([1.0, 0.0, -1.0, 0.5, 2.0])
    probs = to_probs(logits, sp).double().numpy()
    n = 20_000
    for gumbel in (False, True):
        tokens = sample_keyed(logits.expand(n, -1), [sp] * n, [11] * n, list(range(n)), [gumbel] * n)
        counts = np.bincount(tokens.numpy(), minlength=5)
        assert stats.chisquare(counts, probs / probs.sum() * n).pvalue > 1e-3, (gumbel, counts)
    noise = KeyedNoise(11, 5, "cpu")
    rows = sample_keyed(logits.expand(6, -1), [sp] * 6, [11] * 6, list(range(6)), [True] * 6)
    assert rows.tolist() == noise.argmax(to_probs(logits, sp).expand(6, -1), list(range(6))).tolist()
