"""Phase `report`: the curve's JSON and plot, the fitted τ(data), the best DSpark drafter exported."""
from __future__ import annotations

import json
from pathlib import Path

from recipes.learning_curve.profiles import REPO, CurveProfile, log
from recipes.learning_curve.shared import (capacity_drafters, epoch_drafters, epoch_mode, train_sets,
                                         trained_drafters)
from recipes.learning_curve.measure import DECODE_TEMPERATURES, decode_modes

# ---------------------------------------------------------------- report
def summarize_decode(records: list[dict], temperature: float = 1.0) -> dict:
    """Per mode at one temperature: τ pooled over prompts (accepted + rounds) / rounds with a prompt
    bootstrap CI, per benchmark τ, tokens/s over all prompts, speedup vs target-only on the same prompts."""
    import numpy as np

    from dspark.eval.acceptance_estimate import bootstrap_ratio

    by_mode: dict[str, list[dict]] = {}
    for r in records:
        if r.get("temperature", 1.0) == temperature:
            by_mode.setdefault(r["mode"], []).append(r)
    common = set.intersection(*[{(r["benchmark"], r["index"]) for r in rs} for rs in by_mode.values()]) \
        if by_mode else set()

    def speed(rs):
        rs = [r for r in rs if (r["benchmark"], r["index"]) in common]
        return sum(r["tokens"] for r in rs) / max(sum(r["wall_s"] for r in rs), 1e-9), len(rs)

    base, _ = speed(by_mode.get("target", []))
    out = {}
    for mode, rs in by_mode.items():
        tps, n = speed(rs)
        entry = {"prompts": n, "tokens_per_s_batch1": tps, "speedup_batch1": tps / base if base else None}
        if mode != "target":
            num = np.array([r["accepted"] + r["rounds"] for r in rs], float)
            den = np.array([r["rounds"] for r in rs], float)
            entry["tau"] = float(num.sum() / max(den.sum(), 1))
            entry["tau_ci95"] = list(bootstrap_ratio(num, den))
            entry["tau_per_benchmark"] = {
                b: float(sum(r["accepted"] + r["rounds"] for r in rs if r["benchmark"] == b)
                         / max(1, sum(r["rounds"] for r in rs if r["benchmark"] == b)))
                for b in sorted({r["benchmark"] for r in rs})}
        out[mode] = entry
    return out


def loglinear_fit(points: list[dict]) -> dict | None:
    """The planner's log-linear fit τ = a + b·ln(tokens) (dspark.eval.planner.fit_curve) over the points that
    have an expected τ, as the report's JSON; None with fewer than 2."""
    from dspark.eval.planner import fit_curve

    pts = [(p["rollout_tokens"], p["expected_tau"]) for p in points if p.get("expected_tau")]
    if len(pts) < 2:
        return None
    curve = fit_curve([t for t, _ in pts], [v for _, v in pts])
    return {"form": "tau = a + b * ln(rollout_tokens)", "a": curve.a, "b": curve.b, "points": len(pts)}


