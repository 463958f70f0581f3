"""Offline evaluation of drafters (paper §4.1, Table 1, Fig. 5), as plain Python: no Ray, no MLflow.

Flow: `load_benchmarks` (dspark.eval.benchmark_files, re-exported here) reads `{"turns": [...]}` JSONL
files (local or s3://) into `Benchmark`s;
`evaluate_prompt` decodes one prompt in every requested mode (target-only, each drafter, each
drafter at each static confidence threshold); `aggregate` pools the rounds into per-benchmark
summaries, macro-averages them per domain, and adds speedups and drafter/drafter ratios;
`dspark.eval.report` renders the result (Markdown tables, plots). `jobs/evaluate.py` spreads the
prompts over Ray workers and logs everything to MLflow.

Determinism: every (prompt, mode) decodes with its own generator seeded from
`prompt_seed(seed, benchmark, index)`, so tokens and τ do not depend on how prompts are spread over
workers or in which order they run (wall-clock timings do, of course).

Multi-turn: turn i is asked after the model's own answers to turns 1..i-1 (the speculative answer is
distributed exactly as the target's, so it is a valid target answer).
"""
from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch
from pydantic import Field

from dspark.eval import metrics
from dspark.config import StrictModel
from dspark.decoding.sampling import MaxNewTokens, SamplingParams, Temperature, TopK, TopP
from dspark.decoding.scheduler import threshold_schedule
from dspark.decoding.specdec import GenerationResult, RoundStats, speculative_generate, target_generate
from dspark.decoding.static_core import DecodeCoreMode
from dspark.drafters.registry import DRAFTER_CLASSES
from dspark.eval.benchmark_files import (Benchmark, BenchmarkError, BenchmarkSpec, load_benchmark,  # noqa: F401
                                         load_benchmarks, parse_benchmark)  # (re-exported: callers use ev.*)

log = logging.getLogger(__name__)

TARGET_MODE = "target"
DEFAULT_THRESHOLDS = [round(0.1 * i, 1) for i in range(10)]  # 0.0 .. 0.9; 0.0 = fixed-length verification


class DecodeSettings(StrictModel):
    """Sampling (temperature 1: the paper's protocol) plus how each prompt is decoded."""

    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    greedy: bool = Field(False, description="argmax decoding whatever the temperature (same as temperature 0)")
    gamma: int | None = Field(None, ge=1, description="drafts proposed per round; None = each drafter's block size")
    max_new_tokens: MaxNewTokens = 256
    decode_core: DecodeCoreMode | None = Field(
        None, description="the target's batch-1 KV path (dspark.decoding.kv_sequence): auto (compiled on CUDA, "
                          "eager on CPU), compiled, eager, dynamic (HF cache); None = DSPARK_DECODE_CORE or auto")

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=0.0 if self.greedy else self.temperature, top_p=self.top_p, top_k=self.top_k)


