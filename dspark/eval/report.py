"""Reports: Markdown tables and plots of evaluation results, and the plain-text tables the demo prints.

Pure rendering: every function takes the JSON-able result dicts that `dspark.eval.evaluate.aggregate`
(or the demo summary) produces and returns text or writes a PNG; nothing here computes a metric.
"""
from __future__ import annotations

from dspark.eval import metrics
from dspark.eval.evaluate import macro_average


# ---- evaluation report ----------------------------------------------------------------------
def _benchmarks_and_domains(results: dict) -> tuple[list[str], list[str]]:
    return list(results["benchmarks"]), list(results["domains"])


def _metric_row(label: str, block: dict, metric: str, benches: list[str], domains: list[str]) -> dict:
    row = {"": label}
    row.update({b: block["per_benchmark"].get(b, {}).get(metric) for b in benches})
    row.update({f"{d} (macro)": block["per_domain"].get(d, {}).get(metric) for d in domains})
    row["mean"] = block.get("overall", {}).get(metric)
    return row


def markdown_report(results: dict, title: str = "") -> str:
    """Paper-Table-1 style Markdown: τ and speedup per benchmark and domain, ratios, acceptance by position."""
    benches, domains = _benchmarks_and_domains(results)
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




def plot_recipe(results: dict | None, curves: dict[str, list[dict]], path: str) -> str:
    """One figure for a recipe run: τ by benchmark (bars per drafter), conditional acceptance by draft
    position (pooled over benchmarks) and the training curves (E[accept length] on the training batches
    against training seconds). `results` is dspark.eval.evaluate.aggregate's dict, or None before evaluation."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    drafters = (results or {}).get("drafters") or {}
    benches = list((results or {}).get("benchmarks") or {})
    width = 0.8 / max(len(drafters), 1)
    for i, (name, block) in enumerate(drafters.items()):
        values = [block["per_benchmark"].get(b, {}).get("tau") or 0.0 for b in benches]
        axes[0].bar([x + i * width for x in range(len(benches))], values, width, label=name)
        curve = block.get("pooled_positions", {}).get("cond_accept", {})
        ks = sorted((int(k) for k, v in curve.items() if v is not None))
        axes[1].plot(ks, [curve.get(k, curve.get(str(k))) for k in ks], marker="o", label=name)
    axes[0].set_xticks([x + width * (len(drafters) - 1) / 2 for x in range(len(benches))], benches, fontsize=8)
    axes[0].set(ylabel="τ (tokens per verify round)", title="τ by benchmark")
    axes[1].set(xlabel="draft position k", ylabel="P(accept k | 1..k-1 accepted)", ylim=(0, 1.02),
                title="acceptance by position")
    for name, points in curves.items():
        axes[2].plot([p["seconds"] for p in points], [p.get("expected_accept_len") for p in points], marker=".",
                     label=name)
    axes[2].set(xlabel="training seconds", ylabel="E[accept length] (train batches)", title="training")
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    return _save(fig, path)


# ---- demo summary tables ---------------------------------------------------------------------------
def eval_tables(results: dict) -> tuple[dict, dict]:
    """(tau[drafter][benchmark], speedup[drafter][benchmark]) from jobs.evaluate's results.json, with
    the macro average over benchmarks as column "mean"."""
    taus: dict[str, dict] = {}
    speedups: dict[str, dict] = {}
    for name, block in (results.get("drafters") or {}).items():
        for bench, values in (block.get("per_benchmark") or {}).items():
            taus.setdefault(name, {})[bench] = values.get("tau")
            speedups.setdefault(name, {})[bench] = values.get("speedup")
        overall = block.get("overall") or {}
        taus.setdefault(name, {})["mean"] = overall.get("tau")
        speedups.setdefault(name, {})["mean"] = overall.get("speedup")
    return taus, speedups


def ratio_table(results: dict) -> dict[str, dict]:
    """tau ratios between drafters (e.g. dspark/dflash) per benchmark, from results.json."""
    table: dict[str, dict] = {}
    for ratio, block in (results.get("ratios") or {}).items():
        row = {bench: values.get("tau") for bench, values in (block.get("per_benchmark") or {}).items()}
        row["mean"] = (block.get("overall") or {}).get("tau")
        table[ratio] = row
    return table


def text_table(title: str, table: dict[str, dict]) -> str:
    """{row name: {column: number}} as fixed-width text (column "mean" last); "" for an empty table."""
    names = {b for row in table.values() for b in row}
    columns = sorted(names - {"mean"}) + (["mean"] if "mean" in names else [])
    if not columns:
        return ""
    lines = [title, f"  {'drafter':14s}" + "".join(f"{c:>12s}" for c in columns)]
    for name, row in table.items():
        cells = "".join(f"{row[c]:>12.2f}" if isinstance(row.get(c), (int, float)) else f"{'-':>12s}"
                        for c in columns)
        lines.append(f"  {name:14s}{cells}")
    return "\n".join(lines)


# ---- data plots (jobs.synthesize, jobs.generate) ---------------------------------------------------
def plot_histogram(series: dict[str, list[float]], path: str, title: str, xlabel: str, ylabel: str) -> str:
    """Stacked histogram of one or more named series (e.g. prompt lengths per domain)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    nonempty = {k: v for k, v in series.items() if v}
    if nonempty:
        ax.hist(list(nonempty.values()), bins=30, label=list(nonempty), stacked=True)
        ax.legend(fontsize=8)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    return _save(fig, path)


def plot_counts(counts: dict[str, int], path: str, title: str, ylabel: str) -> str:
    """Bars of named counts (e.g. finish reasons)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(1.5 + 1.0 * max(len(counts), 1), 3.4))
    bars = ax.bar(list(counts), list(counts.values()))
    ax.bar_label(bars, fontsize=8)
    ax.set(ylabel=ylabel, title=title)
    return _save(fig, path)

