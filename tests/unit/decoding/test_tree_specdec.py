"""Tree speculative decoding (dspark/decoding/tree_specdec.py): lossless at temperature 1 (χ² of the first
tokens' joint against the exact target joint, through the real decoder), the multi-round acceptance walk
against the exact law, the tree's attention layout, and a compacted cache that equals a fresh forward."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark.decoding import kv_sequence, specdec
from dspark.decoding.sampling import SamplingParams
from dspark.decoding.batched_cache import tree_visibility
from dspark.decoding.kv_sequence import additive_layout_mask
from dspark.decoding.tree_specdec import (accept_tree, children_of, parse_branching, tree_speculative_generate,
                                          verify_parents)
from dspark.drafters import DrafterConfig, build_drafter
from tests.lossless_stats import chi2_pvalue, exact_joint
from tests.tiny_models import build_tiny_model

VOCAB, PROMPT, N_TOKENS, GAMMA = 6, [1, 5, 2, 4, 3], 3, 3
SP = SamplingParams(temperature=1.0)


@pytest.fixture(scope="module")
def micro_target():
    return build_tiny_model(vocab_size=VOCAB, seed=0, num_layers=3, hidden_size=32, init_std=0.3)


TREE_RUNS = 2000  # 216 cells of the 3-token joint; the engine and compiled-core tree tests add their own runs


def _drafter(target, head="rnn", draft_ids=None):
    torch.manual_seed(0)
    cfg = DrafterConfig(algo="dspark", block_size=GAMMA, num_layers=1, num_context_layers=2, rank=8, init_std=0.2,
                        head=head, draft_vocab_size=None if draft_ids is None else len(draft_ids))
    return build_drafter(cfg, target, draft_ids=None if draft_ids is None else torch.tensor(draft_ids)).eval()


@pytest.mark.heavy
@pytest.mark.parametrize("branching,head,draft_ids", [((3,), "rnn", None), ((2, 2), "markov", [0, 1, 3, 5])])
def test_tree_decoding_is_lossless(micro_target, branching, head, draft_ids):
    drafter = _drafter(micro_target, head, draft_ids)
    gen = torch.Generator().manual_seed(7)
    counts, nodes = np.zeros([VOCAB] * N_TOKENS), []
    for _ in range(TREE_RUNS):
        out = tree_speculative_generate(micro_target, drafter, PROMPT, SP, N_TOKENS, branching, stop_ids=[],
                                        generator=gen)
        counts[tuple(out.token_ids)] += 1
        nodes += [r.proposed for r in out.rounds]
        assert all(r.verified == GAMMA and r.accepted <= GAMMA for r in out.rounds)
    p = chi2_pvalue(counts, exact_joint(micro_target, PROMPT, N_TOKENS, SP, VOCAB))
    print(f"\n[lossless] tree {branching} ({head}): chi2 p-value = {p:.4g} over {TREE_RUNS} runs")
    assert p > 1e-3
    width = 1
    expected_nodes = 0
    for k in range(GAMMA):
        width *= branching[k] if k < len(branching) else 1
        expected_nodes += width
    assert set(nodes) == {expected_nodes}


@pytest.mark.heavy
def test_the_walk_emits_the_target_law_at_the_first_position():
    """Three distinct candidates drawn from q at the root, a tiny vocabulary: P(first token = x) = p(x)
    exactly, whether it comes from an accepted child or from the last residual."""
    from dspark.decoding.sampling import draw_distinct, sibling_proposals
    from dspark.eval.acceptance_estimate import candidates_acceptance

    gen_p = torch.Generator().manual_seed(3)
    p = torch.softmax(2 * torch.randn(5, generator=gen_p), 0)
    q = torch.softmax(2 * torch.randn(5, generator=gen_p), 0)
    gen, counts, accepted = torch.Generator().manual_seed(4), np.zeros(5), 0
    runs = 20_000
    for _ in range(runs):
        kids = draw_distinct(q[None], 3, gen)
        path, nxt = accept_tree(kids[0], [-1, -1, -1], sibling_proposals(q[None], kids)[0], p.expand(4, 5), gen)
        counts[int(kids[0, path[0]]) if path else nxt] += 1
        accepted += bool(path)
    assert chi2_pvalue(counts, p.double().numpy()) > 1e-3
    # P(some child accepted) agrees with the estimator's (dspark.eval.acceptance_estimate)
    alpha, _ = candidates_acceptance(p[None], q[None], torch.tensor([0]), p[:1], 3, samples=2000)
    assert abs(accepted / runs - float(alpha)) < 0.015


def test_the_expected_path_length_is_the_walks_mean():
    """A fixed 2x2 tree over 6 tokens, random p per row: `tree_expected_accepted` equals the mean accepted
    path length of 20,000 walks (and 1 for a tree whose single child is p's only token)."""
    from dspark.decoding.tree_specdec import tree_expected_accepted

    from dspark.decoding.sampling import sibling_proposals

    gen = torch.Generator().manual_seed(5)
    parents, tokens = [-1, -1, 0, 0, 1, 1], torch.tensor([0, 1, 2, 3, 4, 5])
    q = torch.softmax(3 * torch.randn(3, 6, generator=gen), -1)  # the anchor's row, node 0's, node 1's
    draft = sibling_proposals(q, tokens.view(3, 2)).reshape(6, 6)  # each child's row: q less earlier siblings
    target = torch.softmax(3 * torch.randn(7, 6, generator=gen), -1)
    runs = 20_000
    lengths = [len(accept_tree(tokens, parents, draft, target, gen)[0]) for _ in range(runs)]
    expected = tree_expected_accepted(tokens, parents, draft, target)
    assert 0.2 < expected < 1.8 and abs(np.mean(lengths) - expected) < 4 * np.std(lengths) / runs ** 0.5
    one_hot = torch.eye(6)[[2, 2]]
    assert tree_expected_accepted(torch.tensor([2]), [-1], draft[:1], one_hot) == pytest.approx(1.0)


def test_siblings_are_distinct_and_draw_without_replacement():
    from dspark.decoding.sampling import draw_distinct, sibling_proposals

    q = torch.tensor([[0.5, 0.3, 0.2, 0.0]])
    gen, firsts, seconds = torch.Generator().manual_seed(0), np.zeros(4), np.zeros(4)
    for _ in range(4000):
        picks = draw_distinct(q, 2, gen)[0]
        assert picks[0] != picks[1]
        firsts[picks[0]] += 1
        seconds[picks[1]] += 1
    assert np.allclose(firsts / 4000, [0.5, 0.3, 0.2, 0.0], atol=0.03)
    # P(second = y) = Σ_{x ≠ y} q(x) q(y) / (1 − q(x))
    exact = [sum(float(q[0, x] * q[0, y] / (1 - q[0, x])) for x in range(3) if x != y) for y in range(4)]
    assert np.allclose(seconds / 4000, exact, atol=0.03)
    rows = sibling_proposals(q, torch.tensor([[0, 2, 1]]))[0]
    assert torch.allclose(rows, torch.tensor([[0.5, 0.3, 0.2, 0], [0, 0.6, 0.4, 0], [0, 1, 0, 0]]))
    assert not sibling_proposals(torch.tensor([[1.0, 0, 0]]), torch.tensor([[0, 1]]))[0, 1].any()  # nothing left


def test_tree_attention_sees_ancestors_only():
    # anchor -> a, b; a -> c; b -> d  (depths 1, 1, 2, 2): the layout a tree round verifies with
    seen, depth = tree_visibility(verify_parents([-1, -1, 0, 1]))
    mask, positions = additive_layout_mask(seen, cached=2, dtype=torch.float32), (2 + depth)[None]
    visible = (mask[0, 0] == 0).int().tolist()
    assert visible == [[1, 1, 1, 0, 0, 0, 0],   # anchor: cache + itself
                       [1, 1, 1, 1, 0, 0, 0],   # a
                       [1, 1, 1, 0, 1, 0, 0],   # b
                       [1, 1, 1, 1, 0, 1, 0],   # c under a
                       [1, 1, 1, 0, 1, 0, 1]]   # d under b
    assert positions.tolist() == [[2, 3, 3, 4, 4]]


@pytest.mark.parametrize("kind", ["static_cache", "dynamic_cache"])
def test_the_kept_cache_equals_a_fresh_forward(micro_target, monkeypatch, kind):
    """After tree rounds the compacted cache is the cache of [prompt, emitted tokens]: the next-token logits
    from it equal a fresh forward over the whole sequence (the static core's sequence and HF's dynamic cache)."""
    drafter = _drafter(micro_target)
    opened = []

    def open_sequence(target, mode=None):
        opened.append(kv_sequence.DynamicSequence(target) if kind == "dynamic_cache"
                      else kv_sequence.open_sequence(target, "eager"))
        return opened[-1]

    monkeypatch.setattr(specdec, "open_sequence", open_sequence)
    out = tree_speculative_generate(micro_target, drafter, PROMPT, SP, 12, (3, 2), stop_ids=[],
                                    generator=torch.Generator().manual_seed(1))
    tokens = PROMPT + out.token_ids
    n = len(PROMPT) + sum(r.emitted for r in out.rounds[:-1])  # [prompt, tokens emitted]: all but the anchor
    assert len(out.rounds) >= 3 and opened[0].length >= n
    opened[0].crop(n)  # the verified prefix stays valid whatever later rounds wrote behind it
    step = opened[0].extend([tokens[n]], logits="last").logits[0, -1]
    fresh = micro_target.forward(torch.tensor([tokens[: n + 1]]), logits_at="last").logits[0, -1]
    assert torch.allclose(step, fresh, atol=1e-5)


def test_drafters_without_trees_and_bad_branching_are_refused(micro_target):
    torch.manual_seed(0)
    dflash = build_drafter(DrafterConfig(algo="dflash", block_size=GAMMA, num_layers=1, num_context_layers=2),
                           micro_target)
    with pytest.raises(ValueError, match="draft trees"):
        tree_speculative_generate(micro_target, dflash, PROMPT, SP, 4, (2,))
    with pytest.raises(ValueError, match="branching"):
        tree_speculative_generate(micro_target, _drafter(micro_target), PROMPT, SP, 4, (2, 2, 2, 2))


@pytest.mark.parametrize("text, counts", [("4", (4,)), ("3x2", (3, 2)), ("10x1x2", (10, 1, 2))])
def test_branching_is_read_as_children_per_depth(text, counts):
    assert parse_branching(text) == counts


@pytest.mark.parametrize("text", ["", "0", "2x0", "2x", "x2", "2*2", "-1", "2 x 2", "02"])
def test_a_branching_that_is_not_a_tree_is_refused(text):
    with pytest.raises(ValueError, match="is not a tree"):
        parse_branching(text)


def test_children_are_listed_in_draw_order_under_each_parent():
    # anchor -> 0, 1; 0 -> 2, 3; 1 -> 4
    assert children_of([-1, -1, 0, 0, 1]) == {-1: [0, 1], 0: [2, 3], 1: [4]}
