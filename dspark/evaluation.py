"""Offline evaluation of drafters (paper §4.1, Table 1, Fig. 5), as plain Python: no Ray, no MLflow.

Flow: `load_benchmarks` reads `{"turns": [...]}` JSONL files (local or s3://) into `Benchmark`s;
`evaluate_prompt` decodes one prompt in every requested mode (target-only, each drafter, each
drafter at each static confidence threshold); `aggregate` pools the rounds into per-benchmark
summaries, macro-averages them per domain, and adds speedups and drafter/drafter ratios;
`markdown_report` and the `plot_*` functions render the result. `jobs/evaluate.py` spreads the
prompts over Ray workers and logs everything to MLflow.

Determinism: every (prompt, mode) decodes with its own generator seeded from
`prompt_seed(seed, benchmark, index)`, so tokens and τ do not depend on how prompts are spread over
workers or in which order they run (wall-clock timings do, of course).

Multi-turn: turn i is asked after the model's own answers to turns 1..i-1 (the speculative answer is
distributed exactly as the target's, so it is a valid target answer).
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch
from pydantic import field_validator

from dspark import metrics
from dspark.config import StrictModel
from dspark.jsonl import jsonl_lines
from dspark.sampling import SamplingParams
from dspark.scheduler import threshold_schedule
from dspark.specdec import GenerationResult, RoundStats, speculative_generate, target_generate

log = logging.getLogger(__name__)

TARGET_MODE = "target"
DEFAULT_THRESHOLDS = [round(0.1 * i, 1) for i in range(10)]  # 0.0 .. 0.9; 0.0 = fixed-length verification
KNOWN_DOMAINS = {"gsm8k": "math", "math500": "math", "aime": "math", "mbpp": "code", "humaneval": "code",
                 "livecodebench": "code", "mt-bench": "chat", "alpaca": "chat", "arena-hard": "chat"}


class BenchmarkError(ValueError):
    """A benchmark file is missing, malformed or empty; the message names the file."""


# ---- configuration ----------------------------------------------------------------------------
class BenchmarkSpec(StrictModel):
    path: str  # JSONL, local or s3://; a relative path is taken under the job's benchmark_dir
    name: str | None = None  # default: file stem
    domain: str | None = None  # math / code / chat / ...; default: KNOWN_DOMAINS[name] or "other"

    def resolved_name(self) -> str:
        return self.name or self.path.rstrip("/").rsplit("/", 1)[-1].removesuffix(".jsonl")

    def resolved_domain(self) -> str:
        return self.domain or KNOWN_DOMAINS.get(self.resolved_name().lower(), "other")


class DecodeSettings(StrictModel):
    temperature: float = 1.0  # paper protocol; 0 or greedy=true -> argmax decoding
    greedy: bool = False
    top_p: float = 1.0
    top_k: int = 0
    gamma: int | None = None  # drafts proposed per round; None = each drafter's block size
    max_new_tokens: int = 256  # per turn

    @field_validator("max_new_tokens")
    @classmethod
    def _positive(cls, v: int) -> int:
        if v < 1:
            raise ValueError("max_new_tokens must be >= 1")
        return v

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=0.0 if self.greedy else self.temperature, top_p=self.top_p, top_k=self.top_k)


# ---- benchmarks -------------------------------------------------------------------------------
@dataclass
class Benchmark:
    name: str
    domain: str
    source: str
    prompts: list[list[str]]  # the turns of each prompt


def parse_benchmark(text: str, source: str) -> list[list[str]]:
    """JSONL text -> turns per prompt. Raises BenchmarkError naming the file and line."""
    prompts = []
    for lineno, line in jsonl_lines(text):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise BenchmarkError(f"{source}:{lineno}: not valid JSON ({err.msg}); each line must be "
                                 '{"turns": ["first question", ...]}') from None
        turns = record.get("turns") if isinstance(record, dict) else None
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise BenchmarkError(f'{source}:{lineno}: expected {{"turns": [non-empty strings]}}, got {line[:80]!r}')
        prompts.append(turns)
    if not prompts:
        raise BenchmarkError(f"{source}: no prompts (empty file); add lines of the form {{\"turns\": [...]}}")
    return prompts


def load_benchmark(spec: BenchmarkSpec, base_dir: str | None = None, max_prompts: int | None = None) -> Benchmark:
    from dspark import storage  # local import: keeps S3 dependencies out of the pure paths

    source = spec.path
    if base_dir and not storage.is_s3(source) and not source.startswith("/"):
        source = storage.join(base_dir, source)
    try:
        text = storage.read_text(source)
    except FileNotFoundError:
        raise BenchmarkError(f"benchmark {spec.resolved_name()!r}: file not found: {source} "
                             f"(check benchmark_dir / the path)") from None
    prompts = parse_benchmark(text, source)
    return Benchmark(spec.resolved_name(), spec.resolved_domain(), source, prompts[:max_prompts])


def load_benchmarks(specs: Sequence[BenchmarkSpec], base_dir: str | None = None,
                    max_prompts: int | None = None) -> tuple[list[Benchmark], list[str]]:
    """Load every benchmark; a bad one becomes a warning, not a failure. Raises only if none loads."""
    benchmarks, problems = [], []
    names = [s.resolved_name() for s in specs]
    duplicates = {n for n in names if names.count(n) > 1}
    if duplicates:
        raise BenchmarkError(f"benchmark names must be unique, repeated: {sorted(duplicates)}; set `name:` explicitly")
    for spec in specs:
        try:
            benchmarks.append(load_benchmark(spec, base_dir, max_prompts))
        except BenchmarkError as err:
            log.warning("skipping benchmark: %s", err)
            problems.append(str(err))
    if not benchmarks:
        raise BenchmarkError("no benchmark could be loaded: " + " | ".join(problems or ["none configured"]))
    return benchmarks, problems


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


@dataclass
class ConversationResult:
    benchmark: str
    index: int
    mode: str
    turns: list[TurnResult] = field(default_factory=list)
    error: str | None = None


Decode = Callable[[list[int]], GenerationResult]


def run_conversation(target, turns: Sequence[str], decode: Decode, benchmark: str = "", index: int = 0,
                     mode: str = "", system: str | None = None) -> ConversationResult:
    """Ask each turn after the model's own earlier answers; `decode(prompt_ids)` answers one turn."""
    result = ConversationResult(benchmark, index, mode)
    messages: list[dict] = [{"role": "system", "content": system}] if system else []
    for text in turns:
        messages.append({"role": "user", "content": text})
        ids = target.chat_ids(messages)
        gen = decode(ids)
        answer = target.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
        result.turns.append(TurnResult(len(ids), gen.token_ids, gen.rounds, gen.wall_s, gen.prefill_s,
                                       gen.finish_reason, answer))
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
        return lambda ids: target_generate(target, ids, sp, settings.max_new_tokens, generator=generator)
    hook = None if mode.threshold is None else threshold_verify_len(mode.threshold, threshold_on)
    return lambda ids: speculative_generate(target, drafter, ids, sp, settings.max_new_tokens, verify_len=hook,
                                            generator=generator, gamma=settings.gamma)


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
            results.append(run_conversation(target, turns, decode, benchmark, index, mode.key, system))
        except ValueError as err:
            error = f"{benchmark}[{index}] {mode.key}: {err}"
            results.append(ConversationResult(benchmark, index, mode.key, error=error))
    return results


