"""Speculative decoding on a micro target: lossless at temperature 1 (χ² against the exact target
joint), exact at temperature 0, state/cache invariants, stop handling, and a learning signal.

Lossless tests draw 4k runs each (the power check below, the Appendix A bias, gives p ~ 1e-12 at 4k:
measured 7.8e-12 at 3k and 1.6e-12 at 4k), too many for a full decode each on two shared cores. `_Replay`
re-runs speculative_generate's control flow (prefill sample, propose, verify_len, accept_drafts,
context/anchor update) for the first tokens with the real `sample`, `accept_drafts` and verify_len
code, but looks distributions up instead of recomputing them: target rows from one batched forward
over every continuation, drafter rows from a "proposal tree" built once per (context, anchor) by
calling the real `drafter.propose` with its token choices forced along every draft prefix.
Two checks tie the replay to the real path before the χ² test: with real `propose` calls it
reproduces `speculative_generate` token for token under the same seeds, and every row of real
proposals equals the tree row for its prefix.
"""
from __future__ import annotations

import copy
import functools
import itertools
import sys

import numpy as np
import pytest
import torch

import dspark.decoding.sampling
from dspark.drafters import DraftProposal, DrafterConfig, build_drafter
from dspark.drafters.base import BlockDraws
from dspark.eval.metrics import summarize_results
from dspark.decoding.sampling import SamplingParams, accept_drafts, sample, to_probs
from dspark.decoding.scheduler import PrefixScheduler, SchedulerConfig, SPSTable
from dspark.decoding.specdec import drafter_layer_ids, speculative_generate, target_generate
from tests.lossless_stats import chi2_pvalue, exact_joint
from tests.tiny_models import build_tiny_model

VOCAB, PROMPT, N_TOKENS, RUNS, GAMMA = 6, [1, 5, 2, 4, 3], 3, 4000, 3
ALGOS = ["dspark", "dflash", "eagle3"]


def fixed_verify_len(n: int):
    """verify_len hook that always verifies min(n, proposed) drafts."""
    return lambda _round_idx, proposal: min(n, int(proposal.tokens.shape[0]))


@pytest.fixture(scope="module")
def micro_target():
    return build_tiny_model(vocab_size=VOCAB, seed=0, num_layers=3, hidden_size=32, init_std=0.3)


def _drafter(algo: str, target, gamma: int = GAMMA, seed: int = 0, draft_ids: list[int] | None = None):
    torch.manual_seed(seed)
    cfg = DrafterConfig(algo=algo, block_size=gamma, num_layers=1, num_context_layers=2, rank=8, init_std=0.2,
                        draft_vocab_size=None if draft_ids is None else len(draft_ids))
    return build_drafter(cfg, target, draft_ids=None if draft_ids is None else torch.tensor(draft_ids))


# ---- replay of speculative_generate with looked-up distributions ------------------------------------
class _ForcedSampling:
    """Context manager: `sample` inside the drafter modules and a block's position draws (`BlockDraws.draw`)
    return the given tokens in order."""

    def __init__(self, monkeypatch, tokens: list[int]):
        self.tokens, self.mp = list(tokens), monkeypatch

    def _forced(self, probs, generator=None):
        n = int(np.prod(probs.shape[:-1]))
        out, self.tokens = self.tokens[:n], self.tokens[n:]
        return torch.tensor(out, dtype=torch.long).reshape(probs.shape[:-1])

    modules: list = []  # the drafter modules that call `sample`, found once (scanning sys.modules is slow)

    def __enter__(self):
        if not _ForcedSampling.modules:
            _ForcedSampling.modules = [m for name, m in list(sys.modules.items()) if name.startswith("dspark.drafters")
                                       and getattr(m, "sample", None) is dspark.decoding.sampling.sample]
        assert _ForcedSampling.modules, "no drafter module uses dspark.decoding.sampling.sample; update _ForcedSampling"
        for m in _ForcedSampling.modules:
            self.mp.setattr(m, "sample", self._forced)
        self.mp.setattr(BlockDraws, "draw", lambda draws, probs, k: (slice(None), self._forced(probs)))
        return self

    def __exit__(self, *exc):
        self.mp.undo()


