"""Draft trees in the continuous-batching engine (EngineConfig.draft_tree): a tree row of a ragged forward
scores every node on its own path, the accepted path's KV columns move behind the prefix, the engine stays
lossless at temperature 1 with trees and chains mixed in one batch (χ² against the exact target joint), greedy
output and logprobs equal target-only decoding, and a keyed seeded request is the same with trees as without."""
from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

from dspark.decoding.batched_cache import KVSlots, enable_ragged, ragged_forward
from dspark.decoding.engine import Engine, EngineConfig
from dspark.decoding.sampling import SamplingParams
from dspark.decoding.scheduler import SchedulerConfig
from dspark.decoding.specdec import target_generate
from dspark.drafters import DrafterConfig, build_drafter
from tests.lossless_stats import engine_three_token_pvalues

VOCAB, PROMPT, GAMMA = 8, [1, 5, 2, 7, 3], 3
GREEDY = SamplingParams(temperature=0.0)


def _drafter(target, algo="dspark", draft_ids=None):
    torch.manual_seed(0)
    cfg = DrafterConfig(algo=algo, block_size=GAMMA, num_layers=1, num_context_layers=2, rank=8, init_std=0.2,
                        draft_vocab_size=None if draft_ids is None else len(draft_ids))
    return build_drafter(cfg, target, draft_ids=None if draft_ids is None else torch.tensor(draft_ids)).eval()


def _engine(target, drafter, tree, mode="fixed", **kw):
    return Engine(target, drafter, EngineConfig(scheduler=SchedulerConfig(mode=mode), draft_tree=tree,
                                                sps_table={1: 100.0, 128: 60.0, 512: 25.0}, **kw))


def _last_logits(target, ids):
    return target.forward(torch.tensor(ids)[None], logits_at="all").logits[0, -1]


def test_a_tree_row_scores_every_node_on_its_path_and_keeps_the_accepted_one(wide_target):
    """One ragged forward holds a chain row and a tree row (anchor 9 with children 4 and 6, 6 with child 2):
    each token's logits equal a plain forward over its prefix and path; after `keep_columns` keeps
    [anchor, 6, 2], the next token's logits equal a plain forward over prefix + 9 6 2 + next."""
    target = wide_target
    enable_ragged(target.model)
    store = KVSlots("cpu", torch.float32)
    chain_prefix, tree_prefix = [3, 1, 4], [2, 7, 1, 8, 2]
    for prefix in (chain_prefix, tree_prefix):
        store.allocate()
    ragged_forward(target, store, 0, torch.tensor([chain_prefix + tree_prefix]), [3, 5], "last")
    store.set_length(0, 3), store.set_length(1, 5)
    tree_ids, tree_parents = [9, 4, 6, 2], [-1, 0, 0, 2]
    outs = ragged_forward(target, store, 0, torch.tensor([[5, 9] + tree_ids]), [2, 4], "all",
                          parents=[None, tree_parents])
    torch.testing.assert_close(outs[0][0][1], _last_logits(target, chain_prefix + [5, 9]), atol=1e-4, rtol=1e-4)
    paths = [[9], [9, 4], [9, 6], [9, 6, 2]]
    for i, path in enumerate(paths):
        torch.testing.assert_close(outs[1][0][i], _last_logits(target, tree_prefix + path), atol=1e-4, rtol=1e-4)
    store.keep_columns(1, 5, [5, 7, 8])
    assert store.lengths[1] == 8
    (logits, _), = ragged_forward(target, store, 1, torch.tensor([[3]]), [1], "all")
    torch.testing.assert_close(logits[0], _last_logits(target, tree_prefix + [9, 6, 2, 3]), atol=1e-4, rtol=1e-4)


@pytest.mark.heavy
@pytest.mark.parametrize("tree,draft_ids", [([3], None), ([2, 2], [0, 1, 3, 4, 6])])
def test_engine_with_trees_is_lossless_at_temperature_one(micro_target, tree, draft_ids):
    """3000 concurrent requests (joining and leaving between steps; steps alternate between trees and the
    dynamic scheduler's chains, so requests switch mid-stream): the joint of tokens 1-2 and 2-3 matches
    target-only sampling."""
    runs, sp = 3000, SamplingParams(temperature=1.0)
    engine = _engine(micro_target, _drafter(micro_target, draft_ids=draft_ids), tree, mode="dynamic",
                     max_batch=64, max_waiting=runs)
    kinds = collections.Counter()

    def alternate(rep):
        kinds.update(["tree" if rep.proposed > rep.rows * GAMMA else "chain"])
        engine.cfg.tree_max_rows = 1 if engine.cfg.tree_max_rows > 1 else 64

    engine.step_listeners.append(alternate)
    p12, p23, totals = engine_three_token_pvalues(engine, micro_target, PROMPT, sp, VOCAB, runs)
    print(f"\n[engine trees lossless] {tree}: p(t1,t2)={p12:.3g} p(t2,t3)={p23:.3g} steps {dict(kinds)} "
          f"accepted {totals['accepted']}/{totals['verified']}")
    assert kinds["tree"] > 0 and kinds["chain"] > 0
    assert 0 < totals["accepted"] < totals["verified"]
    assert p12 > 1e-3 and p23 > 1e-3