# ---- aggregation --------------------------------------------------------------------------------
def summarize_conversations(convs: Sequence[ConversationResult]) -> dict:
    """Pool rounds over all turns of all prompts; add token counts and decode throughput.
    decode_tokens_per_s counts tokens after the first (prefill) one over the time after prefill."""
    ok = [c for c in convs if c.error is None]
    turns = [t for c in ok for t in c.turns]
    out = metrics.summarize([r for t in turns for r in t.rounds])
    decode_tokens = sum(max(len(t.tokens) - 1, 0) for t in turns)
    decode_s = sum(t.wall_s - t.prefill_s for t in turns)
    out.update(prompts=len(ok), errors=len(convs) - len(ok), turns=len(turns), tokens=sum(len(t.tokens) for t in turns),
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
        reference = next((n for n in names if algos[n] == "dspark"), names[0])
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


# ---- reporting --------------------------------------------------------------------------------
def _columns(results: dict) -> tuple[list[str], list[str]]:
    return list(results["benchmarks"]), list(results["domains"])


def _metric_row(label: str, block: dict, metric: str, benches: list[str], domains: list[str]) -> dict:
    row = {"": label}
    row.update({b: block["per_benchmark"].get(b, {}).get(metric) for b in benches})
    row.update({f"{d} (macro)": block["per_domain"].get(d, {}).get(metric) for d in domains})
    row["mean"] = block.get("overall", {}).get(metric)
    return row


def markdown_report(results: dict, title: str = "") -> str:
    """Paper-Table-1 style Markdown: τ and speedup per benchmark and domain, ratios, acceptance by position."""
    benches, domains = _columns(results)
    drafters, ratios = results["drafters"], results["ratios"]
    parts = [f"## {title}" if title else ""]
    for metric, label in (("tau", "τ (accepted + bonus per verify round)"),
                          ("speedup", "speedup (decode tokens/s over target-only decoding)")):
        rows = [_metric_row(name, block, metric, benches, domains) for name, block in drafters.items()]
        rows += [_metric_row(name, block, metric, benches, domains) for name, block in ratios.items()]
        if metric == "speedup":
            target = dict(results["target_only"], overall=macro_average(
                list(results["target_only"]["per_benchmark"].values())))
            rows.insert(0, _metric_row("target tokens/s", target, "decode_tokens_per_s", benches, domains))
        parts += [f"### {label}", metrics.markdown_table(rows, floatfmt=".2f")]
    pooled = {name: block["pooled_positions"] for name, block in drafters.items()}
    if any(p["cond_accept"] for p in pooled.values()):
        parts += ["### conditional acceptance by position (pooled over all benchmarks)",
                  metrics.markdown_table(metrics.position_rows(pooled), floatfmt=".2f")]
    for drafter, per_domain in results.get("threshold_sweep", {}).items():
        rows = [{"domain": d, **{k: r[k] for k in ("threshold", "verified_per_step", "accepted_per_step",
                                                  "acceptance_rate", "tau")}}
                for d, domain_rows in per_domain.items() for r in domain_rows]
        parts += [f"### static threshold sweep — {drafter}", metrics.markdown_table(rows, floatfmt=".2f")]
    if results.get("warnings"):
        parts += ["### warnings", "\n".join(f"- {w}" for w in results["warnings"])]
    return "\n\n".join(p for p in parts if p)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_tau_by_benchmark(results: dict, path: str) -> str:
    """Grouped bars: τ per benchmark, one bar per drafter."""
    plt = _pyplot()
    benches, names = list(results["benchmarks"]), list(results["drafters"])
    width = 0.8 / max(len(names), 1)
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(benches), 3.6))
    for i, name in enumerate(names):
        per = results["drafters"][name]["per_benchmark"]
        values = [per.get(b, {}).get("tau") or 0.0 for b in benches]
        bars = ax.bar([x + i * width for x in range(len(benches))], values, width, label=name)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(benches))], benches)
    ax.set(ylabel="τ (tokens per verify round)", title="τ by benchmark")
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_cond_accept(results: dict, path: str) -> str:
    """Conditional acceptance by draft position, one line per drafter, one panel per domain."""
    plt = _pyplot()
    domains = list(results["domains"])
    fig, axes = plt.subplots(1, max(len(domains), 1), figsize=(3.6 * max(len(domains), 1), 3.4), squeeze=False)
    for ax, domain in zip(axes[0], domains):
        for name, block in results["drafters"].items():
            curve = block["per_domain"].get(domain, {}).get("cond_accept", {})
            ks = [k for k, v in sorted(curve.items(), key=lambda kv: int(kv[0])) if v is not None]
            ax.plot([int(k) for k in ks], [curve[k] for k in ks], marker="o", label=name)
        ax.set(title=domain, xlabel="draft position k", ylim=(0, 1.02))
        ax.xaxis.get_major_locator().set_params(integer=True)
    axes[0][0].set_ylabel("P(accept k | 1..k-1 accepted)")
    axes[0][-1].legend(fontsize=8)
    return _save(fig, path)