@functools.lru_cache(maxsize=4)
def _all_target_rows(target, prompt: tuple, sp_json: str, depth: int) -> torch.Tensor:
    """Target next-token probs along every continuation of `depth` tokens (depth = the longest verify
    pass: n_tokens - 1 generated tokens + γ drafts), computed once per target and sampling setting."""
    sp = SamplingParams.model_validate_json(sp_json)
    seqs = torch.tensor([list(prompt) + list(s) for s in itertools.product(range(VOCAB), repeat=depth)])
    probs = torch.cat([to_probs(target.forward(chunk, logits_at="all").logits, sp) for chunk in seqs.split(4096)])
    return probs.reshape([VOCAB] * depth + [len(prompt) + depth, VOCAB])


class _Replay:
    """speculative_generate's control flow and random-draw order for the first `n_tokens` tokens."""

    def __init__(self, target, drafter, prompt, sp, gamma, verify_len, n_tokens, monkeypatch):
        self.target, self.drafter, self.prompt, self.sp, self.gamma = target, drafter, prompt, sp, gamma
        self.verify_len, self.n_tokens, self.layer_ids = verify_len, n_tokens, drafter_layer_ids(drafter)
        self.mp = monkeypatch
        self.rows = _all_target_rows(target, tuple(prompt), sp.model_dump_json(), n_tokens - 1 + gamma)
        self.states: dict[tuple, object] = {}
        self.trees: dict[tuple, dict] = {}
        self.lengths: list[int] = []  # verify lengths chosen by the hook

    def target_rows(self, seq: list[int], start: int) -> torch.Tensor:
        """Target next-token probs after seq[:start+1], ..., seq[:len(seq)] (one row each)."""
        gen = seq[len(self.prompt):]
        index = tuple(gen) + (0,) * (self.rows.dim() - 2 - len(gen))
        return self.rows[index][start: len(seq)]

    def state(self, context: list[int]):
        """Drafter state holding `context`, extended incrementally like speculative_generate does."""
        key = tuple(context)
        if key not in self.states:
            feats = self.target.forward(torch.tensor([context]), layer_ids=self.layer_ids, logits_at=None).features[0]
            parent = max((k for k in self.states if key[: len(k)] == k), key=len, default=None)
            st = copy.deepcopy(self.states[parent]) if parent else self.drafter.new_state()
            start = len(parent) if parent else 0
            self.drafter.extend_context(st, feats[start:], torch.tensor(context[start:]))
            self.states[key] = st
        return self.states[key]

    def tree(self, context: list[int], anchor: int) -> dict:
        """{drafted prefix: (probs row, confidence)} from real propose calls forced along every prefix."""
        key = (tuple(context), anchor)
        if key not in self.trees:
            tree, state = {}, self.state(context)
            # `sample` draws draft-vocabulary indices; the tree is keyed by the target ids they stand for
            ids = self.drafter.to_target_ids(torch.arange(self.drafter.draft_vocab_size)).tolist()
            for path in itertools.product(range(len(ids)), repeat=self.gamma - 1):
                with _ForcedSampling(self.mp, list(path) + [0]):
                    prop = self.drafter.propose(state, anchor, self.gamma, self.sp, None)
                for k in range(self.gamma):
                    conf = None if prop.confidences is None else prop.confidences[k]
                    tree[tuple(ids[i] for i in path[:k])] = (prop.probs[k], conf)
            self.trees[key] = tree
        return self.trees[key]

    def tree_proposal(self, context, anchor, generator) -> DraftProposal:
        """A proposal drawn from the tree: x_k ~ p_k(· | x_<k) with the real `sample`, left to right."""
        tree, tokens, probs, conf = self.tree(context, anchor), [], [], []
        for _ in range(self.gamma):
            row, c = tree[tuple(tokens)]
            tokens.append(int(sample(row, generator)))
            probs.append(row)
            conf.append(c)
        return DraftProposal(torch.tensor(tokens), torch.stack(probs),
                             None if conf[0] is None else torch.stack(conf))

    def run(self, generator: torch.Generator, real_propose: bool = False) -> list[int]:
        context = list(self.prompt)
        anchor = int(sample(self.target_rows(context, len(context) - 1)[0], generator))
        tokens, round_idx = [anchor], 0
        while len(tokens) < self.n_tokens:
            if real_propose:
                proposal = self.drafter.propose(self.state(context), anchor, self.gamma, self.sp, generator)
            else:
                proposal = self.tree_proposal(context, anchor, generator)
            n = self.gamma if self.verify_len is None else int(self.verify_len(round_idx, proposal))
            self.lengths.append(n)
            drafts = proposal.tokens[:n].tolist()
            rows = self.target_rows(context + [anchor] + drafts, len(context))
            n_acc, nxt = accept_drafts(proposal.tokens[:n], proposal.probs[:n], rows, generator)
            tokens += drafts[:n_acc] + [nxt]
            context += [anchor] + drafts[:n_acc]
            anchor, round_idx = nxt, round_idx + 1
        return tokens[: self.n_tokens]


