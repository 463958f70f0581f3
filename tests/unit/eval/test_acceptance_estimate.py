"""The teacher-forced expected-τ estimator (dspark/eval/acceptance_estimate.py) against exact acceptance:
  - exact enumeration of every continuation in a tiny vocabulary: the importance-weighted estimator's
    expectation under the target equals P(first k accepted) computed from the full p and q, and the
    α-product estimator is exact for γ = 1 (with and without a draft vocabulary);
  - real speculative decoding: the first round's accepted length over many seeds agrees with the
    estimator on independent target-sampled trajectories (same prompt, temperature 1)."""
import itertools

import numpy as np
import pytest
import torch

from dspark.drafters import DrafterConfig, build_drafter
from dspark.eval.acceptance_estimate import bootstrap_ratio, estimate, sequence_acceptance
from dspark.decoding.sampling import SamplingParams
from dspark.decoding.specdec import speculative_generate, target_generate
from tests.tiny_models import build_tiny_model

V = 8
SP = SamplingParams(temperature=1.0, top_p=1.0, top_k=0)


@pytest.fixture(scope="module")
def target():
    return build_tiny_model(vocab_size=V, seed=3, init_std=0.5)


def make_drafter(target, algo="dspark", draft_ids=None, block_size=3):
    torch.manual_seed(1)
    cfg = DrafterConfig(algo=algo, block_size=block_size, ttt_steps=block_size, num_layers=1, num_context_layers=2,
                        rank=8, init_std=0.3, draft_vocab_size=None if draft_ids is None else len(draft_ids))
    drafter = build_drafter(cfg, target, draft_ids=None if draft_ids is None else torch.tensor(draft_ids))
    return drafter.eval()


def full_q(drafter, target, ids: torch.Tensor, anchor: int, k: int) -> torch.Tensor:
    """The drafter's processed distribution [V] for token anchor+k (zero outside a draft vocabulary)."""
    model = drafter
    out = target.forward(ids[None], layer_ids=model.layer_ids, logits_at=None)
    K = model.config.train_steps
    anchors = torch.tensor([[anchor]])
    select = torch.zeros(1, 1, K, dtype=torch.bool)
    select[0, 0, :k] = True
    logits = drafter(out.features, ids[None], torch.ones_like(ids[None]).bool(), anchors, select).logits[k - 1]
    q = torch.softmax(logits.float(), -1)
    return q if model.draft_ids is None else model.full_vocab_probs(q)


def p_next(target, ids: torch.Tensor) -> torch.Tensor:
    return torch.softmax(target.forward(ids[None], logits_at="last").logits[0, -1].float(), -1)


@pytest.mark.parametrize("algo,draft_ids", [("dspark", None), ("dspark", [0, 2, 3, 5, 7]), ("dflash", None),
                                            ("eagle3", None)])
@torch.no_grad()
def test_estimators_match_exact_enumeration(target, algo, draft_ids):
    drafter = make_drafter(target, algo, draft_ids)
    prefix, anchor = [1, 2, 3, 4], 3  # prompt 1 2 3, the anchor token 4 is the first generated token
    p1 = p_next(target, torch.tensor(prefix))
    q1 = full_q(drafter, target, torch.tensor(prefix + [0, 0]), anchor, 1)
    exact1 = float(torch.minimum(p1, q1).sum())  # P(draft 1 accepted)
    exact2, iw1, iw2, alpha_prod2 = 0.0, 0.0, 0.0, 0.0
    for x1, x2 in itertools.product(range(V), range(V)):
        ids = torch.tensor(prefix + [x1, x2])
        p2 = p_next(target, ids[:-1])
        q2 = full_q(drafter, target, ids, anchor, 2)
        prob = float(p1[x1] * p2[x2])  # the trajectory's probability under the target
        if x2 == 0:  # once per x1: P(both accepted) = Σ_x1 min(p1,q1)(x1) · Σ_x2 min(p2,q2)
            exact2 += float(torch.minimum(p1[x1], q1[x1])) * float(torch.minimum(p2, q2).sum())
        acc = sequence_acceptance(drafter, target, ids, torch.tensor([0, 0, 0, 1, 1, 1]), SP)
        row = 0  # the first valid anchor is position 3
        assert acc.select[row, :2].all()
        iw = acc.prefix_probs(2, "iw")[row]
        iw1 += prob * float(iw[0])
        iw2 += prob * float(iw[1])
        alpha_prod2 += prob * float(acc.prefix_probs(2, "alpha")[row, 1])
        assert float(acc.prefix_probs(1, "alpha")[row, 0]) == pytest.approx(exact1, abs=1e-5)
    assert iw1 == pytest.approx(exact1, abs=1e-5)
    assert iw2 == pytest.approx(exact2, abs=1e-5)  # unbiased for every k
    assert 0.0 <= alpha_prod2 <= 1.0  # the product is an approximation for k >= 2 (not asserted equal)