def plot_threshold_sweep(sweep: dict, path: str) -> str:
    """Paper Fig. 5: per domain, stacked bars of accepted / rejected drafts per step and the acceptance rate."""
    plt = _pyplot()
    drafters = list(sweep)
    domains = list(dict.fromkeys(d for per in sweep.values() for d in per))
    fig, axes = plt.subplots(len(drafters), len(domains), figsize=(3.8 * len(domains), 3.2 * len(drafters)),
                             squeeze=False)
    for r, drafter in enumerate(drafters):
        for c, domain in enumerate(domains):
            ax, rows = axes[r][c], sweep[drafter].get(domain, [])
            xs = list(range(len(rows)))
            acc = [row["accepted_per_step"] for row in rows]
            ax.bar(xs, acc, label="accepted")
            ax.bar(xs, [row["rejected_per_step"] for row in rows], bottom=acc, hatch="//", alpha=0.5, label="rejected")
            ax.set_xticks(xs, [f"{row['threshold']:.1f}" for row in rows])
            rate = ax.twinx()
            rate.plot(xs, [row["acceptance_rate"] or 0.0 for row in rows], color="black", marker="o", label="rate")
            rate.set(ylim=(0, 1.05), ylabel="acceptance rate")
            ax.set(title=f"{drafter} — {domain}", xlabel="confidence threshold", ylabel="drafts per step")
    axes[0][0].legend(fontsize=8, loc="upper right")
    return _save(fig, path)


def _save(fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path


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
