"""The promotion rule: the retrained drafter replaces the serving one only when, on the same prompts
(paired), its τ is higher beyond the confidence interval on every drifted domain and not lower on
the others.

Per domain, Δ_i = τ_candidate(prompt i) - τ_serving(prompt i) over the evaluation's prompts of that
domain (held-out captured traffic and benchmarks). The interval is a percentile bootstrap of the
mean Δ (resampling prompts). Promote iff for every drifted domain the interval's lower bound > 0,
and for every other domain mean Δ >= -tolerance.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np


@dataclass
class DomainVerdict:
    domain: str
    prompts: int
    mean_delta: float | None
    ci_low: float | None
    ci_high: float | None
    drifted: bool
    ok: bool
    reason: str


@dataclass
class Decision:
    promote: bool
    domains: list[DomainVerdict]

    @property
    def reasons(self) -> list[str]:
        return [f"{d.domain}: {d.reason}" for d in self.domains]

    def to_dict(self) -> dict:
        return {"promote": self.promote, "domains": [asdict(d) for d in self.domains]}


def paired_deltas(samples: list[dict], domain_of: dict[str, str], serving: str, candidate: str) -> dict[str, list[float]]:
    """samples.jsonl rows of jobs.evaluate ({mode, benchmark, index, tau}) -> {domain: [Δτ per prompt]}."""
    tau = {(r["mode"], r["benchmark"], r["index"]): r["tau"] for r in samples if r.get("tau") is not None}
    out: dict[str, list[float]] = {}
    for (mode, bench, index), value in sorted(tau.items()):
        if mode != candidate or (serving, bench, index) not in tau:
            continue
        out.setdefault(domain_of[bench], []).append(value - tau[(serving, bench, index)])
    return out


def bootstrap_ci(values: list[float], confidence: float = 0.95, samples: int = 2000,
                 seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high): percentile bootstrap interval of the mean."""
    x = np.asarray(values, dtype=float)
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, len(x), size=(samples, len(x)))].mean(axis=1)
    tail = (1 - confidence) / 2 * 100
    return float(x.mean()), float(np.percentile(means, tail)), float(np.percentile(means, 100 - tail))


def decide(deltas: dict[str, list[float]], drifted: list[str], tolerance: float = 0.05, confidence: float = 0.95,
           samples: int = 2000, seed: int = 0) -> Decision:
    verdicts = []
    for domain in sorted(set(deltas) | set(drifted)):
        values, is_drifted = deltas.get(domain, []), domain in drifted
        if not values:
            verdicts.append(DomainVerdict(domain, 0, None, None, None, is_drifted, not is_drifted,
                                          "no evaluation prompts" + (" (drifted: cannot promote)" if is_drifted else "")))
            continue
        mean, low, high = bootstrap_ci(values, confidence, samples, seed)
        if is_drifted:
            ok = low > 0
            reason = f"drifted: Δτ {mean:+.3f}, {confidence:.0%} CI [{low:+.3f}, {high:+.3f}] " + (
                "excludes 0: improved" if ok else "does not exclude 0: not improved")
        else:
            ok = mean >= -tolerance
            reason = f"Δτ {mean:+.3f} (CI [{low:+.3f}, {high:+.3f}]) " + (
                f">= -{tolerance:g}: no loss" if ok else f"< -{tolerance:g}: loses")
        verdicts.append(DomainVerdict(domain, len(values), mean, low, high, is_drifted, ok, reason))
    promote = bool(drifted) and all(v.ok for v in verdicts)
    return Decision(promote, verdicts)
