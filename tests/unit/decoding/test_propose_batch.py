"""Batched drafting (`Drafter.propose_batch`): one drafter pass for many requests gives every request
the proposal distribution it would get from `propose` on its own, whatever the mix of context lengths
(an empty one included), sampling params and gammas in the batch."""
import dataclasses
import sys

import pytest
import torch
from scipy import stats

import dspark.decoding.sampling
from dspark.drafters import DrafterConfig, build_drafter
from dspark.drafters.base import BlockDraws
from dspark.decoding.sampling import SamplingParams, to_probs
from tests.tiny_models import build_tiny_model

VARIANTS = [("dflash", "markov"), ("dspark", "markov"), ("dspark", "rnn"), ("dspark", "none"), ("eagle3", "markov")]
CONTEXT_LENS = [0, 3, 9, 5, 9]
SAMPLINGS = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_k=5),
             SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=0),
             SamplingParams(temperature=1.3)]
GAMMAS = [4, 2, 3, 1, 4]


@pytest.fixture(scope="module")
def target():
    return build_tiny_model(vocab_size=16)


def make(target, algo, head="markov", seed=0):
    torch.manual_seed(seed)
    kw = {} if algo == "eagle3" else {"num_layers": 2}
    return build_drafter(DrafterConfig(algo=algo, head=head, rank=8, block_size=4, ttt_steps=4, **kw), target)