@torch.no_grad()
def test_draft_temperature_is_the_q_the_estimate_scores(target):
    """With draft_temperature t, α_1 = Σ min(p, softmax(logits / t)): the q decoding draws drafts from."""
    drafter = make_drafter(target, "dspark")
    prefix, anchor = [1, 2, 3, 4], 3
    ids = torch.tensor(prefix + [5, 6])
    p1 = p_next(target, torch.tensor(prefix))
    q1 = full_q(drafter, target, ids, anchor, 1)
    mask = torch.tensor([0, 0, 0, 1, 1, 1])
    for t in (0.5, 1.0, 1.7):
        drafter.draft_temperature = t
        sharpened = torch.softmax(torch.log(q1) / t, -1)
        alpha = sequence_acceptance(drafter, target, ids, mask, SP).prefix_probs(1, "alpha")[0, 0]
        assert float(alpha) == pytest.approx(float(torch.minimum(p1, sharpened).sum()), abs=1e-5)


@pytest.mark.slow  # ~30-60 s on 2 shared cores (500 decodes of the micro model)
@torch.no_grad()
def test_estimate_agrees_with_real_speculative_decoding_first_round(target):
    """E[accepted + 1] of the first round (anchor = the prefill's token) over many decoding seeds vs the
    estimator at the first anchor of independent target-only trajectories of the same prompt."""
    drafter = make_drafter(target, "dspark", block_size=3)
    prompt, gamma, n = [1, 2, 3, 4, 5], 3, 250
    real = []
    for s in range(n):  # one round: the prefill's token + up to gamma + 1 more
        res = speculative_generate(target, drafter, prompt, SP, max_new_tokens=gamma + 2, stop_ids=[],
                                   generator=torch.Generator().manual_seed(s))
        real.append(res.rounds[0].accepted + 1)
    est = {"alpha": [], "iw": []}
    for s in range(n):
        new = target_generate(target, prompt, SP, max_new_tokens=gamma + 2, stop_ids=[],
                              generator=torch.Generator().manual_seed(10_000 + s)).token_ids
        acc = sequence_acceptance(drafter, target, torch.tensor(prompt + new),
                                  torch.tensor([0] * len(prompt) + [1] * len(new)), SP)
        for e in est:
            est[e].append(float(acc.taus(gamma, e)[0]))  # row 0 = anchor at the first generated token
    real_mean, real_se = np.mean(real), np.std(real) / np.sqrt(n)
    iw_mean, iw_se = np.mean(est["iw"]), np.std(est["iw"]) / np.sqrt(n)
    assert 1.2 < real_mean < gamma + 1  # a drafter that gets some drafts accepted: the check has power
    assert abs(real_mean - iw_mean) < 4 * np.hypot(real_se, iw_se), (real_mean, iw_mean, real_se, iw_se)
    assert abs(real_mean - np.mean(est["alpha"])) < 0.25  # the cheap product: close, not exact


def test_estimate_summary_and_bootstrap(target):
    drafter = make_drafter(target)
    rows = [{"prompt_id": f"p{i}", "domain": "a" if i % 2 else "b",
             "input_ids": [1, 2, 3] + [(i + j) % V for j in range(6)], "loss_mask": [0, 0, 0] + [1] * 6}
            for i in range(6)]
    out = estimate(drafter, target, rows, gamma=3, sampling=SP, resamples=200)
    for e in ("alpha", "iw"):
        s = out[e]
        assert s["prompts"] == 6 and s["anchors"] == 6 * 5  # 6 generated tokens -> 5 eligible anchors each
        lo, hi = s["expected_tau_ci95"]
        assert 1.0 <= lo <= s["expected_tau"] <= hi <= 4.0
        assert set(s["per_group"]) == {"a", "b"} and len(s["acceptance_per_position"]) == 3
    lo, hi = bootstrap_ratio(np.array([2.0, 2.0, 2.0]), np.array([1.0, 1.0, 1.0]), 100)
    assert lo == hi == 2.0  # identical prompts: no spread