def _lossless_check(monkeypatch, target, drafter, verify_len, label, runs=RUNS, expect_lossless=True):
    sp = SamplingParams(temperature=1.0)
    replay = _Replay(target, drafter, PROMPT, sp, GAMMA, verify_len, N_TOKENS, monkeypatch)
    for seed in range(30):  # the replay is the real decoding path, draw for draw
        real = speculative_generate(target, drafter, PROMPT, sp, N_TOKENS, stop_ids=[], verify_len=verify_len,
                                    generator=torch.Generator().manual_seed(seed), gamma=GAMMA)
        assert replay.run(torch.Generator().manual_seed(seed), real_propose=True) == real.token_ids
    gen = torch.Generator().manual_seed(99)
    for anchor in range(VOCAB):  # tree rows are the rows real proposals are drawn from
        prop = drafter.propose(replay.state(PROMPT), anchor, GAMMA, sp, gen)
        tree = replay.tree(PROMPT, anchor)
        for k in range(GAMMA):
            assert torch.allclose(tree[tuple(prop.tokens[:k].tolist())][0], prop.probs[k], atol=1e-6)
    replay.lengths.clear()
    counts = np.zeros([VOCAB] * N_TOKENS)
    for _ in range(runs):
        counts[tuple(replay.run(gen))] += 1
    p = chi2_pvalue(counts, exact_joint(target, PROMPT, N_TOKENS, sp, VOCAB))
    lengths = np.bincount(replay.lengths, minlength=GAMMA + 1).tolist()
    print(f"\n[lossless] {label}: chi2 p-value = {p:.4g} over {runs} runs "
          f"(joint of the first {N_TOKENS} tokens; rounds by verify length {lengths})")
    if expect_lossless:
        assert p > 1e-3
    return p, lengths


@pytest.mark.heavy
@pytest.mark.parametrize("algo", ALGOS)
def test_lossless_full_verification(monkeypatch, micro_target, algo):
    _lossless_check(monkeypatch, micro_target, _drafter(algo, micro_target), None, f"{algo} γ={GAMMA}")


# dspark's variants run in every `make test`; the other algorithms' (same accept/verify code, their own
# propose paths, each already χ²-tested with full verification above) in `make test-slow`.
SLOW = pytest.mark.slow


@pytest.mark.parametrize("algo", ["dspark", pytest.param("dflash", marks=SLOW), pytest.param("eagle3", marks=SLOW)])
def test_lossless_with_a_draft_vocabulary(monkeypatch, micro_target, algo):
    """q lives on 4 of the 6 tokens (zero elsewhere): tokens 1 and 4 are never drafted, yet the target
    still emits them through the residual exactly as often as target-only sampling."""
    drafter = _drafter(algo, micro_target, draft_ids=[0, 2, 3, 5])
    _lossless_check(monkeypatch, micro_target, drafter, None, f"{algo} γ={GAMMA}, draft vocab 4/{VOCAB}")