# ---- decoding one prompt ----------------------------------------------------------------------
def prompt_seed(seed: int, benchmark: str, index: int) -> int:
    """A stable 63-bit seed for one prompt (independent of worker count, order and PYTHONHASHSEED)."""
    digest = hashlib.sha256(f"{seed}/{benchmark}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@dataclass
class TurnResult:
    prompt_len: int
    tokens: list[int]
    rounds: list[RoundStats]
    wall_s: float
    prefill_s: float
    finish_reason: str
    answer: str
    clipped: bool = False  # max_new_tokens was cut to what the target's context left after the prompt


@dataclass
class ConversationResult:
    benchmark: str
    index: int
    mode: str
    turns: list[TurnResult] = field(default_factory=list)
    error: str | None = None


Decode = Callable[[list[int], int], GenerationResult]  # (prompt ids, max new tokens) -> the answer


def answer_budget(target, prompt_len: int, max_new_tokens: int, lookahead: int = 1) -> int:
    """max_new_tokens, cut so prompt + answer + lookahead (the verify block past the last token) fit the
    target's context; a prompt that leaves no room is refused (ValueError: the prompt is recorded as failed)."""
    limit = getattr(target, "max_positions", None)
    if not limit:
        return max_new_tokens
    room = limit - prompt_len - lookahead
    if room < 1:
        raise ValueError(f"prompt_too_long: the prompt has {prompt_len} tokens; the target's context holds {limit} "
                         f"(with {lookahead} lookahead): skipped")
    return min(max_new_tokens, room)


def run_conversation(target, turns: Sequence[str], decode: Decode, benchmark: str = "", index: int = 0,
                     mode: str = "", system: str | None = None, max_new_tokens: int = 256,
                     lookahead: int = 1) -> ConversationResult:
    """Ask each turn after the model's own earlier answers; `decode(prompt_ids, n)` answers one turn with at
    most n tokens: max_new_tokens, clipped to the target's context (`answer_budget`; the turn says so)."""
    result = ConversationResult(benchmark, index, mode)
    messages: list[dict] = [{"role": "system", "content": system}] if system else []
    for text in turns:
        messages.append({"role": "user", "content": text})
        ids = target.chat_ids(messages)
        budget = answer_budget(target, len(ids), max_new_tokens, lookahead)
        gen = decode(ids, budget)
        answer = target.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
        result.turns.append(TurnResult(len(ids), gen.token_ids, gen.rounds, gen.wall_s, gen.prefill_s,
                                       gen.finish_reason, answer, clipped=budget < max_new_tokens))
        messages.append({"role": "assistant", "content": answer})
    return result


def threshold_verify_len(threshold: float, on: str = "prefix"):
    """verify_len hook of a static confidence threshold: verify the leading drafts whose prefix survival
    a_k = Π_{i≤k} c_i (on="prefix") or confidence c_k (on="confidence") is ≥ threshold. Threshold 0
    verifies everything. Non-anticipating: c_k is computed from drafts before k (scheduler docstring)."""
    def verify_len(_round_idx: int, proposal) -> int:
        conf = getattr(proposal, "confidences", None)
        if conf is None:
            raise ValueError("threshold sweep needs a drafter with a confidence head (DSpark, confidence_head=true)")
        return threshold_schedule([conf.tolist()], threshold, on)[0]
    return verify_len


@dataclass(frozen=True)
class Mode:
    """One way of decoding a prompt: target-only, or a drafter, optionally with a static threshold."""
    drafter: str | None = None  # None = target-only
    threshold: float | None = None

    @property
    def key(self) -> str:
        if self.drafter is None:
            return TARGET_MODE
        return self.drafter if self.threshold is None else f"{self.drafter}@{self.threshold:g}"


def decode_fn(target, drafter, mode: Mode, settings: DecodeSettings, generator: torch.Generator,
              threshold_on: str = "prefix") -> Decode:
    sp = settings.sampling()
    if drafter is None:
        return lambda ids, n: target_generate(target, ids, sp, n, generator=generator, core_mode=settings.decode_core)
    hook = None if mode.threshold is None else threshold_verify_len(mode.threshold, threshold_on)
    return lambda ids, n: speculative_generate(target, drafter, ids, sp, n, verify_len=hook, generator=generator,
                                               gamma=settings.gamma, core_mode=settings.decode_core)


def lookahead_of(drafter, settings: DecodeSettings) -> int:
    """Positions past the last token a decoding step may write: 1, or a draft block and its bonus token."""
    return 1 if drafter is None else (settings.gamma or drafter.config.block_size) + 1


def evaluate_prompt(target, drafters: dict, benchmark: str, index: int, turns: Sequence[str],
                    modes: Iterable[Mode], settings: DecodeSettings, seed: int,
                    threshold_on: str = "prefix", system: str | None = None) -> list[ConversationResult]:
    """Decode one prompt in each mode, each with a fresh generator seeded from (seed, benchmark, index).
    A failure (e.g. a prompt longer than the target's context) is recorded on the result, not raised."""
    results = []
    for mode in modes:
        generator = torch.Generator(device="cpu").manual_seed(prompt_seed(seed, benchmark, index))
        drafter = None if mode.drafter is None else drafters[mode.drafter]
        decode = decode_fn(target, drafter, mode, settings, generator, threshold_on)
        try:
            results.append(run_conversation(target, turns, decode, benchmark, index, mode.key, system,
                                            settings.max_new_tokens, lookahead_of(drafter, settings)))
        except ValueError as err:
            error = f"{benchmark}[{index}] {mode.key}: {err}"
            results.append(ConversationResult(benchmark, index, mode.key, error=error))
    return results


def evaluate_round_robin(target, drafters: dict, benchmarks: Sequence[Benchmark], settings: DecodeSettings,
                         seed: int, stop: Callable[[], bool] | None = None, warmup_tokens: int = 16
                         ) -> tuple[list[ConversationResult], dict[str, str]]:
    """Every prompt in target-only mode and with each drafter, prompt i of every benchmark before prompt
    i+1 of any (a `stop()` — checked before each prompt — cuts every benchmark alike). Each drafter is
    its own failure scope: one that raises is recorded in the returned {drafter: error} and skipped for
    the remaining prompts, the others go on. One warm-up decode per mode first (kernels, allocator)."""
    modes = [Mode()] + [Mode(name) for name in drafters]
    failed: dict[str, str] = {}
    queue = [(b, i) for i in range(max((len(b.prompts) for b in benchmarks), default=0))
             for b in benchmarks if i < len(b.prompts)]
    if queue and warmup_tokens:
        warm = settings.model_copy(update={"max_new_tokens": warmup_tokens})
        for mode in (m for m in modes if stop is None or not stop()):
            _in_scope(failed, mode, lambda: evaluate_prompt(target, drafters, "warmup", 0, queue[0][0].prompts[0][:1],
                                                            [mode], warm, seed))
    convs: list[ConversationResult] = []
    for bench, index in queue:
        if stop is not None and stop():
            break
        for mode in modes:
            if mode.drafter not in failed:
                convs += _in_scope(failed, mode, lambda: evaluate_prompt(target, drafters, bench.name, index,
                                                                         bench.prompts[index], [mode], settings, seed))
    return convs, failed


def _in_scope(failed: dict, mode: Mode, fn) -> list:
    """fn() -> results; an exception of a drafter's mode is recorded against that drafter (target-only
    failures are everyone's: they propagate)."""
    if mode.drafter is None:
        return fn()
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 — the drafter's own failure scope
        failed[mode.drafter] = f"{type(err).__name__}: {err}"
        log.warning("drafter %s failed during evaluation: %s", mode.drafter, failed[mode.drafter])
        return []


def tau_ci95(convs: Sequence[ConversationResult], mode: str) -> list[float] | None:
    """95% confidence interval of the macro-average τ over benchmarks for one mode, prompts as the
    sampling units: per benchmark τ_b = ΣA_i / ΣR_i (A_i tokens per round summed, R_i rounds of prompt
    i) with the ratio estimator's variance Σ(A_i − τ_b R_i)² / (n(n−1) R̄²), benchmarks independent.
    None when some benchmark has fewer than 2 prompts with rounds."""
    per: dict[str, list[tuple[float, int]]] = {}
    for c in convs:
        rounds = [r for t in c.turns for r in t.rounds]
        if c.mode == mode and c.error is None and rounds:
            per.setdefault(c.benchmark, []).append((sum(r.accepted + 1 for r in rounds), len(rounds)))
    if not per or any(len(v) < 2 for v in per.values()):
        return None
    means, variances = [], []
    for pairs in per.values():
        n, a_sum, r_sum = len(pairs), sum(a for a, _ in pairs), sum(r for _, r in pairs)
        tau, r_bar = a_sum / r_sum, r_sum / len(pairs)
        means.append(tau)
        variances.append(sum((a - tau * r) ** 2 for a, r in pairs) / (n * (n - 1) * r_bar ** 2))
    mean, half = sum(means) / len(means), 1.96 * math.sqrt(sum(variances)) / len(means)
    return [mean - half, mean + half]


# ---- aggregation --------------------------------------------------------------------------------
def summarize_conversations(convs: Sequence[ConversationResult]) -> dict:
    """Pool rounds over all turns of all prompts; add token counts and decode throughput.
    decode_tokens_per_s counts tokens after the first (prefill) one over the time after prefill."""
    ok = [c for c in convs if c.error is None]
    turns = [t for c in ok for t in c.turns]
    out = metrics.summarize([r for t in turns for r in t.rounds])
    decode_tokens = sum(max(len(t.tokens) - 1, 0) for t in turns)
    decode_s = sum(t.wall_s - t.prefill_s for t in turns)
    out.update(prompts=len(ok), errors=len(convs) - len(ok), turns=len(turns), clipped_turns=sum(t.clipped for t in turns),
               tokens=sum(len(t.tokens) for t in turns),
               wall_s=sum(t.wall_s for t in turns), decode_s=decode_s,
               decode_tokens_per_s=decode_tokens / decode_s if decode_s > 0 else None)
    return out


def _mean(values: Iterable) -> float | None:
    vals = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(vals) / len(vals) if vals else None


SCALARS = ("tau", "mean_proposal_len", "mean_verified", "mean_accepted", "decode_tokens_per_s", "speedup")


def macro_average(summaries: Sequence[dict]) -> dict:
    """Unweighted mean over benchmarks of the scalar metrics and of each position's curves."""
    out = {key: _mean(s.get(key) for s in summaries) for key in SCALARS}
    for curve in ("cond_accept", "prefix_survival"):
        depth = max((max(s.get(curve) or {0: 0}) for s in summaries), default=0)
        out[curve] = {k: _mean((s.get(curve) or {}).get(k) for s in summaries) for k in range(1, depth + 1)}
    out["benchmarks"] = len(summaries)
    return out


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b not in (None, 0) else None


def comparison_pairs(algos: dict[str, str], reference: str | None = None) -> list[tuple[str, str]]:
    """(numerator, denominator) drafter pairs: the reference (default: the first DSpark drafter, else the
    first drafter) over every other drafter — DSpark/DFlash and DSpark/Eagle3 in the paper's Table 1."""
    names = list(algos)
    if len(names) < 2:
        return []
    if reference is None:
        reference = next((n for n in names if DRAFTER_CLASSES[algos[n]].comparison_reference), names[0])
    if reference not in algos:
        raise ValueError(f"compare reference {reference!r} is not one of the drafters {names}")
    return [(reference, other) for other in names if other != reference]


def aggregate(convs: Sequence[ConversationResult], benchmarks: Sequence[Benchmark], algos: dict[str, str],
              reference: str | None = None, sweep_modes: Sequence[Mode] = ()) -> dict:
    """All conversations of a run -> the results dict written to results.json:
      benchmarks {name: domain, source, prompts}; domains {domain: [benchmarks]};
      target_only {per_benchmark, per_domain}: decode tokens/s of target-only decoding;
      drafters {name: per_benchmark {bench: summary}, per_domain {domain: macro}, overall (macro over
        benchmarks), pooled_positions (cond_accept / prefix_survival over every round)};
      ratios {"A/B": per_benchmark / per_domain / overall {tau, speedup}}; warnings [str];
      threshold_sweep {drafter: {domain: [row per threshold]}} when sweep modes ran.
    A summary is metrics.summarize over the pooled rounds plus prompts, errors, turns, tokens, wall_s,
    decode_s, decode_tokens_per_s and (drafters) speedup = decode tokens/s over the target's."""
    by_key: dict[tuple[str, str], list[ConversationResult]] = {}
    for c in sorted(convs, key=lambda c: (c.benchmark, c.index, c.mode)):
        by_key.setdefault((c.mode, c.benchmark), []).append(c)
    warnings = [c.error for c in convs if c.error]
    clipped = sum(t.clipped for c in convs for t in c.turns)
    if clipped:
        warnings.append(f"{clipped} answers had max_new_tokens cut to what the target's context left after the prompt")
    domains: dict[str, list[str]] = {}
    for b in benchmarks:
        domains.setdefault(b.domain, []).append(b.name)

    def per_benchmark(mode: str) -> dict[str, dict]:
        return {b.name: summarize_conversations(by_key[(mode, b.name)])
                for b in benchmarks if (mode, b.name) in by_key}

    target = per_benchmark(TARGET_MODE)
    results = {}
    for name in algos:
        per_bench = per_benchmark(name)
        for bench, s in per_bench.items():
            base = target.get(bench, {}).get("decode_tokens_per_s")
            s["speedup"] = _ratio(s["decode_tokens_per_s"], base)
            _guard_speedup(s, f"drafter {name!r} on benchmark {bench!r}", warnings)
            if not s["rounds"]:
                warnings.append(f"drafter {name!r} on benchmark {bench!r}: no decoding rounds (all prompts failed "
                                f"or every answer ended at its first token)")
        results[name] = {"per_benchmark": per_bench, "per_domain": _per_domain(per_bench, domains),
                         "overall": macro_average(list(per_bench.values())),
                         "pooled_positions": _pooled_positions(per_bench)}
    ratios = {f"{a}/{b}": _ratio_block(results[a], results[b]) for a, b in comparison_pairs(algos, reference)}
    out = {"benchmarks": {b.name: {"domain": b.domain, "source": b.source, "prompts": len(b.prompts)}
                          for b in benchmarks},
           "domains": domains, "target_only": {"per_benchmark": target, "per_domain": _per_domain(target, domains)},
           "drafters": results, "ratios": ratios, "warnings": warnings}
    if sweep_modes:
        out["threshold_sweep"] = threshold_sweep_table(by_key, sweep_modes, domains)
    return out


SPEEDUP_OVER_TAU_TOLERANCE = 1.1  # timing noise; a real speedup cannot exceed τ (each round costs >= 1 target step)


def _guard_speedup(summary: dict, where: str, warnings: list[str]) -> None:
    """A speedup above τ means the target-only baseline was slowed by something else (compiles, a busy
    machine): it is kept as `speedup_above_tau` and `speedup` becomes None rather than being quoted."""
    speedup, tau = summary.get("speedup"), summary.get("tau")
    if speedup is not None and tau and speedup > tau * SPEEDUP_OVER_TAU_TOLERANCE:
        summary["speedup_above_tau"], summary["speedup"] = speedup, None
        warnings.append(f"{where}: speedup {speedup:.2f} > tau {tau:.2f}: a broken target-only baseline, not quoted")


def _per_domain(per_bench: dict[str, dict], domains: dict[str, list[str]]) -> dict[str, dict]:
    return {d: macro_average([per_bench[n] for n in names if n in per_bench])
            for d, names in domains.items() if any(n in per_bench for n in names)}


def _pooled_positions(per_bench: dict[str, dict]) -> dict:
    """Conditional acceptance / prefix survival pooled over every round of every benchmark."""
    usable = [s for s in per_bench.values() if s["rounds"]]
    if not usable:
        return {"cond_accept": {}, "prefix_survival": {}}
    merged = metrics.merge_summaries(usable)
    return {"cond_accept": merged["cond_accept"], "prefix_survival": merged["prefix_survival"], "tau": merged["tau"]}


def _ratio_block(a: dict, b: dict) -> dict:
    block = {"per_benchmark": {}, "per_domain": {}}
    for level in ("per_benchmark", "per_domain"):
        for key in a[level].keys() & b[level].keys():
            block[level][key] = {m: _ratio(a[level][key].get(m), b[level][key].get(m)) for m in ("tau", "speedup")}
    block["overall"] = {m: _ratio(a["overall"].get(m), b["overall"].get(m)) for m in ("tau", "speedup")}
    return block


def threshold_sweep_table(by_key: dict, sweep_modes: Sequence[Mode], domains: dict[str, list[str]]) -> dict:
    """{drafter: {domain: [row per threshold]}}: rounds pooled over the domain's benchmarks.
    verified_per_step / accepted_per_step = drafts verified / accepted per round;
    acceptance_rate = accepted / verified; tau = accepted + 1 per round."""
    table: dict[str, dict[str, list[dict]]] = {}
    for mode in sorted(sweep_modes, key=lambda m: (m.drafter, m.threshold)):
        for domain, names in domains.items():
            rounds = [r for n in names for c in by_key.get((mode.key, n), []) if c.error is None
                      for t in c.turns for r in t.rounds]
            if not rounds:
                continue
            verified, accepted = sum(r.verified for r in rounds), sum(r.accepted for r in rounds)
            table.setdefault(mode.drafter, {}).setdefault(domain, []).append({
                "threshold": mode.threshold, "rounds": len(rounds),
                "verified_per_step": verified / len(rounds), "accepted_per_step": accepted / len(rounds),
                "rejected_per_step": (verified - accepted) / len(rounds),
                "acceptance_rate": accepted / verified if verified else None,
                "tau": (accepted + len(rounds)) / len(rounds)})
    return table


def sample_records(convs: Sequence[ConversationResult]) -> list[dict]:
    """One JSON-able line per (mode, prompt): answers, token counts and τ, for inspection."""
    rows = []
    for c in sorted(convs, key=lambda c: (c.mode, c.benchmark, c.index)):
        rounds = [r for t in c.turns for r in t.rounds]
        rows.append({"mode": c.mode, "benchmark": c.benchmark, "index": c.index, "error": c.error,
                     "answers": [t.answer for t in c.turns], "tokens": [len(t.tokens) for t in c.turns],
                     "finish": [t.finish_reason for t in c.turns],
                     "tau": metrics.summarize(rounds)["tau"] if rounds and c.mode != TARGET_MODE else None})
    return rows
