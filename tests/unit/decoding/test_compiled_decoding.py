"""Batch-1 decoding through the compiled static-shape core (dspark.decoding.static_core, mode "compiled":
inductor on CPU here, CUDA graphs on a GPU): lossless at temperature 1 through the real decoder (χ² of the
first tokens' joint against the exact target joint, chain with a load-aware verify length and tree), the
Appendix A power check (a peeking verify length must be caught by the same test), and greedy output equal
to HF `generate` token for token (target-only, chain and tree)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark.decoding.sampling import SamplingParams, to_probs
from dspark.decoding.scheduler import PrefixScheduler, SchedulerConfig, SPSTable
from dspark.decoding.specdec import speculative_generate, target_generate
from dspark.decoding.tree_specdec import tree_speculative_generate
from dspark.drafters import DrafterConfig, build_drafter
from dspark.models.target import build_tiny_model
from tests.lossless_stats import chi2_pvalue, exact_joint

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


def _chain_pvalue(target, drafter, verify_len) -> float:
    gen, counts = torch.Generator().manual_seed(3), np.zeros([VOCAB] * N_TOKENS)
    for _ in range(RUNS):
        out = speculative_generate(target, drafter, PROMPT, SP, N_TOKENS, stop_ids=[], verify_len=verify_len,
                                   generator=gen, core_mode=COMPILED)
        counts[tuple(out.token_ids)] += 1
    return chi2_pvalue(counts, exact_joint(target, PROMPT, N_TOKENS, SP, VOCAB))


def test_compiled_chain_decoding_is_lossless(micro_target):
    sps = SPSTable({1: 100.0, 2: 95.0, 4: 80.0, 8: 50.0})
    verify_len = PrefixScheduler(SchedulerConfig(mode="dynamic"), sps).verify_len_hook()
    p = _chain_pvalue(micro_target, _drafter(micro_target), verify_len)
    print(f"\n[lossless] compiled chain (dynamic verify length): chi2 p-value = {p:.4g} over {RUNS} runs")
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
