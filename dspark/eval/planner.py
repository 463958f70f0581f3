"""Cost planner: how much rollout data (and device time) a target acceptance length τ needs.

Inputs, all measured: a fitted τ(data) curve (the learning-curve benchmark's points: expected τ vs
generated rollout tokens), rollout throughput (generated tokens/s per device kind, from
benchmarks/rollout_throughput.py JSONs or the learning curve), and drafter-training throughput
(training tokens/s per device kind, from benchmarks/train_throughput.py JSONs or the learning curve).

Arithmetic (one worker = one device of a kind; N workers scale ideally, which is an upper bound):
    rollout tokens for τ*   T* = curve⁻¹(τ*)
    rollout seconds         T* / rollout_tok_s
    training tokens         T* · (1 + prompt tokens per generated token) · epochs
    training seconds        training tokens / train_tok_s
    device-hours            (rollout seconds + training seconds) / 3600
    wall-clock on N         device-hours / N
Curves:
    loglinear   τ = a + b·ln T            (2+ points; unbounded: τ grows without limit)
    power       τ = a − b·T^(−c)          (4+ points; saturates at a; τ* ≥ a is unreachable)
A figure is flagged `extrapolated` when T* lies outside the measured token range.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

PAPER_PROMPTS = 1_300_000  # the paper's training set: 1.3 M prompts x 10 epochs
PAPER_EPOCHS = 10


@dataclass(frozen=True)
class Curve:
    form: str  # "loglinear" | "power"
    a: float
    b: float
    c: float = 0.0
    t_min: float = 0.0  # measured token range
    t_max: float = 0.0

    def tau(self, tokens: float) -> float:
        if self.form == "loglinear":
            return self.a + self.b * math.log(tokens)
        return self.a - self.b * tokens ** (-self.c)

    def tokens_for(self, tau: float) -> float:
        """T with tau(T) = τ*; inf when the curve never reaches it (flat/decreasing, or power's ceiling a)."""
        if self.form == "loglinear":
            return math.exp((tau - self.a) / self.b) if self.b > 0 else math.inf
        if tau >= self.a or self.b <= 0 or self.c <= 0:
            return math.inf
        return ((self.a - tau) / self.b) ** (-1.0 / self.c)

    def extrapolated(self, tokens: float) -> bool:
        return not (self.t_min <= tokens <= self.t_max)


def fit_curve(tokens: Sequence[float], taus: Sequence[float], form: str = "loglinear") -> Curve:
    """Least-squares fit of τ(T) to measured points."""
    import numpy as np

    x, y = np.asarray(tokens, float), np.asarray(taus, float)
    if form == "loglinear":
        if x.size < 2:
            raise ValueError("a log-linear fit needs at least 2 points")
        b, a = np.polyfit(np.log(x), y, 1)
        return Curve("loglinear", float(a), float(b), 0.0, float(x.min()), float(x.max()))
    if form == "power":
        if x.size < 4:
            raise ValueError("a power-law fit (3 parameters) needs at least 4 points")
        from scipy.optimize import curve_fit

        scale = x.min()
        (a, b, c), _ = curve_fit(lambda t, a, b, c: a - b * (t / scale) ** (-c), x, y,
                                 p0=(y.max() + 0.5, 1.0, 0.5), bounds=([0, 0, 1e-3], [50, 50, 3]), maxfev=20000)
        return Curve("power", float(a), float(b * scale ** c), float(c), float(x.min()), float(x.max()))
    raise ValueError(f"curve form must be 'loglinear' or 'power', got {form!r}")


@dataclass(frozen=True)
class DeviceThroughput:
    device: str
    rollout_tok_s: float  # generated tokens/s of one worker
    train_tok_s: float  # training tokens/s (prompt + answer tokens) of one worker


@dataclass
class PlanRow:
    label: str
    device: str
    workers: int
    tau: float
    rollout_tokens: float
    training_tokens: float
    rollout_hours: float
    training_hours: float
    device_hours: float
    wall_clock_hours: float
    extrapolated: bool


def plan_row(label: str, tau: float, rollout_tokens: float, tp: DeviceThroughput, workers: int, epochs: float,
             prompt_per_generated: float, curve: Curve) -> PlanRow:
    train_tokens = rollout_tokens * (1.0 + prompt_per_generated) * epochs
    r_h = rollout_tokens / tp.rollout_tok_s / 3600.0
    t_h = train_tokens / tp.train_tok_s / 3600.0
    return PlanRow(label, tp.device, workers, tau, rollout_tokens, train_tokens, r_h, t_h, r_h + t_h,
                   (r_h + t_h) / workers, curve.extrapolated(rollout_tokens))


def make_plan(curve: Curve, throughputs: Sequence[Throughput], target_taus: Sequence[float], workers: int,
              epochs: float, prompt_per_generated: float, tokens_per_prompt: float) -> list[PlanRow]:
    """Rows per (target τ, device) and the paper's setting (1.3 M prompts x 10 epochs) per device."""
    rows = []
    for tp in throughputs:
        for tau in target_taus:
            rows.append(plan_row(f"tau {tau:g}", tau, curve.tokens_for(tau), tp, workers, epochs,
                                 prompt_per_generated, curve))
        paper_tokens = PAPER_PROMPTS * tokens_per_prompt
        rows.append(plan_row("paper: 1.3M prompts x 10 epochs", curve.tau(paper_tokens), paper_tokens, tp, workers,
                             PAPER_EPOCHS, prompt_per_generated, curve))
    return rows


# ---------------------------------------------------------------- reading the benchmark JSONs
def curve_from_report(path: str, form: str = "loglinear", algo: str = "dspark") -> tuple[Curve, dict]:
    """Fit the curve to a learning-curve JSON's points; also returns the report."""
    report = json.loads(Path(path).read_text())
    pts = [p for p in report["points"] if p.get("expected_tau") and p.get("algo", algo) == algo]
    return fit_curve([p["rollout_tokens"] for p in pts], [p["expected_tau"] for p in pts], form), report


def rollout_tok_s_of(path: str) -> tuple[str, float]:
    """(device, generated tokens/s) from a rollout_throughput JSON (its best method), a GPU recipe's
    recipe.json (rollout_tok_per_s) or a GPU drafter report with a `rollouts` section (generated_tokens / wall_s)."""
    data = json.loads(Path(path).read_text())
    if data.get("rollout_tok_per_s"):
        return _device(data), float(data["rollout_tok_per_s"])
    if "tokens_per_s" in data and isinstance(data["tokens_per_s"], dict):
        return _device(data), max(data["tokens_per_s"].values())
    if "rollouts" in data and "generated_tokens" in data["rollouts"]:
        return _device(data), data["rollouts"]["generated_tokens"] / data["rollouts"]["wall_s"]
    raise ValueError(f"{path}: no rollout throughput (tokens_per_s or rollouts.generated_tokens/wall_s)")


def train_tok_s_of(path: str, algo: str = "dspark") -> tuple[str, float]:
    """(device, training tokens/s) from a train_throughput JSON (its best setting), a GPU recipe's
    recipe.json (its first `algo` drafter trained from scratch) or a learning-curve JSON (the largest DSpark
    point's training tokens/s)."""
    data = json.loads(Path(path).read_text())
    if "rollout_tok_per_s" in data and data.get("train"):
        fresh = [t for t in data["train"].values() if t.get("algo") == algo and not t.get("init_from")
                 and t.get("tokens_per_s")]
        if fresh:
            return _device(data), float(fresh[0]["tokens_per_s"])
    if data.get("benchmark") == "learning_curve":
        best = max(data["points"], key=lambda p: p["rollout_tokens"])
        return data.get("device_kind") or data["device"], best["training"]["tokens_per_s"]
    if "results" in data:
        return _device(data), max(r["tokens_per_s"] for r in data["results"].values())
    raise ValueError(f"{path}: no training throughput (results.*.tokens_per_s or learning-curve points)")


def rollout_shape(report: dict) -> tuple[float, float]:
    """(prompt tokens per generated token, generated tokens per prompt) of a learning-curve report's
    rollouts; (0.5, 256) where it has no rollout statistics."""
    stats = report.get("rollouts") or {}
    gen, prompt_tok, rows = stats.get("generated_tokens"), stats.get("prompt_tokens"), stats.get("rows")
    return (prompt_tok / gen if gen else 0.5), (gen / rows if rows else 256.0)


def _device(data: dict) -> str:
    return str(data.get("gpu") or data.get("device") or "unknown")


def rows_as_dicts(rows: Sequence[PlanRow]) -> list[dict]:
    return [asdict(r) for r in rows]


def format_table(rows: Sequence[PlanRow]) -> str:
    head = (f"{'setting':34s} {'device':>12s} {'N':>3s} {'tau':>5s} {'rollout tok':>12s} {'train tok':>12s} "
            f"{'dev-hours':>10s} {'wall h':>8s}  note")
    lines = [head, "-" * len(head)]
    for r in rows:
        note = "EXTRAPOLATED" if r.extrapolated else "measured range"
        if math.isinf(r.rollout_tokens):
            note = "unreachable on this curve"
        lines.append(f"{r.label:34s} {r.device[:12]:>12s} {r.workers:3d} {r.tau:5.2f} {r.rollout_tokens:12.3g} "
                     f"{r.training_tokens:12.3g} {r.device_hours:10.3g} {r.wall_clock_hours:8.3g}  {note}")
    return "\n".join(lines)
