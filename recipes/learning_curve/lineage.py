"""Phase `lineage`: what scale bought a drafter trained in rounds, each round continuing the last.

A lineage spec (JSON) lists the rounds in order. Each names the compare JSON and the drafter key there that
hold its expected τ on the shared held-out answers, and the rollout sets the lineage saw first in that round
(set name -> generated tokens, from the sets' manifests; a round that re-passes rows it saw adds nothing).
Invariant: a round's x is the number of distinct rollout tokens its drafter has been trained on, so rounds
that only add passes stand at the x of the round before them. The phase fits τ = a + b·ln(tokens) over the
rounds that add data and sets them beside a learning curve's points and fit (a fresh drafter per point)."""
from __future__ import annotations

import json
import math
from pathlib import Path

from recipes.learning_curve.profiles import REPO, CurveProfile, log
from recipes.learning_curve.report import loglinear_fit


def lineage_rounds(spec: dict, results: Path) -> list[dict]:
    """One entry per round: label, distinct rollout tokens so far, expected τ and its 95 % interval."""
    rounds, seen = [], 0
    for step in spec["rounds"]:
        compare = json.loads((results / step["compare"]).read_text())
        if step["drafter"] not in compare["drafters"]:
            raise SystemExit(f"lineage: {step['compare']} has no drafter {step['drafter']!r}")
        row = compare["drafters"][step["drafter"]]
        seen += sum(step.get("new_rollouts", {}).values())
        rounds.append({"label": step["label"], "rollout_tokens": seen, "new_rollouts": step.get("new_rollouts", {}),
                       "expected_tau": row["expected_tau"], "expected_tau_ci95": row["expected_tau_ci95"],
                       "compare": step["compare"], "note": step.get("note")})
    return rounds


def tokens_for(fit: dict, tau: float) -> float | None:
    """Rollout tokens at which a log-linear fit reaches τ (None for a flat or falling fit)."""
    return math.exp((tau - fit["a"]) / fit["b"]) if fit and fit["b"] > 0 else None


def cmd_lineage(args, prof: CurveProfile) -> dict:
    """<name>.json + <name>.png (default lineage.*) in --results from --spec, beside the curve of --curve."""
    results = Path(args.results)
    spec = json.loads(Path(args.spec).read_text())
    rounds = lineage_rounds(spec, results)
    # one point per amount of data: a round that only re-passed rows replaces the one before it
    by_tokens = {r["rollout_tokens"]: r for r in rounds}
    fit = loglinear_fit([{"rollout_tokens": t, "expected_tau": r["expected_tau"]} for t, r in sorted(by_tokens.items())])
    curve = json.loads(Path(args.curve).read_text()) if args.curve else None
    last = rounds[-1]
    report = {"benchmark": "learning_curve_lineage", "target": spec.get("target"), "description": spec.get("description"),
              "rounds": rounds, "fit": fit, "curve": repo_path(args.curve),
              "curve_fit": curve.get("fit") if curve else None,
              "curve_fit_tokens_for_last_tau": tokens_for(curve.get("fit"), last["expected_tau"]) if curve else None,
              "last": {"label": last["label"], "rollout_tokens": last["rollout_tokens"],
                       "expected_tau": last["expected_tau"]}}
    (results / f"{args.name}.json").write_text(json.dumps(report, indent=1))
    plot_lineage(report, curve, results / f"{args.name}.png")
    log(f"lineage: {len(rounds)} rounds, {last['rollout_tokens']:,} distinct rollout tokens, expected τ "
        f"{last['expected_tau']:.3f}; fit over the rounds: {fit}")
    return report


def repo_path(path: str | None) -> str | None:
    """A path inside the repository as repository-relative (what a committed JSON should hold), else as given."""
    if not path:
        return path
    resolved = Path(path).resolve()
    return str(resolved.relative_to(REPO)) if resolved.is_relative_to(REPO) else path


def tau_points(rows: list[dict]) -> tuple[list, list, list]:
    """x (rollout tokens), y (expected τ) and the asymmetric error bars of its 95 % interval, for errorbar."""
    x, y = [r["rollout_tokens"] for r in rows], [r["expected_tau"] for r in rows]
    lo, hi = zip(*(r["expected_tau_ci95"] for r in rows))
    return x, y, [[v - a for v, a in zip(y, lo)], [b - v for v, b in zip(y, hi)]]


def plot_lineage(report: dict, curve: dict | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7.2, 4.4))
    if curve and curve.get("points"):
        pts = [p for p in curve["points"] if p["expected_tau"] is not None]
        cx, cy, cerr = tau_points(pts)
        ax.errorbar(cx, cy, yerr=cerr, marker="o", color="C7", capsize=3, label="learning curve: a fresh drafter per point")
    rounds = report["rounds"]
    x, y, err = tau_points(rounds)
    ax.errorbar(x, y, yerr=err, marker="s", color="C0", capsize=3, linestyle="-",
                label="one drafter in rounds, each continuing the last (hollow: a pass over rows it had seen)")
    repass = [r for r in rounds[1:] if not r["new_rollouts"]]
    ax.plot([r["rollout_tokens"] for r in repass], [r["expected_tau"] for r in repass], "s", color="white",
            markeredgecolor="C0", zorder=3)
    for i, r in enumerate(rounds):  # labels alternate below and above the line
        ax.annotate(r["label"], (r["rollout_tokens"], r["expected_tau"]), xytext=(4, -14 if i % 2 else 8),
                    textcoords="offset points", fontsize=6.5, ha="left")
    span = {"rounds": (min(x) / 1.3, max(x) * 1.5)}
    if curve and curve.get("points"):
        span["curve"] = (min(p["rollout_tokens"] for p in curve["points"]), max(x) * 1.5)
    for key, fit, style, label in (("rounds", report["fit"], "C0--", "log-linear fit over the rounds"),
                                   ("curve", report.get("curve_fit"), "C7:", "the curve's fit (what `dspark plan` uses)")):
        if fit and key in span:
            xs = np.geomspace(*span[key], 60)
            ax.plot(xs, fit["a"] + fit["b"] * np.log(xs), style, lw=1, label=label)
    ax.axhline(2.0, color="k", lw=0.5, alpha=0.5)
    ax.set_xscale("log")
    ax.set_xlabel("distinct rollout tokens the drafter was trained on")
    ax.set_ylabel("expected τ (γ 7, temperature 1, held-out answers)")
    ax.set_title(f"{report.get('target') or 'target'}: what more data bought", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
