"""Decoding metrics from per-round stats: τ, position-wise conditional acceptance, prefix survival.

Definitions (paper §2.1, §4.1), pooled over rounds (cycles), never averaged per prompt:
- τ = mean over rounds of (accepted + 1): accepted drafts plus the residual/bonus token. It equals
  emitted tokens / rounds except where a stop token or max_new_tokens truncated the last round.
- conditional acceptance at position k: among rounds that verified ≥ k drafts and accepted drafts
  1..k-1, the fraction that accepted draft k.
- prefix survival at k: P[accepted ≥ k] over all rounds (a draft that was not verified did not survive).
"""
from __future__ import annotations

from typing import Iterable, Sequence


def _field(r, name):
    return r[name] if isinstance(r, dict) else getattr(r, name)


def summarize(rounds: Sequence, wall_s: float | None = None, n_tokens: int | None = None) -> dict:
    """Summary dict of a list of RoundStats (or dicts with the same fields)."""
    n = len(rounds)
    accepted = [_field(r, "accepted") for r in rounds]
    verified = [_field(r, "verified") for r in rounds]
    depth = max([_field(r, "proposed") for r in rounds] + verified, default=0)
    cond, cond_n, survival = {}, {}, {}
    for k in range(1, depth + 1):
        at_risk = [a for a, v in zip(accepted, verified) if v >= k and a >= k - 1]
        cond_n[k] = len(at_risk)
        cond[k] = sum(a >= k for a in at_risk) / len(at_risk) if at_risk else None
        survival[k] = sum(a >= k for a in accepted) / n if n else None
    out = {
        "rounds": n,
        "tau": sum(a + 1 for a in accepted) / n if n else None,
        "tau_emitted": sum(_field(r, "emitted") for r in rounds) / n if n else None,
        "mean_proposal_len": sum(_field(r, "proposed") for r in rounds) / n if n else None,
        "mean_verified": sum(verified) / n if n else None,
        "mean_accepted": sum(accepted) / n if n else None,
        "cond_accept": cond,
        "cond_accept_n": cond_n,
        "prefix_survival": survival,
    }
    if wall_s is not None and n_tokens is not None:
        out.update(wall_s=wall_s, tokens=n_tokens, tokens_per_s=n_tokens / wall_s if wall_s > 0 else None)
    return out


def summarize_results(results: Iterable) -> dict:
    """Merge GenerationResults across prompts: rounds pooled, tokens and wall time summed."""
    results = list(results)
    rounds = [r for res in results for r in res.rounds]
    out = summarize(rounds, wall_s=sum(res.wall_s for res in results),
                    n_tokens=sum(len(res.token_ids) for res in results))
    out["prompts"] = len(results)
    return out


def merge_summaries(summaries: Sequence[dict]) -> dict:
    """Pool several `summarize` outputs exactly (round-weighted), e.g. across prompts or workers."""
    total = sum(s["rounds"] for s in summaries)
    depth = max((max(s["cond_accept_n"], default=0) for s in summaries), default=0)
    merged: dict = {"rounds": total}
    for key in ("tau", "tau_emitted", "mean_proposal_len", "mean_verified", "mean_accepted"):
        merged[key] = sum((s[key] or 0) * s["rounds"] for s in summaries) / total if total else None
    merged["cond_accept_n"] = {k: sum(s["cond_accept_n"].get(k, 0) for s in summaries) for k in range(1, depth + 1)}
    merged["cond_accept"] = {
        k: (sum((s["cond_accept"].get(k) or 0) * s["cond_accept_n"].get(k, 0) for s in summaries) / n_k
            if n_k else None)
        for k, n_k in merged["cond_accept_n"].items()}
    merged["prefix_survival"] = {
        k: sum((s["prefix_survival"].get(k) or 0) * s["rounds"] for s in summaries) / total if total else None
        for k in range(1, depth + 1)}
    if all("wall_s" in s for s in summaries) and summaries:
        wall, tokens = sum(s["wall_s"] for s in summaries), sum(s["tokens"] for s in summaries)
        merged.update(wall_s=wall, tokens=tokens, tokens_per_s=tokens / wall if wall > 0 else None)
    return merged


def _fmt(value, floatfmt: str) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return format(value, floatfmt)
    return str(value)


def markdown_table(rows: Sequence[dict], columns: Sequence[str] | None = None, floatfmt: str = ".3f") -> str:
    """Rows of dicts -> a GitHub Markdown table (columns default to the first row's keys)."""
    if not rows:
        return ""
    columns = list(columns or rows[0].keys())
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(_fmt(row.get(c), floatfmt) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def position_rows(summaries: dict[str, dict], key: str = "cond_accept") -> list[dict]:
    """{name: summary} -> one row per name with columns k=1..γ of `key` (cond_accept or prefix_survival)."""
    depth = max((max(s[key], default=0) for s in summaries.values()), default=0)
    return [{"name": name, **{f"k={k}": s[key].get(k) for k in range(1, depth + 1)}}
            for name, s in summaries.items()]
