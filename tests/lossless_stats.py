"""Shared by the lossless tests (test_specdec, test_engine): the exact target joint of the first
tokens and a pooled Pearson χ² test of sampled counts against it."""
from __future__ import annotations

import itertools

import numpy as np
import torch
from scipy import stats

from dspark.decoding.sampling import SamplingParams, to_probs


def exact_joint(target, prompt: list[int], n_tokens: int, sp: SamplingParams, vocab: int,
                allowed=None) -> np.ndarray:
    """P(t_1..t_n) under target-only sampling, from one batched forward per extra token over all
    prefixes (vocab^depth rows): only for micro vocabularies. allowed(prefix) -> bool [V]: a grammar's
    mask after the generated `prefix` (structured output): the target's logits outside it are -inf."""
    joint = torch.ones([1], dtype=torch.float64)
    for depth in range(n_tokens):
        prefixes = list(itertools.product(range(vocab), repeat=depth))
        ids = torch.tensor([prompt + list(p) for p in prefixes])
        logits = target.forward(ids, logits_at="last").logits[:, -1]
        if allowed is not None:
            masks = torch.stack([allowed(list(p)) for p in prefixes])
            logits = logits.masked_fill(~masks, float("-inf"))
        cond = to_probs(logits, sp).double().nan_to_num(0.0)  # [V^depth, V]; unreachable prefixes: 0
        joint = (joint.reshape(-1, 1) * cond).reshape(-1)
    return joint.reshape([vocab] * n_tokens).numpy()


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> float:
    """Pearson χ² goodness of fit; cells with expected count < min_expected are pooled into one."""
    counts, expected = counts.ravel(), probs.ravel() / probs.sum() * counts.sum()
    small = expected < min_expected
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    assert obs[~keep].sum() == 0, "a token sequence with zero target probability was generated"
    return float(stats.chisquare(obs[keep], exp[keep]).pvalue)


def three_token_pvalues(outputs: list[list[int]], target, prompt: list[int], sp: SamplingParams,
                        vocab: int, allowed=None) -> tuple[float, float]:
    """χ² p-values of the sampled joints of tokens (1, 2) and (2, 3) of `outputs` (3 tokens each) against
    the target's exact joint after `prompt` (under the grammar mask `allowed`, see exact_joint)."""
    counts = np.zeros([vocab] * 3)
    for tokens in outputs:
        counts[tuple(tokens)] += 1
    joint = exact_joint(target, prompt, 3, sp, vocab, allowed)
    return chi2_pvalue(counts.sum(2), joint.sum(2)), chi2_pvalue(counts.sum(0), joint.sum(0))


def engine_three_token_pvalues(engine, target, prompt: list[int], sp: SamplingParams, vocab: int,
                               runs: int) -> tuple[float, float, dict]:
    """`runs` concurrent requests of `prompt` for 3 tokens each through `engine` (they join and leave between
    steps): `three_token_pvalues` of their outputs and the engine's totals."""
    reqs = engine.generate([prompt] * runs, sp, max_new_tokens=3, stop_ids=[])
    assert all(r.finish_reason == "length" and len(r.tokens) == 3 for r in reqs)
    p12, p23 = three_token_pvalues([r.tokens for r in reqs], target, prompt, sp, vocab)
    return p12, p23, engine.stats()["totals"]