def cmd_report(args, prof: CurveProfile) -> dict:
    out = Path(args.out)
    points, baselines = [], {}
    folders = trained_drafters(out)
    largest = max((f.parent.name for f in folders), default=None)
    for folder in folders:
        train = json.loads((folder / "train.json").read_text())
        est_path = folder / "estimate.json"
        est = json.loads(est_path.read_text()) if est_path.exists() else {}
        entry = {"algo": train["algo"], "rollout_tokens": train["rollout_tokens"], "rows": train["rows"],
                 "expected_tau": est.get("alpha", {}).get("expected_tau"),
                 "expected_tau_ci95": est.get("alpha", {}).get("expected_tau_ci95"),
                 "expected_tau_iw": est.get("iw", {}).get("expected_tau"),
                 "expected_tau_iw_ci95": est.get("iw", {}).get("expected_tau_ci95"),
                 "acceptance_per_position": est.get("alpha", {}).get("acceptance_per_position"),
                 "expected_tau_per_benchmark": {g: v["expected_tau"] for g, v in est.get("alpha", {}).get("per_group", {}).items()},
                 "training": {k: train[k] for k in ("steps", "epochs", "batch_size", "trained_tokens", "wall_s",
                                                    "cpu_minutes", "tokens_per_s", "drafter_tflops_per_s", "mfu",
                                                    "anchors_per_seq", "draft_vocab_size", "draft_vocab_coverage")},
                 "drafter": {k: train.get(k) for k in ("num_layers", "lr", "init_from")}}
        if train["algo"] == "dspark":
            points.append(entry)
        if folder.parent.name == largest:
            baselines[train["algo"]] = entry
    decode_path = out / "decode" / "results.jsonl"
    records = [json.loads(x) for x in decode_path.read_text().splitlines()] if decode_path.exists() else []
    decode = summarize_decode(records, 1.0)
    decode_by_temperature = {f"t{t:g}": summarize_decode(records, t) for t in DECODE_TEMPERATURES}
    for algo, entry in baselines.items():
        d = decode.get(algo, {})
        entry.update(tau=d.get("tau"), tau_ci95=d.get("tau_ci95"), tau_per_benchmark=d.get("tau_per_benchmark"),
                     speedup_batch1=d.get("speedup_batch1"), tokens_per_s_batch1=d.get("tokens_per_s_batch1"),
                     decode_prompts=d.get("prompts"))
    points.sort(key=lambda p: p["rollout_tokens"])
    epochs_series = [epoch_entry(f) for f in epoch_drafters(out)]
    capacity_series = [capacity_entry(f) for f in capacity_drafters(out)]
    for entry in epochs_series + capacity_series:  # real decoding of the same drafter, where decode ran it
        for suffix in ("", "_g3", "_thr"):
            d = decode.get(entry["mode"] + suffix, {})
            entry["decoded" + suffix] = {k: d.get(k) for k in ("tau", "tau_ci95", "speedup_batch1", "prompts")}
    rollout_manifest = out / "rollouts-train" / "manifest.json"
    report = {
        "benchmark": "learning_curve", "profile": args.profile, "device": prof.device_label,
        "device_kind": prof.device,  # what `dspark plan` matches against rollout-throughput JSONs
        "target": prof.target, "temperature": 1.0, "gamma": prof.drafter["block_size"],
        "points_mode": points_mode(points),
        "estimator": "teacher-forced expected tau: 1 + sum_k prod_{j<=k} alpha_j, alpha = sum_x min(p, q) "
                     "(dspark/eval/acceptance_estimate.py); ci95 = prompt bootstrap",
        "points": points, "baselines": baselines,
        "epochs_series": epochs_series,  # the largest point trained for more passes (phase `epochs`)
        "capacity_series": capacity_series,  # layers x anchors at equal wall-clock (phase `capacity`)
        "training_sweep": json.loads((out / "sweep.json").read_text()) if (out / "sweep.json").exists() else None,
        "training_sweep_bf16": (json.loads((out / "sweep-bf16.json").read_text())
                                if (out / "sweep-bf16.json").exists() else None),
        "target_only": decode.get("target"), "fit": loglinear_fit(points),
        "decode": {"modes": {m: {"drafter": None if p is None else str(p.parent.relative_to(out)), "scheduler": sched}
                             for m, (p, sched) in decode_modes(out).items()},
                   "by_temperature": decode_by_temperature},
        "rollouts": json.loads(rollout_manifest.read_text()) if rollout_manifest.exists() else None,
        "extra_rollouts": {folder.name: json.loads((folder / "manifest.json").read_text())  # rollouts --extra-prompts
                           for folder, _ in train_sets(out)[1:] if (folder / "manifest.json").exists()},
        "train_rows": json.loads((out / "train-rows.json").read_text()) if (out / "train-rows.json").exists() else None,
        "rollout_log": prof.rollout_tokens_per_s_note,
        "decode_settings": {"prompts_per_benchmark": prof.decode_prompts,
                            "max_new_tokens": prof.decode_max_new_tokens, "batch": 1,
                            "scheduler": "fixed (baselines); see decode.modes for the DSpark variants",
                            "temperatures": list(DECODE_TEMPERATURES)},
    }
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    best = best_dspark(out, largest, points, epochs_series + capacity_series)
    if best is not None and not getattr(args, "no_drafter", False):  # the committed drafter: the best expected τ at the largest point (any epochs)
        report["drafter"] = {**export_bf16(best, results / f"drafter-{args.name}"),
                             "source": str(best.relative_to(out))}
    plot_path = results / f"{args.name}.png"
    plot_path.unlink(missing_ok=True)  # never leave a plot of an earlier report beside this JSON
    report["plot"] = plot_path.name if has_curve(report) else None
    if report["plot"]:
        plot_curve(report, plot_path)
    else:
        log("report: no curve points and no decoded baselines in this run: no plot (the JSON holds its series)")
    (results / f"{args.name}.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: report[k] for k in ("device", "points", "baselines", "fit")}, default=str))
    return report


def has_curve(report: dict) -> bool:
    """Whether the report has anything `plot` draws: curve points with an estimate, or decoded baselines.
    A run that only continued a drafter (phase `epochs`) has neither, and an empty plot would mislead."""
    return (any(p["expected_tau"] is not None for p in report["points"])
            or any(b.get("tau") is not None for b in report["baselines"].values()))


def points_mode(points: list[dict]) -> str:
    """How the curve's points were trained, from their train.json (not the profile: --point-epochs, --layers
    and --anchors change it)."""
    shapes = sorted({(p["training"]["epochs"], p["drafter"]["num_layers"], p["training"]["anchors_per_seq"],
                      p["drafter"]["lr"]) for p in points}, key=str)
    text = "; ".join(f"{e} epochs, {layers} layers, {a} anchors/seq, lr {lr}" for e, layers, a, lr in shapes)
    return f"same epochs per point ({text}), nested prefixes of the rollouts"


def best_dspark(out: Path, largest: str | None, points: list[dict], series: list[dict]) -> Path | None:
    """The DSpark drafter folder with the highest expected τ among the largest point (if the run trained
    points) and its epochs and capacity series."""
    best, best_tau = None, 0.0
    if largest and (out / "points" / largest / "dspark" / "drafter").exists():
        best, best_tau = out / "points" / largest / "dspark" / "drafter", (points[-1]["expected_tau"] if points else 0) or 0
    for e in series:
        if (e["expected_tau"] or 0) > best_tau:
            best_tau, best = e["expected_tau"], out / e["folder"] / "dspark" / "drafter"
    return best


def series_entry(folder: Path, keys: tuple[str, ...]) -> dict:
    """One drafter of a series beside the curve (epochs/<name>/dspark, capacity/<name>/dspark): `keys` of
    its train.json, its expected τ, final loss, folder and decode-mode name."""
    train = json.loads((folder / "train.json").read_text())
    est = json.loads((folder / "estimate.json").read_text()).get("alpha", {}) if (folder / "estimate.json").exists() else {}
    return {**{k: train.get(k) for k in keys},
            "expected_tau": est.get("expected_tau"), "expected_tau_ci95": est.get("expected_tau_ci95"),
            "acceptance_per_position": est.get("acceptance_per_position"),
            "final_loss": train.get("final_metrics", {}).get("loss"),
            "folder": f"{folder.parent.parent.name}/{folder.parent.name}", "mode": epoch_mode(folder)}


def epoch_entry(folder: Path) -> dict:
    """One drafter of the epochs series: passes over the largest point's rows -> expected τ."""
    entry = series_entry(folder, ("epochs", "lr", "init_from", "rollout_tokens", "steps", "trained_tokens",
                                  "wall_s", "tokens_per_s"))
    before = 0  # passes the drafter it continued had already made (over these rows)
    if entry["init_from"] and Path(entry["init_from"]).is_absolute():
        return {**entry, "total_epochs": None}  # continued a drafter trained elsewhere (other rows)
    if entry["init_from"]:
        before = json.loads((folder.parents[2] / entry["init_from"] / "dspark" / "train.json").read_text())["epochs"]
    return {**entry, "total_epochs": before + entry["epochs"]}


def capacity_entry(folder: Path) -> dict:
    """One drafter of the capacity series: a (layers, anchors) setting trained for a fixed wall-clock."""
    entry = series_entry(folder, ("num_layers", "anchors_per_seq", "budget_minutes", "probe_step_s", "threads",
                                  "steps", "epochs", "trained_tokens", "wall_s", "cpu_minutes", "tokens_per_s",
                                  "drafter_tflops_per_s", "mfu", "mfu_peak_tflops", "rollout_tokens", "precision",
                                  "planned_steps", "stopped_by"))
    checkpoint_bytes = sum(f.stat().st_size for f in (folder / "drafter").glob("*.safetensors"))
    return {**entry, "checkpoint_bytes_fp32": checkpoint_bytes}


def export_bf16(src: Path, dest: Path) -> dict:
    """The drafter as a bf16 checkpoint (its own weights + draft-vocabulary maps; the frozen target's
    embedding and LM head are never saved), loadable by path with dspark.drafters.load_drafter."""
    import torch

    from dspark.drafters import load_drafter, save_drafter

    drafter = load_drafter(str(src)).to(torch.bfloat16)
    save_drafter(drafter, str(dest))
    size = sum(f.stat().st_size for f in dest.iterdir())
    return {"path": str(dest.relative_to(REPO)) if dest.is_relative_to(REPO) else str(dest), "bytes": size,
            "params": sum(p.numel() for p in drafter.parameters())}


def plot_curve(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    pts = [p for p in report["points"] if p["expected_tau"] is not None]
    if pts:
        x = [p["rollout_tokens"] for p in pts]
        y = [p["expected_tau"] for p in pts]
        err = [[v - p["expected_tau_ci95"][0] for v, p in zip(y, pts)], [p["expected_tau_ci95"][1] - v for v, p in zip(y, pts)]]
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label="DSpark expected τ (95% CI)")
    markers = {"dflash": "s", "dflash_tv": "^", "eagle3": "D", "dspark": "*"}
    for algo, b in report["baselines"].items():
        if b.get("tau") is not None:
            lo, hi = b["tau_ci95"]
            ax.errorbar([b["rollout_tokens"] * (1.04 + 0.04 * list(markers).index(algo))], [b["tau"]],
                        yerr=[[b["tau"] - lo], [hi - b["tau"]]], marker=markers[algo], linestyle="none", capsize=3,
                        label=f"{algo} real τ (decoding)")
    fit = report.get("fit")
    if fit and pts:
        import numpy as np

        xs = np.geomspace(min(x), max(x) * 4, 50)
        ax.plot(xs, fit["a"] + fit["b"] * np.log(xs), "k:", lw=1, label="log-linear fit (dotted past data)")
    ax.set_xscale("log")
    ax.set_xlabel("rollout tokens (generated, training set)")
    ax.set_ylabel("τ (tokens per target step), temperature 1")
    ax.set_title(f"{report['target']} on {report['device']}: learning curve")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