@torch.no_grad()
def test_anchor_stride_keeps_every_kth_anchor_unchanged(target):
    """Blocks attend to the context and to themselves only: a subsample of anchors gives exactly the
    same per-anchor values (so the strided estimate is an unbiased, cheaper estimate)."""
    drafter = make_drafter(target)
    ids = torch.tensor([1, 2, 3] + [(5 * j) % V for j in range(9)])
    mask = torch.tensor([0, 0, 0] + [1] * 9)
    full = sequence_acceptance(drafter, target, ids, mask, SP)
    half = sequence_acceptance(drafter, target, ids, mask, SP, anchor_stride=2)
    assert half.alpha.shape[0] == (full.alpha.shape[0] + 1) // 2
    assert torch.allclose(half.alpha, full.alpha[::2], atol=1e-6)
    assert torch.equal(half.select, full.select[::2])


def test_paired_difference_cancels_the_shared_prompt_spread():
    """Two drafters on the same prompts: B is A + 0.05 on every prompt's τ. The unpaired intervals (the
    prompt-to-prompt spread, here 1.2 to 2.6) overlap completely; the paired one is the 0.05 exactly."""
    from dspark.eval.acceptance_estimate import paired_difference

    rng = np.random.default_rng(0)
    anchors = rng.integers(10, 50, size=40)
    tau = rng.uniform(1.2, 2.6, size=40)
    a = {f"p{i}": [int(n), float(n * t)] for i, (n, t) in enumerate(zip(anchors, tau))}
    b = {k: [n, s + 0.05 * n] for k, (n, s) in a.items()}
    d = paired_difference(b, a)
    assert d["difference"] == pytest.approx(0.05) and d["prompts"] == 40
    assert d["ci95"][0] == pytest.approx(0.05) and d["ci95"][1] == pytest.approx(0.05)
    assert d["share_of_resamples_above_0"] == 1.0
    assert paired_difference(a, a)["difference"] == 0.0
    with pytest.raises(ValueError, match="share no prompts"):
        paired_difference(a, {"other": [3, 4.0]})


def test_expected_rounds_follows_the_renewal_recursion():
    """Anchors at positions 3..6 (answer tokens 3..7), γ 2: the recursion against its closed forms and
    against simulating the rounds along the trajectory (accept draft k with probability w_{t,k})."""
    from dspark.eval.acceptance_estimate import SequenceAcceptance

    positions = torch.tensor([3, 4, 5, 6])
    select = torch.tensor([[True, True], [True, True], [True, True], [True, False]])  # anchor 6: draft 2 is past the end

    def acc(w):
        return SequenceAcceptance(torch.full((4, 2), 0.5), torch.as_tensor(w, dtype=torch.float32), select, positions)

    assert acc(torch.ones(4, 2)).expected_rounds(2) == pytest.approx(2.0)  # 3 -> accept 2 -> 6 -> accept 1: done
    assert acc(torch.zeros(4, 2)).expected_rounds(2) == pytest.approx(4.0)  # one token per round
    assert acc(torch.ones(4, 2)).expected_rounds(1) == pytest.approx(2.0)  # γ 1: 3 -> 5 -> done
    w = torch.tensor([[0.9, 0.2], [0.5, 0.7], [0.3, 0.8], [0.6, 0.4]])
    rng, total, n = np.random.default_rng(0), 0, 20_000
    for _ in range(n):
        i = 0
        while i < 4:
            total += 1
            k = 0
            while k < 2 and select[i, k] and rng.random() < w[i, k]:
                k += 1
            i += k + 1
    assert acc(w).expected_rounds(2) == pytest.approx(total / n, abs=0.02)
    with pytest.raises(ValueError, match="positions"):
        SequenceAcceptance(w, w, select).expected_rounds(2)


