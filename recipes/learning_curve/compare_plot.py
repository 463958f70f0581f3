"""The figure of a `compare` run: each drafter's expected τ with its 95 % interval, the renewal estimate of
decoding's τ beside it where the run used every anchor, and the paired difference to the baseline as text
(the paired interval is far narrower than the two τ intervals: the same prompts resampled jointly)."""
from __future__ import annotations

from pathlib import Path


def plot_compare(report: dict, labels: list[str], path: Path) -> None:
    """Draw `report` (cmd_compare's JSON) into `path`, one row per drafter, the baseline on top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(report["drafters"].values())
    fig, ax = plt.subplots(figsize=(8.0, 1.6 + 0.55 * len(rows)))
    for y, row in enumerate(rows):
        tau, (lo, hi) = row["expected_tau"], row["expected_tau_ci95"]
        ax.errorbar([tau], [y], xerr=[[tau - lo], [hi - tau]], fmt="o", color="C0", capsize=3,
                    label="expected τ (per anchor)" if y == 0 else None)
        if row.get("decoded_tau_estimate") is not None:
            dec, (dlo, dhi) = row["decoded_tau_estimate"], row["decoded_tau_estimate_ci95"]
            ax.errorbar([dec], [y + 0.18], xerr=[[dec - dlo], [dhi - dec]], fmt="s", color="C1", capsize=3,
                        label="decoding's τ (renewal estimate)" if y == 0 else None)
        for key, dy, color in (("vs_baseline", 0.0, "C0"), ("decoded_vs_baseline", 0.18, "C1")):
            d = row.get(key)
            if d is not None:
                ax.annotate(f"{d['difference']:+.3f} [{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}]", (1.0, y + dy),
                            xycoords=("axes fraction", "data"), xytext=(4, -3), textcoords="offset points",
                            fontsize=7, color=color)
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    setting = report["setting"]
    gammas = sorted(set(setting["gamma"].values()))
    ax.set_xlabel(f"τ at temperature 1, γ {'/'.join(map(str, gammas))}"
                  + (f", first {setting['answer_tokens']} answer tokens" if setting.get("answer_tokens") else "")
                  + f"; {report['held_out_rows']} held-out rows\ntext: the paired difference to the top row [95 %]")
    ax.grid(alpha=0.3, axis="x")
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.legend(fontsize=7, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