def test_greedy_trees_give_the_target_output_and_logprobs(wide_target):
    prompts = [[3, 1, 4, 1, 5], [9] * 11, [2, 7], [5, 6, 7, 8]]
    engine = _engine(wide_target, _drafter(wide_target), [4, 2], tree_max_rows=2, max_batch=4)
    reqs = engine.generate(prompts, GREEDY, max_new_tokens=20, stop_ids=[], logprobs=2)
    plain = _engine(wide_target, None, None, mode="off").generate(prompts, GREEDY, max_new_tokens=20, stop_ids=[],
                                                                   logprobs=2)
    for prompt, req, ref in zip(prompts, reqs, plain):
        assert req.tokens == target_generate(wide_target, prompt, GREEDY, 20, stop_ids=[]).token_ids
        assert [t.token for t in req.token_logprobs] == req.tokens
        np.testing.assert_allclose([t.logprob for t in req.token_logprobs], [t.logprob for t in ref.token_logprobs],
                                   atol=1e-4)
    assert engine.stats()["totals"]["proposed"] > engine.stats()["totals"]["verified"]  # trees were verified


def test_a_keyed_seeded_request_is_the_same_with_trees(wide_target):
    """Keyed sampling: the output is the target's keyed sample whatever is drafted, so a tree, a chain and
    no drafter give the same tokens; the first child of each node is coupled with it (drafts accepted)."""
    sp, prompt = SamplingParams(temperature=1.0), [3, 1, 4, 1, 5]
    outs = {}
    for name, tree, drafter in (("off", None, None), ("chain", None, _drafter(wide_target)),
                                ("tree", [4], _drafter(wide_target))):
        engine = _engine(wide_target, drafter, tree, mode="off" if drafter is None else "fixed", seed=None)
        outs[name] = engine.generate([prompt, [7, 8]], sp, max_new_tokens=24, stop_ids=[], seeds=[1234, None])[0]
    assert outs["tree"].tokens == outs["chain"].tokens == outs["off"].tokens
    assert outs["tree"].stats.accepted > 0


class _RecordingGate:
    """Drafts every step; records what it is told."""

    exploring = False

    def __init__(self):
        self.observed = []

    def should_draft(self, n_active: int) -> bool:
        return True

    def observe(self, n_requests, draft_s, verified, accepted, expected=None) -> None:
        self.observed.append((n_requests, verified, accepted, expected))

    def observe_verify(self, *args) -> None:
        pass


def test_tree_steps_have_a_draft_gate_of_their_own(wide_target):
    """With the draft gate on, tree steps ask and teach `tree_gate` (verified = the tree's nodes, the
    verify cost; expected = the walk's expected path length), chain steps the chain gate. With a hopeless
    drafter (drafting costs about a target step here, and it accepts ~0.1 per round), the real tree gate
    closes, and the output stays the target's."""
    steep = {1: 1 / 0.011, 128: 1 / 0.138}  # 10 ms a step + 1 ms a token
    engine = Engine(wide_target, _drafter(wide_target), EngineConfig(
        scheduler=SchedulerConfig(mode="dynamic", draft_gate=True), draft_tree=[4], sps_table=steep,
        tree_max_rows=1, max_batch=4))
    assert engine.tree_gate is not None and engine.tree_gate is not engine.gate
    engine.gate, engine.tree_gate = chain_gate, tree_gate = _RecordingGate(), _RecordingGate()
    for prompt, n in (([3, 1, 4], 4), ([1, 5], 16)):  # two requests (chain steps), then one (tree steps)
        engine.submit(prompt, GREEDY, n, stop_ids=[])
    while engine.has_work():
        engine.step()
    assert tree_gate.observed and chain_gate.observed
    # greedy: the walk is deterministic, so the expected path length is the accepted one
    assert all(n == 1 and verified == 12 and expected == accepted for n, verified, accepted, expected in tree_gate.observed)
    assert all(verified <= n * GAMMA for n, verified, _, _ in chain_gate.observed)

    engine = Engine(wide_target, _drafter(wide_target), EngineConfig(  # an SPS table profiled on this machine
        scheduler=SchedulerConfig(mode="dynamic", draft_gate=True), draft_tree=[4], sps_batch_sizes=[1, 4, 16, 64],
        max_batch=1))
    prompt = [2, 7, 1, 8]
    (req,) = engine.generate([prompt], GREEDY, max_new_tokens=48, stop_ids=[])
    assert req.tokens == target_generate(wide_target, prompt, GREEDY, 48, stop_ids=[]).token_ids
    stats = engine.stats()
    assert stats["totals"]["draft_skipped_steps"] > 0 and stats["tree_draft_gate"]["verified_per_req"] == 12


def test_trees_need_a_tree_drafter_and_a_fitting_branching(wide_target):
    with pytest.raises(ValueError, match="grows draft trees"):
        _engine(wide_target, _drafter(wide_target, "dflash"), [2])
    with pytest.raises(ValueError, match="at most γ"):
        _engine(wide_target, _drafter(wide_target), [2, 2, 2, 2])
    for bad in ([0], []):  # refused by the config itself (pydantic's ValidationError is a ValueError)
        with pytest.raises(ValueError, match="draft_tree"):
            EngineConfig(draft_tree=bad)
