"""Phase `draft-temperature`: the draft temperature that gives decoding the most tokens per target step.

Drafts may be sampled from a sharpened (or flattened) q without changing what decoding outputs
(`Drafter.draft_sampling`: acceptance compares the target's p with the q every draft was drawn from). This
sweeps values with the renewal estimate of decoding's τ on the held-out rows (every anchor; at a decode
run's setting with --gamma/--answer-tokens/--benchmarks), reports each with its paired difference to
1 (the same prompts resampled jointly), and with --save DIR writes the drafter with the best value
(the source folder is never written). The best of several values measured on one set reads slightly
high on that set: check it with real decoding (benchmarks/decode_speed.py) on the saved drafter.

    python -m recipes.learning_curve draft-temperature --drafters DRAFTER [--temperatures 0.6 0.8 1.0]
        [--gamma 3 --answer-tokens 64] [--save DIR]
"""
from __future__ import annotations

import json
from pathlib import Path

from recipes.learning_curve.profiles import CurveProfile, log

DEFAULT_TEMPERATURES = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def cmd_draft_temperature(args, prof: CurveProfile) -> dict:
    from recipes.learning_curve.measure import (drafter_label, estimate_loaded, one_drafter_renewal_setting,
                                                setting_file)

    temperatures = sorted({1.0, *(args.temperatures or DEFAULT_TEMPERATURES)})
    if temperatures[0] <= 0:
        raise SystemExit(f"draft-temperature: temperatures must be > 0, got {temperatures[0]}")
    out, target, source, drafter, held, p_cache, prof = one_drafter_renewal_setting(args, prof, "draft-temperature")
    results = {}
    for t in temperatures:
        drafter.draft_temperature = t
        results[t] = estimate_loaded(drafter, target, prof, held, p_cache, args.gamma)
        log(f"draft temperature {t}: decoding's τ (renewal) {results[t]['renewal']['decoded_tau']:.3f}, "
            f"per-anchor τ {results[t]['alpha']['expected_tau']:.3f}")
    rows = {str(t): temperature_row(r, results[1.0], t == 1.0) for t, r in results.items()}
    best = max(temperatures, key=lambda t: results[t]["renewal"]["decoded_tau"])
    report = {"drafter": drafter_label(source), "held_out_rows": len(held[0]),
              "setting": {"gamma": results[1.0]["gamma"], "answer_tokens": args.answer_tokens,
                          "benchmarks": args.benchmarks, "anchor_stride": 1},
              "temperatures": rows, "best": best, "saved": None}
    if args.save:
        report["saved"] = save_with_temperature(drafter, best, Path(args.save))
    path = out / setting_file("draft-temperature", args)
    path.write_text(json.dumps(report, indent=1))
    log(f"best draft temperature {best}: τ {rows[str(best)]['decoded_tau_estimate']:.3f} vs "
        f"{rows['1.0']['decoded_tau_estimate']:.3f} at 1 -> {path}" + (f"; saved {args.save}" if args.save else ""))
    return report


def save_with_temperature(drafter, temperature: float, dest: Path) -> str:
    """The drafter with `draft_temperature` = temperature, as a new checkpoint folder (refuses to overwrite one)."""
    from dspark.drafters import save_drafter

    if (dest / "config.json").exists():
        raise SystemExit(f"draft-temperature --save {dest}: a drafter is already there; give a new folder")
    drafter.draft_temperature = temperature
    return save_drafter(drafter, str(dest))


def temperature_row(result: dict, at_one: dict, is_one: bool) -> dict:
    """One value's figures: decoding's τ (renewal) with its paired difference to 1, and per-anchor τ."""
    from recipes.learning_curve.measure import decoded_estimate

    est = decoded_estimate(result, at_one, is_one)
    vs_one = est.pop("decoded_vs_baseline")
    return {**est, "expected_tau": result["alpha"]["expected_tau"], "vs_temperature_1": vs_one}