@pytest.mark.heavy
def test_lossless_with_a_draft_temperature(monkeypatch, micro_target):
    """Drafts from a sharpened q (draft_temperature 0.5): acceptance compares p with that q, so the
    output is still the target's distribution."""
    drafter = _drafter("dspark", micro_target)
    drafter.draft_temperature = 0.5
    _lossless_check(monkeypatch, micro_target, drafter, None, f"dspark γ={GAMMA}, draft temperature 0.5")


@pytest.mark.parametrize("algo,hook", [("dspark", "dynamic"), pytest.param("dflash", "fixed1", marks=SLOW),
                                       pytest.param("eagle3", "fixed2", marks=SLOW)])
def test_lossless_partial_verification(monkeypatch, micro_target, algo, hook):
    """verify_len < γ: a fixed cut, or Algorithm 1 on DSpark's confidences (c_2 depends on x_1)."""
    if hook == "dynamic":
        sps = SPSTable({1: 100.0, 2: 85.0, 3: 75.0, 4: 68.0})  # verify lengths 0..3 all occur
        verify_len = PrefixScheduler(SchedulerConfig(mode="dynamic"), sps).verify_len_hook()
    else:
        verify_len = fixed_verify_len(int(hook[-1]))
    _, lengths = _lossless_check(monkeypatch, micro_target, _drafter(algo, micro_target), verify_len,
                                 f"{algo} γ={GAMMA} verify_len={hook}")
    if hook == "dynamic":
        assert sum(v > 0 for v in lengths) >= 3, lengths
    else:
        assert lengths[GAMMA] == 0, lengths


@pytest.mark.heavy
def test_anticipating_verify_len_is_detected(monkeypatch, micro_target):
    """Power check (Appendix A): verifying draft 1 only when it is the token the target likes most
    biases the output, and the same χ² test, with the same number of runs, must see it."""
    target = micro_target
    favoured = int(to_probs(target.forward(torch.tensor([PROMPT + [0]])).logits[0, -1], SamplingParams()).argmax())

    def peeking(_round_idx, proposal):
        return 1 if int(proposal.tokens[0]) == favoured else 0

    p, _ = _lossless_check(monkeypatch, target, _drafter("dflash", target), peeking,
                           "dflash with a peeking verify_len (must be biased)", expect_lossless=False)
    assert p < 1e-6


# ---- greedy, invariants, stops -------------------------------------------------------------------
@pytest.fixture(scope="module")
def wide_target():
    return build_tiny_model(vocab_size=64, seed=1, num_layers=3, hidden_size=32, init_std=0.3)


