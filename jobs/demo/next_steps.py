"""The demo summary's last paragraph: where the committed CPU learning curve says to go next (`dspark plan` on
it) and, for smollm2-135m, what the committed CPU drafter measured. Application wording and result paths live
here, not in the library (dspark.eval.planner does the arithmetic)."""
from __future__ import annotations

import json
import math
from pathlib import Path

from dspark.eval.planner import (DeviceThroughput, curve_from_report, plan_row, rollout_shape, rollout_tok_s_of,
                                 train_tok_s_of)

CPU_CURVE = "benchmarks/results/learning_curve/cpu-5k.json"
CPU_ROLLOUTS = "benchmarks/results/rollout_throughput/cpu-smollm2-135m-64x128.json"


def next_step(repo: Path, tau: float = 3.0, workers: int = 8, epochs: float = 2.0) -> str:
    """One paragraph for the demo's summary: what the committed CPU learning curve says a τ target costs
    (rollout tokens, device-hours on `workers` of these CPUs; flagged where extrapolated) and the
    `dspark plan` command that prints the whole table."""
    curve_path, rollout_path = repo / CPU_CURVE, repo / CPU_ROLLOUTS
    command = (f"dspark plan --curve {CPU_CURVE} --rollout-bench {CPU_ROLLOUTS} --train-bench {CPU_CURVE} "
               "--tau " + " ".join(f"{t:g}" for t in sorted({2.0, tau})) + f" --workers {workers}")
    curve, report = curve_from_report(str(curve_path))
    device, rollout = rollout_tok_s_of(str(rollout_path))
    _, train = train_tok_s_of(str(curve_path))
    ratio, _ = rollout_shape(report)
    row = plan_row(f"tau {tau:g}", tau, curve.tokens_for(tau), DeviceThroughput(device, rollout, train), workers,
                   epochs, ratio, curve)
    if math.isinf(row.rollout_tokens):
        where = f"the measured CPU curve does not reach τ {tau:g} (it is flat or falling)"
    elif row.rollout_tokens > 100 * curve.t_max:
        where = (f"τ {tau:g} lies far past what this CPU curve measured (its fit puts it at ~{row.rollout_tokens:.2g} "
                 f"rollout tokens, {row.rollout_tokens / curve.t_max:.2g}× the largest point: not a forecast); "
                 "measure the curve where it matters with the GPU recipe (README 'Running the GPU recipe')")
    else:
        where = (f"τ {tau:g} needs ~{row.rollout_tokens:.3g} rollout tokens, ~{row.device_hours:.3g} device-hours "
                 f"of these CPUs ({row.wall_clock_hours:.3g} h on {workers})"
                 + (" — EXTRAPOLATED far past the measured points: run the GPU recipe" if row.extrapolated else ""))
    return (f"where next (learning curve {CPU_CURVE}, measured up to {curve.t_max:.3g} rollout tokens, "
            f"τ {curve.tau(curve.t_max):.2f}): {where}.\n  full table: {command}")



BEST_CPU_DRAFTER = "benchmarks/results/learning_curve/drafter-cpu-mix2"
BEST_CPU_DECODE = "benchmarks/results/decode_speed/cpu_mix2_drafter_gamma3_engine_trees_2_8_bf16_60prompts.json"


def best_drafter_line(repo: Path) -> str:
    """One line for the demo's summary: what the committed CPU drafter (more data than a demo trains on)
    measured through the engine at batch 1, chain and fastest tree, read from its decode_speed JSON."""
    report = json.loads((repo / BEST_CPU_DECODE).read_text())
    drafted = {label: mode for label, mode in report["modes"].items() if mode.get("tau") is not None}
    chain = next(mode for label, mode in drafted.items() if ":t" not in label)
    trees = {label.rsplit(":t", 1)[1]: mode for label, mode in drafted.items() if ":t" in label}
    fastest = max(trees.items(), key=lambda kv: kv[1]["speedup"], default=None)

    def figures(mode: dict) -> str:
        lo, hi = mode["speedup_ci95"]
        return f"τ {mode['tau']:.2f}, {mode['speedup']:.2f}× [{lo:.2f}, {hi:.2f}] target-only"

    tree = f"; tree {fastest[0]}: {figures(fastest[1])}" if fastest else ""
    return (f"the committed CPU drafter {BEST_CPU_DRAFTER} (trained on far more rollouts than this demo) decodes at batch 1 "
            f"through the engine (temperature {report['temperature']:g}, γ {report['gamma']}): chain {figures(chain)}"
            f"{tree} ({BEST_CPU_DECODE}).\n  serve it: python -m jobs.serve --config configs/serve/smollm2-135m.yaml "
            f"--set model.drafter={BEST_CPU_DRAFTER}")


def demo_next_steps(repo: Path, target: str) -> str:
    """The demo summary's last paragraph: `next_step` and, for smollm2-135m, `best_drafter_line` (each
    replaced by a one-line reason when its committed JSON cannot be read)."""
    try:
        text = next_step(repo)
    except (OSError, ValueError, KeyError) as err:
        text = f"where next: no learning-curve figures to plan from ({err}); see docs/learning-curve.md"
    if target == "smollm2-135m":
        try:
            text += "\n" + best_drafter_line(repo)
        except (OSError, ValueError, KeyError, StopIteration) as err:
            text += f"\n(no committed drafter figures to show: {err})"
    return text
