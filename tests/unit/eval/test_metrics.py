"""τ, position-wise conditional acceptance and prefix survival: hand-made rounds and a real run."""
import pytest
import torch

from dspark.drafters import DrafterConfig, build_drafter
from dspark.eval.metrics import markdown_table, merge_summaries, position_rows, summarize, summarize_results
from dspark.decoding.sampling import SamplingParams
from dspark.decoding.specdec import GenerationResult, RoundStats, speculative_generate
from tests.tiny_models import build_tiny_model


def _round(accepted: int, verified: int = 3, proposed: int = 3) -> RoundStats:
    outcomes = [True] * accepted + [False] * (accepted < verified)
    return RoundStats(proposed, verified, accepted, outcomes, None, emitted=accepted + 1)


HAND = [_round(0), _round(3), _round(1), _round(2), _round(1, verified=1), _round(0, verified=0)]


def test_summary_on_hand_rounds():
    s = summarize(HAND)
    assert s["rounds"] == 6
    assert s["tau"] == pytest.approx((1 + 4 + 2 + 3 + 2 + 1) / 6)
    assert s["tau_emitted"] == pytest.approx(s["tau"])  # nothing truncated
    assert s["mean_proposal_len"] == 3 and s["mean_verified"] == pytest.approx(13 / 6)
    # k=1: rounds verifying ≥1: accepted 0,3,1,2,1 -> 4/5
    # k=2: verified ≥2 and accepted ≥1: 3,1,2 -> 2/3 ; k=3: verified ≥3 and accepted ≥2: 3,2 -> 1/2
    assert s["cond_accept"] == {1: pytest.approx(0.8), 2: pytest.approx(2 / 3), 3: pytest.approx(0.5)}
    assert s["cond_accept_n"] == {1: 5, 2: 3, 3: 2}
    # survival over all rounds: P[acc ≥ 1] = 4/6, P[acc ≥ 2] = 2/6, P[acc ≥ 3] = 1/6
    assert s["prefix_survival"] == {1: pytest.approx(4 / 6), 2: pytest.approx(2 / 6), 3: pytest.approx(1 / 6)}
    assert summarize([])["tau"] is None


def test_merge_equals_pooling():
    a, b = HAND[:2], HAND[2:]
    merged = merge_summaries([summarize(a, wall_s=1.0, n_tokens=5), summarize(b, wall_s=3.0, n_tokens=9)])
    pooled = summarize(HAND)
    for key in ("rounds", "tau", "mean_verified"):
        assert merged[key] == pytest.approx(pooled[key])
    for key in ("cond_accept", "prefix_survival", "cond_accept_n"):
        assert merged[key] == {k: pytest.approx(v) for k, v in pooled[key].items()}
    assert merged["tokens_per_s"] == pytest.approx(14 / 4.0)
    res = [GenerationResult([1] * 5, a, "length", 1.0), GenerationResult([1] * 9, b, "stop", 3.0)]
    by_result = summarize_results(res)
    assert by_result["tau"] == pytest.approx(pooled["tau"]) and by_result["prompts"] == 2
    assert by_result["tokens_per_s"] == pytest.approx(3.5)


def test_markdown_helpers():
    rows = position_rows({"dspark": summarize(HAND), "none": summarize([])})
    table = markdown_table(rows)
    lines = table.splitlines()
    assert lines[0] == "| name | k=1 | k=2 | k=3 |" and lines[1] == "|---|---|---|---|"
    assert lines[2] == "| dspark | 0.800 | 0.667 | 0.500 |" and lines[3] == "| none | – | – | – |"
    assert markdown_table([]) == ""


def test_tau_of_a_real_run():
    target = build_tiny_model(vocab_size=32, seed=2, num_layers=3, hidden_size=32, init_std=0.3)
    gamma = 5
    drafter = build_drafter(DrafterConfig(algo="dspark", block_size=gamma, num_layers=1, num_context_layers=2,
                                          rank=8), target)
    out = speculative_generate(target, drafter, [1, 2, 3, 4], SamplingParams(), 60, stop_ids=[],
                               generator=torch.Generator().manual_seed(0))
    s = summarize_results([out])
    assert 1 <= s["tau"] <= gamma + 1
    assert s["tau"] == pytest.approx(sum(r.accepted + 1 for r in out.rounds) / len(out.rounds))
    emitted = len(out.token_ids) - 1  # the first token comes from the prefill, not from a round
    assert s["tau_emitted"] * s["rounds"] == pytest.approx(emitted)
    if out.rounds[-1].emitted == out.rounds[-1].accepted + 1:  # last round not truncated
        assert s["tau"] == pytest.approx(emitted / len(out.rounds))
    else:
        assert s["tau"] > emitted / len(out.rounds)
    assert all(v is None or 0 <= v <= 1 for v in s["cond_accept"].values())
    survival = [s["prefix_survival"][k] for k in range(1, gamma + 1)]
    assert survival == sorted(survival, reverse=True)