def test_renewal_needs_every_anchor_and_pairs_like_the_others(target):
    drafter = make_drafter(target)
    rows = [{"prompt_id": f"p{i}", "domain": "a", "input_ids": [1, 2, 3] + [(i + j) % V for j in range(6)],
             "loss_mask": [0, 0, 0] + [1] * 6} for i in range(4)]
    out = estimate(drafter, target, rows, gamma=3, sampling=SP, resamples=200)
    r = out["renewal"]
    assert r["prompts"] == 4 and r["tokens"] == 4 * 5
    assert 1.0 <= r["decoded_tau_ci95"][0] <= r["decoded_tau"] <= r["decoded_tau_ci95"][1] <= 4.0
    assert set(r["per_prompt"]) == {f"p{i}" for i in range(4)} and r["per_group"]["a"]["prompts"] == 4
    assert "renewal" not in estimate(drafter, target, rows, gamma=3, sampling=SP, resamples=50, anchor_stride=2)


@pytest.mark.slow  # ~30-60 s on 2 shared cores
@torch.no_grad()
def test_renewal_agrees_with_real_speculative_decoding_whole_generations(target):
    """Σ emitted tokens / Σ rounds of real decoding over many seeds vs the renewal estimate on independent
    target-only trajectories of the same prompt and length (the per-anchor estimators read above it)."""
    drafter = make_drafter(target, "dspark", block_size=3)
    prompt, gamma, new_tokens, n = [1, 2, 3, 4, 5], 3, 10, 150
    tokens, rounds = [], []
    for s in range(n):
        res = speculative_generate(target, drafter, prompt, SP, max_new_tokens=new_tokens, stop_ids=[],
                                   generator=torch.Generator().manual_seed(s))
        tokens.append(sum(r.emitted for r in res.rounds))
        rounds.append(len(res.rounds))
    rows = [{"prompt_id": f"s{s}", "domain": "x", "loss_mask": [0] * len(prompt) + [1] * new_tokens,
             "input_ids": prompt + target_generate(target, prompt, SP, new_tokens, stop_ids=[],
                                                   generator=torch.Generator().manual_seed(10_000 + s)).token_ids}
            for s in range(n)]
    est = estimate(drafter, target, rows, gamma, SP, resamples=500)["renewal"]
    real = sum(tokens) / sum(rounds)
    real_lo, real_hi = bootstrap_ratio(np.array(tokens, float), np.array(rounds, float), 500)
    assert 1.1 < real < gamma + 1  # drafts do get accepted (measured 1.19 [1.16, 1.23]; renewal 1.22, iw 1.24)
    se = np.hypot(real_hi - real_lo, est["decoded_tau_ci95"][1] - est["decoded_tau_ci95"][0]) / (2 * 1.96)
    assert abs(real - est["decoded_tau"]) < 4 * se, (real, est["decoded_tau"], se)


def test_expected_rounds_restart_at_each_answer_turn():
    """Two answer turns (anchors 3..5 and 9..11): a round never crosses into the next turn, each turn's
    rounds start at its own first anchor."""
    from dspark.eval.acceptance_estimate import SequenceAcceptance

    positions = torch.tensor([3, 4, 5, 9, 10, 11])
    select = torch.ones(6, 2, dtype=torch.bool)
    rejected = SequenceAcceptance(torch.zeros(6, 2), torch.zeros(6, 2), select, positions)
    assert rejected.expected_rounds(2) == pytest.approx(6.0)  # one token per round, both turns
    accepted = SequenceAcceptance(torch.ones(6, 2), torch.ones(6, 2), select, positions)
    assert accepted.expected_rounds(2) == pytest.approx(2.0)  # one round of 3 tokens per turn


def simulate_candidates(p: np.ndarray, q: np.ndarray, n: int, trials: int, rng) -> np.ndarray:
    """Monte Carlo of n distinct candidates drawn from q without replacement under recursive rejection
    sampling: the share of trials that accept a candidate with token x (index x), or none (index V)."""
    p, q = p / p.sum(), q / q.sum()
    counts = np.zeros(len(p) + 1)
    for _ in range(trials):
        resid, left = p.copy(), q.copy()
        for _ in range(n):
            qj = left / left.sum()
            x = rng.choice(len(q), p=qj)
            if rng.random() < min(1.0, resid[x] / qj[x]):
                counts[x] += 1
                break
            resid = np.maximum(resid - qj, 0)
            resid /= resid.sum()
            left[x] = 0
        else:
            counts[-1] += 1
    return counts / trials