@pytest.mark.parametrize("algo", ALGOS)
def test_greedy_matches_target_only(wide_target, algo):
    greedy = SamplingParams(temperature=0)
    drafter = _drafter(algo, wide_target, gamma=4)
    for seed in range(2):
        prompt = torch.randint(0, 64, (3 + 4 * seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        reference = target_generate(wide_target, prompt, greedy, 40, stop_ids=[]).token_ids
        for verify_len in (None, fixed_verify_len(2)):
            out = speculative_generate(wide_target, drafter, prompt, greedy, 40, stop_ids=[], verify_len=verify_len)
            assert out.token_ids == reference
            assert len(out.token_ids) == 40 and out.finish_reason == "length"


def test_context_holds_verified_positions_before_the_anchor(wide_target):
    drafter = _drafter("dspark", wide_target, gamma=4)
    seen = []
    real_propose = drafter.propose

    def spy(state, anchor, gamma, sampling, generator=None):
        seen.append((state.length, anchor))
        return real_propose(state, anchor, gamma, sampling, generator)

    drafter.propose = spy
    prompt = [3, 9, 27, 17]
    out = speculative_generate(wide_target, drafter, prompt, SamplingParams(), 30, stop_ids=[],
                               generator=torch.Generator().manual_seed(0))
    produced = 1
    for (length, anchor), rnd in zip(seen, out.rounds):
        assert length == len(prompt) + produced - 1  # everything before the anchor, nothing after
        assert anchor == out.token_ids[produced - 1]
        produced += rnd.emitted
    assert len(seen) == len(out.rounds)


def test_round_stats_and_truncation(wide_target):
    drafter = _drafter("dspark", wide_target, gamma=4)
    sp = SamplingParams()
    out = speculative_generate(wide_target, drafter, [1, 2, 3], sp, 25, stop_ids=[],
                               generator=torch.Generator().manual_seed(0))
    assert len(out.token_ids) == 25 and out.finish_reason == "length"
    assert 1 + sum(r.emitted for r in out.rounds) == 25
    for r in out.rounds:
        assert r.proposed == 4 and r.verified == 4 and 0 <= r.accepted <= 4
        assert r.outcomes == [True] * r.accepted + [False] * (r.accepted < 4)
        assert r.confidences is not None and len(r.confidences) == 4
    assert all(r.emitted == r.accepted + 1 for r in out.rounds[:-1])
    # a stop token ends the output right after it
    stop = out.token_ids[7]
    cut = speculative_generate(wide_target, drafter, [1, 2, 3], sp, 25, stop_ids=[stop],
                               generator=torch.Generator().manual_seed(0))
    assert cut.finish_reason == "stop" and cut.token_ids == out.token_ids[: out.token_ids.index(stop) + 1]
    one = speculative_generate(wide_target, drafter, [1, 2, 3], sp, 1, stop_ids=[])
    assert len(one.token_ids) == 1 and one.rounds == []
    same = [speculative_generate(wide_target, drafter, [1, 2, 3], sp, 20, stop_ids=[],
                                 generator=torch.Generator().manual_seed(5)).token_ids for _ in range(2)]
    assert same[0] == same[1]
    base = target_generate(wide_target, [1, 2, 3], sp, 20, stop_ids=[], generator=torch.Generator().manual_seed(5))
    assert len(base.token_ids) == 20 and len(base.rounds) == 19


def test_bad_inputs_have_clear_errors(wide_target):
    drafter = _drafter("dflash", wide_target, gamma=4)
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        speculative_generate(wide_target, drafter, [], SamplingParams(), 5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        target_generate(wide_target, [1], SamplingParams(), 0)
    with pytest.raises(ValueError, match="verify_len returned"):
        speculative_generate(wide_target, drafter, [1, 2], SamplingParams(), 5, verify_len=lambda i, p: 9)


# ---- learning signal --------------------------------------------------------------------------------
def _tau(target, drafter, prompts, sp, max_new_tokens=40) -> float:
    results = [speculative_generate(target, drafter, p, sp, max_new_tokens, stop_ids=[],
                                    generator=torch.Generator().manual_seed(i)) for i, p in enumerate(prompts)]
    return summarize_results(results)["tau"]


@pytest.mark.heavy
@pytest.mark.parametrize("algo", ["dspark", pytest.param("dflash", marks=SLOW), pytest.param("eagle3", marks=SLOW)])
def test_training_raises_tau(wide_target, algo):
    """Overfitting a drafter on a few greedy target rollouts (dspark.training.loss.drafter_loss + AdamW) must
    raise the τ of real greedy speculative decoding on the same prompts well above the untrained τ
    (this also checks that training and inference agree on feature positions and labels)."""
    from dspark.training.loss import drafter_loss

    target, greedy = wide_target, SamplingParams(temperature=0)
    prompts = [[3, 14, 15, 9], [2, 6, 53, 5], [8, 9, 7, 9], [32, 38, 4, 6]]
    rollouts = [p + target_generate(target, p, greedy, 40, stop_ids=[]).token_ids for p in prompts]
    input_ids = torch.tensor(rollouts)
    loss_mask = torch.zeros_like(input_ids)
    loss_mask[:, len(prompts[0]):] = 1

    drafter = _drafter(algo, target, gamma=4)
    drafter.config.anchors_per_seq = 32
    untrained = _tau(target, drafter, prompts, greedy)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    drafter.train()
    for _ in range(150):
        out = drafter_loss(drafter, target, input_ids, loss_mask, None, gen)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    drafter.eval()
    trained = _tau(target, drafter, prompts, greedy)
    print(f"\n[learning] {algo}: greedy τ untrained {untrained:.2f} -> trained {trained:.2f} "
          f"(final loss {out.loss.item():.3f})")
    assert trained > untrained + 1.0 and trained > 2.5
