"""τ measured batched through the serving engine: every first-turn prompt of the benchmarks decoded by one
drafter in continuous batches (dspark.decoding.engine, scheduler `fixed`: every round verifies γ drafts, so τ is
the acceptance the drafter earns, not a scheduler's choice), with a prompt-bootstrap 95 % interval.

Why. Batch-1 evaluation (dspark.eval.evaluate) times every prompt alone, which is what a speedup needs but
costs a whole decode per prompt and mode; on a GPU budget it fitted 4 prompts. τ does not depend on the batch
(each request is batch-1 speculative decoding over its own KV slot), so here all prompts decode together and
40+ held-out prompts cost about one batched decode. Speedups stay with the batch-1 evaluation.

Estimator (as `evaluation.tau_ci95`): per benchmark τ_b = Σ_i (accepted_i + rounds_i) / Σ_i rounds_i over its
prompts i; τ = the macro average over benchmarks. Interval: prompts resampled with replacement within each
benchmark (`resamples` times, a fixed seed), the 2.5th and 97.5th percentiles of the macro average.
Prompts that cannot fit the context with `max_new_tokens` are skipped and counted, never a crash.
"""
from __future__ import annotations

import numpy as np

from dspark.decoding.engine import Engine, EngineConfig
from dspark.decoding.scheduler import SchedulerConfig


def engine_tau(target, drafter, benchmarks, settings, seed: int, max_batch: int = 64,
               resamples: int = 1000, decode_core: str = "eager") -> dict:
    """{prompts, skipped, tau: {benchmark: τ_b}, tau_mean, tau_ci95} of `drafter` on the first turns of
    `benchmarks` (dspark.eval.benchmark_files.Benchmark), sampled with `settings` (evaluation.DecodeSettings).
    decode_core: the engine's target step; eager by default — τ does not depend on the step's speed, and a
    compiled engine would spend minutes of a GPU budget compiling one graph per (rows, window) bucket."""
    from dspark.eval.evaluate import prompt_seed

    engine = Engine(target, drafter, EngineConfig(
        scheduler=SchedulerConfig(mode="fixed"), gamma=settings.gamma, decode_core=decode_core,
        max_batch=max_batch, max_waiting=max_batch, max_model_len=getattr(target, "max_positions", 1 << 20)))
    room = engine.max_model_len - engine.gamma - 1
    jobs, skipped = [], 0
    for bench in benchmarks:
        for index, turns in enumerate(bench.prompts):
            ids = target.chat_ids([{"role": "user", "content": turns[0]}])
            if len(ids) + settings.max_new_tokens > room:
                skipped += 1
                continue
            jobs.append((bench.name, ids, prompt_seed(seed, bench.name, index)))
    reqs = engine.generate([ids for _, ids, _ in jobs], settings.sampling(), settings.max_new_tokens,
                           seeds=[s for _, _, s in jobs])
    per: dict[str, list[tuple[int, int]]] = {}
    for (bench, _, _), req in zip(jobs, reqs):
        if req.stats.rounds:
            per.setdefault(bench, []).append((req.stats.accepted + req.stats.rounds, req.stats.rounds))
    taus = {b: sum(a for a, _ in p) / sum(r for _, r in p) for b, p in per.items()}
    return {"prompts": sum(len(p) for p in per.values()), "skipped": skipped, "tau": taus,
            "tau_mean": float(np.mean(list(taus.values()))) if taus else None,
            "tau_ci95": bootstrap_ci95(per, resamples, seed)}


def bootstrap_ci95(per: dict[str, list[tuple[int, int]]], resamples: int, seed: int) -> list[float] | None:
    """95 % interval of the macro-average ratio τ, prompts resampled within each benchmark (None with fewer
    than 2 prompts in some benchmark)."""
    if not per or any(len(p) < 2 for p in per.values()):
        return None
    rng = np.random.default_rng(seed)
    macro = np.zeros(resamples)
    for pairs in per.values():
        arr = np.asarray(pairs, dtype=float)  # [n, 2]: (accepted + rounds, rounds)
        pick = rng.integers(0, len(arr), size=(resamples, len(arr)))
        macro += arr[pick, 0].sum(1) / arr[pick, 1].sum(1)
    macro /= len(per)
    return [float(np.percentile(macro, 2.5)), float(np.percentile(macro, 97.5))]