@pytest.mark.parametrize("n", [1, 2, 3])
def test_candidates_acceptance_matches_simulated_recursive_rejection(n):
    from dspark.eval.acceptance_estimate import candidates_acceptance

    gen = torch.Generator().manual_seed(n)
    p = torch.softmax(2 * torch.randn(6, generator=gen), 0).double()
    q = torch.softmax(2 * torch.randn(6, generator=gen), 0).double()
    copies = 1000  # 1000 copies of each trajectory token x = 0..5: rows of one batch, averaged (Monte Carlo)
    cols = torch.arange(6).repeat(copies)
    alpha, weight = candidates_acceptance(p.expand(6 * copies, 6), q.expand(6 * copies, 6), cols, p[cols], n,
                                          samples=8)
    joint = (weight.double().view(copies, 6).mean(0) * p).numpy()  # P(accepted with token x)
    sim = simulate_candidates(p.numpy(), q.numpy(), n, 40_000, np.random.default_rng(n))
    assert np.allclose(joint, sim[:-1], atol=0.01)  # Monte Carlo on both sides
    assert abs(float(alpha.mean()) - sim[:-1].sum()) < 0.01
    if n == 1:  # one draft: Σ min(p, q) and min(1, q/p), exactly
        assert torch.allclose(alpha.double(), torch.minimum(p, q).sum().expand(6 * copies), atol=1e-6)
        assert torch.allclose(weight.double(), (q / p).clamp(max=1)[cols], atol=1e-6)


def test_candidates_acceptance_on_a_draft_vocabulary_equals_the_full_one():
    """q on a draft vocabulary (zero outside): the residual keeps p's outside mass; same as q scattered."""
    from dspark.eval.acceptance_estimate import candidates_acceptance

    gen = torch.Generator().manual_seed(7)
    p = torch.softmax(torch.randn(4, 10, generator=gen), 1)
    ids = torch.tensor([0, 2, 3, 7, 8])
    q_sub = torch.softmax(torch.randn(4, 5, generator=gen), 1)
    q_full = torch.zeros(4, 10).index_copy(1, ids, q_sub)
    tokens = torch.tensor([2, 8, 1, 7])  # 1 is outside the draft vocabulary
    cols = torch.tensor([1, 4, -100, 3])
    p_tok = p.gather(1, tokens[:, None]).squeeze(1)
    copies = 5000  # rows repeated and averaged: the Monte Carlo over the candidates' draws
    rep = lambda t: t.repeat(copies, *[1] * (t.dim() - 1))  # noqa: E731
    a_sub, w_sub = (t.view(copies, 4).mean(0) for t in candidates_acceptance(
        rep(p), rep(q_sub), rep(cols), rep(p_tok), 3, ids, samples=4))
    a_full, w_full = (t.view(copies, 4).mean(0) for t in candidates_acceptance(
        rep(p), rep(q_full), rep(tokens), rep(p_tok), 3, samples=4))
    assert torch.allclose(a_sub, a_full, atol=0.01) and torch.allclose(w_sub, w_full, atol=0.02)
    assert w_sub[2] == 0 and (a_sub > candidates_acceptance(p, q_sub, cols, p_tok, 1, ids)[0]).all()


@torch.no_grad()
def test_wider_draft_trees_raise_the_estimate_and_one_chain_changes_nothing(target):
    drafter = make_drafter(target)
    gen = torch.Generator().manual_seed(5)
    rows = [{"prompt_id": str(i), "input_ids": torch.randint(0, V, (20,), generator=gen).tolist(),
             "loss_mask": [0] * 4 + [1] * 16} for i in range(3)]
    taus = [estimate(drafter, target, rows, 3, SP, branching=b) for b in ((1,), (2,), (3,), (3, 2))]
    plain = estimate(drafter, target, rows, 3, SP)
    assert taus[0]["renewal"]["decoded_tau"] == plain["renewal"]["decoded_tau"]
    for key in ("renewal", "alpha", "iw"):
        tau = [t[key]["decoded_tau" if key == "renewal" else "expected_tau"] for t in taus]
        assert tau[0] < tau[1] < tau[2] < tau[3]
    for bad in ((0,), (1, 1, 1, 2)):
        with pytest.raises(ValueError, match="branching"):
            estimate(drafter, target, rows, 3, SP, branching=bad)
