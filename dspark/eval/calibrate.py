"""Calibration of the confidence head: ECE, ROC-AUC, Brier and Sequential Temperature Scaling
(STS, paper §3.2.1).

c_k is the probability that draft k survives given drafts 1..k-1 survived, so the probability that
the prefix of length k survives is a_k = Π_{i≤k} c_i. STS fits one temperature per position, left to
right: T_k minimises ECE(a_k, 1[accepted ≥ k]) with T_1..T_{k-1} already fixed, where
c_i = σ(logit_i / T_i). Temperature scaling is monotone, so the ranking of c_k is unchanged.
Collect calibration rounds with the drafter's calibration switched off (raw confidences) and full
verification (every position verified), so the labels are not selected by the confidences.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

_EPS = 1e-12


def _arr(x) -> np.ndarray:
    return np.asarray(x.detach().cpu() if hasattr(x, "detach") else x, dtype=np.float64)


def ece(probs, labels, n_bins: int = 15) -> float:
    """Expected calibration error with equal-width bins on [0, 1]: Σ_b (n_b/N)|mean p_b - mean y_b|."""
    p, y = _arr(probs).ravel(), _arr(labels).ravel()
    if p.size == 0:
        return float("nan")
    bins = np.minimum((p * n_bins).astype(int), n_bins - 1)
    count = np.bincount(bins, minlength=n_bins)
    gap = np.abs(np.bincount(bins, p, n_bins) - np.bincount(bins, y, n_bins))  # per bin: n_b |mean p - mean y|
    return float(gap.sum() / count.sum())


def roc_auc(scores, labels) -> float:
    """Rank-based ROC-AUC (Mann-Whitney U, average ranks for ties); nan if only one class is present."""
    s, y = _arr(scores).ravel(), _arr(labels).ravel() > 0.5
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(s, kind="mergesort")
    ranks = np.empty(len(s))
    sorted_s = s[order]
    starts = np.r_[0, np.flatnonzero(np.diff(sorted_s)) + 1]
    ends = np.r_[starts[1:], len(s)]
    for a, b in zip(starts, ends):  # tied scores share their average rank (1-based)
        ranks[order[a:b]] = (a + b + 1) / 2
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def brier(probs, labels) -> float:
    p, y = _arr(probs).ravel(), _arr(labels).ravel()
    return float(np.mean((p - y) ** 2)) if p.size else float("nan")


def to_logits(conf) -> np.ndarray:
    c = np.clip(_arr(conf), _EPS, 1 - _EPS)
    return np.log(c) - np.log1p(-c)


def apply_sts(conf, temperatures: Sequence[float], *, is_logits: bool = False) -> np.ndarray:
    """Calibrated conditional confidences σ(logit_k / T_k), shape [N, γ] (γ ≤ len(temperatures))."""
    logits = _arr(conf) if is_logits else to_logits(conf)
    temps = np.asarray(temperatures[: logits.shape[-1]], dtype=np.float64)
    return 1.0 / (1.0 + np.exp(-logits / temps))


def default_grid() -> np.ndarray:
    return np.exp(np.linspace(np.log(0.05), np.log(20.0), 241))  # log-spaced, includes T = 1


@dataclass
class STSResult:
    temperatures: list[float]
    positions: list[dict] = field(default_factory=list)  # per k: n, ece/auc/brier before and after

    def summary(self) -> dict:
        rows = [p for p in self.positions if p["n"]]
        mean = lambda key: float(np.mean([p[key] for p in rows])) if rows else float("nan")  # noqa: E731
        return {"ece_before": mean("ece_before"), "ece_after": mean("ece_after"),
                "auc": mean("auc_after"), "brier_before": mean("brier_before"), "brier_after": mean("brier_after")}


def fit_sts(conf, accepted, verified=None, *, is_logits: bool = False, n_bins: int = 15,
            grid: Sequence[float] | None = None) -> STSResult:
    """Fit T_1..T_γ left to right. conf [N, γ] raw confidences (or logits with is_logits), accepted [N]
    accepted-prefix lengths, verified [N] verified lengths (default γ: every position verified).
    Position k is fitted on the rounds that verified position k; label = 1[accepted ≥ k]."""
    logits = _arr(conf) if is_logits else to_logits(conf)
    if logits.ndim != 2:
        raise ValueError(f"conf must be [N, gamma], got shape {logits.shape}")
    n, gamma = logits.shape
    acc = _arr(accepted)
    ver = np.full(n, gamma) if verified is None else _arr(verified)
    grid = default_grid() if grid is None else np.asarray(grid, dtype=np.float64)
    raw_prefix, cal_prefix = np.ones(n), np.ones(n)  # Π_{i<k} c_i, raw and calibrated
    temps, positions = [], []
    for k in range(1, gamma + 1):
        col, rows, label = logits[:, k - 1], ver >= k, (acc >= k).astype(np.float64)
        raw = raw_prefix * _sigmoid(col)
        best_t = _search_temperature(cal_prefix[rows], col[rows], label[rows], grid, n_bins)
        cal = cal_prefix * _sigmoid(col / best_t)
        reached = rows & (acc >= k - 1)  # conditional view: rounds where drafts 1..k-1 survived
        positions.append({
            "k": k, "n": int(rows.sum()), "temperature": best_t,
            "ece_before": ece(raw[rows], label[rows], n_bins), "ece_after": ece(cal[rows], label[rows], n_bins),
            "auc_before": roc_auc(raw[rows], label[rows]), "auc_after": roc_auc(cal[rows], label[rows]),
            "brier_before": brier(raw[rows], label[rows]), "brier_after": brier(cal[rows], label[rows]),
            "cond_auc": roc_auc(col[reached], label[reached]),
            "survival": float(label[rows].mean()) if rows.any() else float("nan")})
        temps.append(best_t)
        raw_prefix, cal_prefix = raw, cal
    return STSResult(temps, positions)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _search_temperature(prefix: np.ndarray, logit: np.ndarray, label: np.ndarray, grid: np.ndarray,
                        n_bins: int) -> float:
    """1-D grid search of T minimising ECE(prefix·σ(logit/T), label); ties go to the T closest to 1."""
    if label.size == 0:
        return 1.0
    errors = np.array([ece(prefix * _sigmoid(logit / t), label, n_bins) for t in grid])
    best = np.flatnonzero(errors <= errors.min() + 1e-12)
    return float(grid[best[np.argmin(np.abs(np.log(grid[best])))]])


def rounds_to_arrays(rounds: Sequence) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """RoundStats with confidences -> (conf [N, γ], accepted [N], verified [N]); rounds without
    confidences are skipped, γ = the shortest confidence list."""
    usable = [r for r in rounds if r.confidences]
    if not usable:
        raise ValueError("no round carries confidences: decode with a drafter that has a confidence head")
    gamma = min(len(r.confidences) for r in usable)
    conf = np.array([r.confidences[:gamma] for r in usable], dtype=np.float64)
    return conf, np.array([r.accepted for r in usable]), np.array([min(r.verified, gamma) for r in usable])


def reliability_curve(probs, labels, n_bins: int = 15) -> dict:
    """Per equal-width bin: mean confidence, observed frequency, count (empty bins dropped)."""
    p, y = _arr(probs).ravel(), _arr(labels).ravel()
    bins = np.minimum((p * n_bins).astype(int), n_bins - 1)
    count = np.bincount(bins, minlength=n_bins)
    keep = count > 0
    return {"confidence": (np.bincount(bins, p, n_bins)[keep] / count[keep]).tolist(),
            "frequency": (np.bincount(bins, y, n_bins)[keep] / count[keep]).tolist(),
            "count": count[keep].tolist()}


def write_reliability_diagram(path: str, curves: dict[str, tuple], n_bins: int = 15, title: str = "") -> str:
    """PNG reliability diagram. curves = {label: (probs, labels)}; one line per label plus the diagonal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    ax.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1, label="perfect")
    for name, (probs, labels) in curves.items():
        c = reliability_curve(probs, labels, n_bins)
        ax.plot(c["confidence"], c["frequency"], marker="o", markersize=3,
                label=f"{name} (ECE {ece(probs, labels, n_bins):.3f})")
    ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="predicted prefix survival", ylabel="observed survival", title=title)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
