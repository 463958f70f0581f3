"""Batch-1 decoding through the compiled static-shape core (dspark.decoding.static_core, mode "compiled":
inductor on CPU here, CUDA graphs on a GPU): lossless at temperature 1 through the real decoder (χ² of the
first tokens' joint against the exact target joint, chain with a load-aware verify length and tree), the
Appendix A power check (a peeking verify length must be caught by the same test), and greedy output equal
to HF `generate` token for token (target-only, chain and tree), the drafter's passes captured as well. The same through the continuous-batching
engine on the core's compiled slots (`EngineConfig.decode_core`): χ² of the first tokens' joints with chains
and with trees, greedy == HF `generate` with requests joining and leaving, and a seeded request's tokens the
same alone and batched with others."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark.decoding.engine import Engine, EngineConfig
from dspark.decoding.sampling import SamplingParams, to_probs
from dspark.decoding.scheduler import PrefixScheduler, SchedulerConfig, SPSTable
from dspark.decoding.specdec import speculative_generate, target_generate
from dspark.decoding.tree_specdec import tree_speculative_generate
from dspark.drafters import DrafterConfig, build_drafter
from tests.lossless_stats import chi2_pvalue, engine_three_token_pvalues, exact_joint
from tests.tiny_models import build_tiny_model

pytestmark = pytest.mark.heavy  # `make test` runs these; `make test-fast` skips them (README, Testing)

VOCAB, PROMPT, N_TOKENS, GAMMA, RUNS, TREE_RUNS = 6, [1, 5, 2, 4, 3], 3, 3, 3000, 2000
SP = SamplingParams(temperature=1.0)
COMPILED = "compiled"


@pytest.fixture(scope="module")
def micro_target():
    return build_tiny_model(vocab_size=VOCAB, seed=0, num_layers=3, hidden_size=32, init_std=0.3)


def _drafter(target, algo="dspark", gamma=GAMMA):
    torch.manual_seed(0)
    cfg = DrafterConfig(algo=algo, block_size=gamma, num_layers=1, num_context_layers=2, rank=8, init_std=0.2)
    return build_drafter(cfg, target).eval()


def _chain_pvalue(target, drafter, verify_len, runs: int = RUNS) -> float:
    gen, counts = torch.Generator().manual_seed(3), np.zeros([VOCAB] * N_TOKENS)
    for _ in range(runs):
        out = speculative_generate(target, drafter, PROMPT, SP, N_TOKENS, stop_ids=[], verify_len=verify_len,
                                   generator=gen, core_mode=COMPILED)
        counts[tuple(out.token_ids)] += 1
    return chi2_pvalue(counts, exact_joint(target, PROMPT, N_TOKENS, SP, VOCAB))


def test_compiled_chain_decoding_is_lossless(micro_target):
    sps = SPSTable({1: 100.0, 2: 95.0, 4: 80.0, 8: 50.0})
    verify_len = PrefixScheduler(SchedulerConfig(mode="dynamic"), sps).verify_len_hook()
    p = _chain_pvalue(micro_target, _drafter(micro_target), verify_len, runs=2000)
    print(f"\n[lossless] compiled chain (dynamic verify length): chi2 p-value = {p:.4g} over 2000 runs")
    assert p > 1e-3


def test_compiled_path_catches_a_peeking_verify_len(micro_target):
    """Appendix A's point through the compiled path: verifying draft 1 only when it is the target's favourite
    token biases the output, and the same χ² test sees it."""
    favoured = int(to_probs(micro_target.forward(torch.tensor([PROMPT + [0]])).logits[0, -1], SP).argmax())
    p = _chain_pvalue(micro_target, _drafter(micro_target, "dflash"),
                      lambda _round_idx, proposal: 1 if int(proposal.tokens[0]) == favoured else 0)
    print(f"\n[lossless] compiled chain, peeking verify length (must be biased): chi2 p-value = {p:.4g}")
    assert p < 1e-6


def test_compiled_tree_decoding_is_lossless(micro_target):
    drafter, gen = _drafter(micro_target), torch.Generator().manual_seed(7)
    counts = np.zeros([VOCAB] * N_TOKENS)
    for _ in range(TREE_RUNS):
        out = tree_speculative_generate(micro_target, drafter, PROMPT, SP, N_TOKENS, (2, 2), stop_ids=[],
                                        generator=gen, core_mode=COMPILED)
        counts[tuple(out.token_ids)] += 1
    p = chi2_pvalue(counts, exact_joint(micro_target, PROMPT, N_TOKENS, SP, VOCAB))
    print(f"\n[lossless] compiled tree (2, 2): chi2 p-value = {p:.4g} over {TREE_RUNS} runs")
    assert p > 1e-3


def test_compiled_greedy_equals_hf_generate(micro_target):
    greedy, drafter = SamplingParams(temperature=0), _drafter(micro_target)
    hf = micro_target.model.generate(torch.tensor([PROMPT]), max_new_tokens=30, min_new_tokens=30, do_sample=False)
    reference = hf[0, len(PROMPT):].tolist()
    assert target_generate(micro_target, PROMPT, greedy, 30, stop_ids=[], core_mode=COMPILED).token_ids == reference
    chain = speculative_generate(micro_target, drafter, PROMPT, greedy, 30, stop_ids=[], core_mode=COMPILED)
    tree = tree_speculative_generate(micro_target, drafter, PROMPT, greedy, 30, (2,), stop_ids=[],
                                     core_mode=COMPILED)
    assert chain.token_ids == reference and tree.token_ids == reference
    # the drafter's passes ran captured too (block_capture, chain_capture), not their eager fallbacks
    assert not drafter.__dict__.get("_block_capture_failed") and not drafter.__dict__.get("_chain_capture_failed")


# ---- the continuous-batching engine on the compiled core (few rows: each (rows, width) bucket compiles once) ----
ENGINE_RUNS, ENGINE_ROWS = 1200, 2


def _compiled_engine(target, drafter, mode="dynamic", **kw) -> Engine:
    kw.setdefault("sps_table", {1: 100.0, 8: 90.0, 32: 60.0})
    engine = Engine(target, drafter, EngineConfig(scheduler=SchedulerConfig(mode=mode), decode_core=COMPILED,
                                                  max_batch=ENGINE_ROWS, **kw))
    assert engine.kv.core.mode == COMPILED
    return engine


@pytest.fixture
def drafter_passes(monkeypatch):
    """The drafter's captured passes traced with aot_eager (the graphs inductor would compile; the batch-1 tests
    above build them with inductor), and the number of requests each backbone pass drafted."""
    from dspark.drafters import block_capture, chain_capture

    monkeypatch.setattr(chain_capture, "BACKEND", "aot_eager")
    rows, hidden = [], block_capture.hidden
    monkeypatch.setattr(block_capture, "hidden", lambda d, states, a: rows.append(len(states)) or hidden(d, states, a))
    return rows


@pytest.mark.parametrize("tree", [None, [2, 2]])
def test_compiled_engine_is_lossless(micro_target, tree, drafter_passes):
    """Requests joining and leaving the compiled slots (1 or 2 rows, verify widths padded to powers of two;
    with a tree, every step verifies trees; the drafter's passes captured over its slot store, both
    requests at once): the joints of tokens 1-2 and 2-3 match target-only sampling."""
    engine = _compiled_engine(micro_target, _drafter(micro_target), max_waiting=ENGINE_RUNS, draft_tree=tree,
                              tree_max_rows=ENGINE_ROWS)
    p12, p23, totals = engine_three_token_pvalues(engine, micro_target, PROMPT, SP, VOCAB, ENGINE_RUNS)
    assert 2 in drafter_passes  # two requests drafted by one captured pass
    print(f"\n[lossless] compiled engine, tree {tree}: p(t1,t2)={p12:.3g} p(t2,t3)={p23:.3g} "
          f"accepted {totals['accepted']}/{totals['verified']}")
    assert 0 < totals["accepted"] < totals["verified"]
    assert p12 > 1e-3 and p23 > 1e-3


def test_compiled_engine_greedy_equals_hf_generate_and_seeds_are_batch_invariant(micro_target, drafter_passes):
    """Greedy: every request of a batch (joining and leaving) gets HF `generate`'s tokens. Temperature 1:
    a seeded request gets the same tokens alone and among other requests (keyed randomness)."""
    greedy, drafter = SamplingParams(temperature=0), _drafter(micro_target)
    prompts = [PROMPT, [2, 3], [4] * 9, [1, 2, 3, 4], [5, 1]]
    engine = _compiled_engine(micro_target, drafter)
    for prompt, req in zip(prompts, engine.generate(prompts, greedy, max_new_tokens=12, stop_ids=[])):
        hf = micro_target.model.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12,
                                         do_sample=False)
        assert req.tokens == hf[0, len(prompt):].tolist()
    (alone,) = [r.tokens for r in engine.generate([PROMPT], SP, max_new_tokens=12, stop_ids=[], seeds=[77])]
    others = prompts[1:]
    batched = engine.generate(others[:2] + [PROMPT] + others[2:], SP, max_new_tokens=12, stop_ids=[],
                              seeds=[None, None, 77, None, None])
    assert batched[2].tokens == alone