def requests(target, drafter, lens=CONTEXT_LENS, seed=5):
    """One drafting state per context length (built in two extend calls) and the anchor after it."""
    ids = torch.randint(0, 16, (len(lens), max(lens) + 1), generator=torch.Generator().manual_seed(seed))
    feats = target.forward(ids, layer_ids=drafter.layer_ids, logits_at=None).features
    states, anchors = [], []
    for r, n in enumerate(lens):
        state = drafter.new_state()
        drafter.extend_context(state, feats[r, : n // 2], ids[r, : n // 2])
        drafter.extend_context(state, feats[r, n // 2: n], ids[r, n // 2: n])
        states.append(state)
        anchors.append(int(ids[r, n]))
    return states, anchors


class forced_sampling:
    """`sample` inside the drafter modules and a block's position draws (`BlockDraws.draw`) return the given
    tokens in order (draw nothing)."""

    def __init__(self, monkeypatch, tokens):
        self.mp, self.tokens = monkeypatch, [int(t) for t in tokens]

    def _forced(self, probs, generator=None):
        n = probs[..., 0].numel()
        out, self.tokens = self.tokens[:n], self.tokens[n:]
        return torch.tensor(out, dtype=torch.long).reshape(probs.shape[:-1])

    def _forced_draw(self, probs, k):
        return slice(None), self._forced(probs)

    def __enter__(self):
        self.mp.setattr(BlockDraws, "draw", lambda draws, probs, k: self._forced_draw(probs, k))
        for name, module in list(sys.modules.items()):
            if name.startswith("dspark.drafters") and getattr(module, "sample", None) is dspark.decoding.sampling.sample:
                self.mp.setattr(module, "sample", self._forced)
        return self

    def __exit__(self, *exc):
        self.mp.undo()
        assert not self.tokens, "forced tokens left over: propose drew fewer tokens than expected"


@pytest.mark.parametrize("algo,head", VARIANTS)
def test_batch_equals_single_request_proposals(monkeypatch, target, algo, head):
    """Mixed context lengths (one empty), params (greedy, top-k, top-p) and gammas in one batch: greedy
    rows give propose's tokens; every row's probs/confidences equal propose's given the same prefix."""
    drafter = make(target, algo, head)
    states, anchors = requests(target, drafter)
    batch = drafter.propose_batch(states, anchors, GAMMAS, SAMPLINGS, torch.Generator().manual_seed(0))
    assert [int(p.tokens.shape[0]) for p in batch] == GAMMAS
    for state, anchor, gamma, sp, got in zip(states, anchors, GAMMAS, SAMPLINGS, batch):
        if sp.greedy:
            want = drafter.propose(state, anchor, gamma, sp)
        else:  # teacher-force the batch's sampled tokens through the single-request path
            with forced_sampling(monkeypatch, got.tokens):
                want = drafter.propose(state, anchor, gamma, sp)
        assert torch.equal(got.tokens, want.tokens)
        assert got.probs.shape == (gamma, 16)
        torch.testing.assert_close(got.probs, want.probs, atol=1e-5, rtol=0)
        assert bool((got.probs[torch.arange(gamma), got.tokens] > 0).all())  # drawn from its own row
        if want.confidences is None:
            assert got.confidences is None
        else:
            torch.testing.assert_close(got.confidences, want.confidences, atol=1e-5, rtol=0)


@pytest.mark.parametrize("head", ["markov", "rnn"])
def test_dspark_batch_matches_unpadded_teacher_forced_math(target, head):
    """Independent reference: the unpadded single block (block_hidden) and the teacher-forced head
    (sequential_logits) on the batch's own sampled prefix give the batch's rows and confidences."""
    drafter = make(target, "dspark", head)
    drafter.calibration = [1.5, 0.7, 2.0, 1.0]
    states, anchors = requests(target, drafter)
    batch = drafter.propose_batch(states, anchors, GAMMAS, SAMPLINGS, torch.Generator().manual_seed(1))
    for state, anchor, gamma, sp, got in zip(states, anchors, GAMMAS, SAMPLINGS, batch):
        h = drafter.block_hidden(state, anchor)[:gamma]
        prev = torch.cat([torch.tensor([anchor]), got.tokens[:-1]])
        with torch.no_grad():
            logits, conf = drafter.sequential_logits(drafter.lm_logits(h), h, prev)
        torch.testing.assert_close(got.probs, to_probs(logits, sp), atol=1e-5, rtol=0)
        torch.testing.assert_close(got.confidences, drafter.confidences(conf), atol=1e-5, rtol=0)


@pytest.mark.parametrize("algo", ["dspark", "dflash", "eagle3"])
def test_one_request_batch_reproduces_propose_draws(target, algo):
    """A batch of one draws the same random numbers as propose, so seeded runs are identical."""
    drafter = make(target, algo)
    states, anchors = requests(target, drafter, lens=[6])
    sp = SamplingParams(temperature=1.0)
    for seed in range(3):
        (a,) = drafter.propose_batch(states, anchors, 4, sp, torch.Generator().manual_seed(seed))
        b = drafter.propose(states[0], anchors[0], 4, sp, torch.Generator().manual_seed(seed))
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.probs, b.probs)


def test_dflash_batch_draws_like_the_request_loop(target):
    """DFlash samples all rows in one request-major call: the same stream as a loop of propose calls."""
    drafter = make(target, "dflash")
    states, anchors = requests(target, drafter)
    sps = [SamplingParams(temperature=1.0)] * len(states)
    batch = drafter.propose_batch(states, anchors, GAMMAS, sps, torch.Generator().manual_seed(2))
    g = torch.Generator().manual_seed(2)
    for s, a, gamma, sp, got in zip(states, anchors, GAMMAS, sps, batch):
        assert torch.equal(got.tokens, drafter.propose(s, a, gamma, sp, g).tokens)


@pytest.mark.parametrize("algo", ["dspark", "dflash", "eagle3"])
def test_per_request_generators_make_each_proposal_independent_of_the_batch(target, algo):
    """One generator per request: each request's proposal (mixed γ, one context empty) is exactly
    `propose` on its own with a generator of the same seed, whatever the other rows drew."""
    drafter = make(target, algo)
    states, anchors = requests(target, drafter)
    sps = [SamplingParams(temperature=1.0)] * len(states)
    batch = drafter.propose_batch(states, anchors, GAMMAS, sps, [torch.Generator().manual_seed(10 + r)
                                                                 for r in range(len(states))])
    for r, (s, a, gamma, sp, got) in enumerate(zip(states, anchors, GAMMAS, sps, batch)):
        alone = drafter.propose(s, a, gamma, sp, torch.Generator().manual_seed(10 + r))
        assert torch.equal(got.tokens, alone.tokens)
    with pytest.raises(ValueError, match="one generator per state"):
        drafter.propose_batch(states, anchors, GAMMAS, sps, [torch.Generator()])


@pytest.mark.parametrize("algo", ["dspark", "dflash", "eagle3"])
def test_batched_draws_follow_each_rows_distribution(target, algo):
    """Two different requests interleaved 32 times each: the first drafted token of each request
    follows that request's own distribution (χ² over 640 draws per request)."""
    drafter = make(target, algo)
    states, anchors = requests(target, drafter, lens=[0, 7], seed=3)
    sp = SamplingParams(temperature=2.0)
    reps = 32
    batch_states, batch_anchors = states * reps, anchors * reps
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(2, 16)
    for _ in range(20):
        props = drafter.propose_batch(batch_states, batch_anchors, 2, sp, gen)
        for r, p in enumerate(props):
            counts[r % 2, int(p.tokens[0])] += 1
    for r in range(2):
        want = drafter.propose(states[r], anchors[r], 1, sp).probs[0].double()
        keep = want > 0
        assert counts[r][~keep].sum() == 0
        expected = want[keep] / want[keep].sum() * counts[r].sum()
        assert stats.chisquare(counts[r][keep].double().numpy(), expected.numpy()).pvalue > 1e-3


def test_batch_input_errors_are_clear(target):
    drafter = make(target, "dspark")
    states, anchors = requests(target, drafter, lens=[2, 3])
    sp = SamplingParams()
    assert drafter.propose_batch([], [], 4, sp) == []
    with pytest.raises(ValueError, match="one per state"):
        drafter.propose_batch(states, anchors[:1], 4, sp)
    with pytest.raises(ValueError, match="one per state"):
        drafter.propose_batch(states, anchors, [4], sp)
    with pytest.raises(ValueError, match="block_size"):
        drafter.propose_batch(states, anchors, [4, 5], sp)


@pytest.mark.parametrize("algo,head", [("dspark", "markov"), ("dflash", "markov"), ("eagle3", "markov")])
def test_draft_temperature_scales_the_request_temperature(target, algo, head):
    """draft_temperature t drafts from the request's processing at temperature × t (the same draws as a
    request at that temperature); greedy requests stay greedy."""
    drafter = make(target, algo, head)
    states, anchors = requests(target, drafter, lens=[5, 9])
    sps = [SamplingParams(temperature=0.9, top_k=7), SamplingParams(temperature=0)]
    scaled = [SamplingParams(temperature=0.9 * 0.6, top_k=7), SamplingParams(temperature=0)]
    want = drafter.propose_batch(states, anchors, 3, scaled, torch.Generator().manual_seed(4))
    drafter.draft_temperature = 0.6
    got = drafter.propose_batch(states, anchors, 3, sps, torch.Generator().manual_seed(4))
    for g, w in zip(got, want):
        assert torch.equal(g.tokens, w.tokens) and torch.allclose(g.probs, w.probs)
    assert drafter.draft_sampling(sps[1]).greedy and drafter.draft_sampling(sps[0]).temperature == pytest.approx(0.54)


@pytest.mark.parametrize("algo", ["dspark", "dflash", "eagle3"])
def test_proposals_carry_their_tokens_and_confidences_on_the_host(target, algo):
    """One read for the whole batch (`split_proposals`, on first use): the host copies equal the tensors; a
    proposal whose tokens or confidences were replaced has none (readers then read the tensor)."""
    drafter = make(target, algo)
    states, anchors = requests(target, drafter)
    batch = drafter.propose_batch(states, anchors, GAMMAS, SAMPLINGS, torch.Generator().manual_seed(2))
    for got in batch:
        assert got.host_tokens == got.tokens.tolist()
        assert got.host_confidences == (None if got.confidences is None else got.confidences.tolist())
    proposal = batch[0]
    assert dataclasses.replace(proposal, tokens=proposal.tokens.flip(0)).host_tokens is None
    proposal.tokens = proposal.tokens.flip(0)
    assert proposal.host_tokens is None
    if proposal.confidences is not None:
        proposal.confidences = proposal.confidences * 0.5
        assert proposal.host_confidences is None
