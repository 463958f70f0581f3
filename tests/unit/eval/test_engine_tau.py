"""τ batched through the engine (dspark.eval.engine_tau): under greedy decoding each prompt's rounds and
acceptances are those of batch-1 speculative decoding, so the batched τ equals the batch-1 one; the bootstrap
interval brackets it; prompts that cannot fit are skipped and counted."""
from __future__ import annotations

import torch

from dspark.decoding.specdec import speculative_generate
from dspark.drafters import DrafterConfig, build_drafter
from dspark.eval.benchmark_files import Benchmark
from dspark.eval.engine_tau import bootstrap_ci95, engine_tau
from dspark.eval.evaluate import DecodeSettings
from dspark.models.target import load_target


def test_engine_tau_equals_batch1_tau_under_greedy_and_skips_what_does_not_fit():
    target = load_target("tiny", dtype=torch.float32)
    torch.manual_seed(0)
    drafter = build_drafter(DrafterConfig(algo="dspark", block_size=3, num_layers=1, num_context_layers=2, rank=8),
                            target).eval()
    benches = [Benchmark("a", "math", "mem", [["what is two plus two"], ["count to five"], ["name a colour"]]),
               Benchmark("b", "chat", "mem", [["say hello"], ["a short poem"], ["the a of " * 800]])]
    settings = DecodeSettings(greedy=True, max_new_tokens=12, gamma=3)
    out = engine_tau(target, drafter, benches, settings, seed=0, max_batch=4, resamples=200)
    assert out["prompts"] == 5 and out["skipped"] == 1  # the ~2,400-token prompt does not fit with 12 new tokens
    for bench in benches:
        pairs = []
        for turns in bench.prompts[:3]:
            ids = target.chat_ids([{"role": "user", "content": turns[0]}])
            if len(ids) > 2000:
                continue
            res = speculative_generate(target, drafter, ids, settings.sampling(), 12, stop_ids=None, gamma=3)
            pairs.append((sum(r.accepted + 1 for r in res.rounds), len(res.rounds)))
        assert abs(out["tau"][bench.name] - sum(a for a, _ in pairs) / sum(r for _, r in pairs)) < 1e-9
    lo, hi = out["tau_ci95"]
    assert lo <= out["tau_mean"] <= hi and 1.0 <= lo


def test_bootstrap_needs_two_prompts_per_benchmark():
    assert bootstrap_ci95({"a": [(3, 2)], "b": [(4, 2), (2, 2)]}, 100, 0) is None
    lo, hi = bootstrap_ci95({"a": [(3, 2), (5, 2), (2, 2)]}, 500, 0)
    assert 1.0 <= lo <= 5 / 3 <= hi <= 2.5
