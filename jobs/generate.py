"""Generate rollouts: the target's own answers to a prompt set, as a resumable Ray Data job.

    python -m jobs.generate --config configs/generate/tiny.yaml [--set sampling.seed=1 ...]
    ray job submit --working-dir . -- python -m jobs.generate --config configs/generate/smollm2-135m.yaml

Runs against the Ray cluster in $RAY_ADDRESS (or `ray.address`), else a local Ray on 127.0.0.1.
Rerunning the same command resumes an interrupted run (and continues its MLflow run).
The output layout and row schema are documented in dspark/data/schema.py.
"""
from __future__ import annotations

import sys
import tempfile
from collections import Counter
from pathlib import Path

from pydantic import Field

from dspark.eval import report
from dspark.config import RayConfig, TrackingConfig
from jobs.common import job_main, resumable_stage_run
from pipelines.generate import RolloutConfig, RolloutResult, run_rollouts
from dspark.io.storage.rollout_store import read_rollouts


class GenerateConfig(RolloutConfig):
    ray: RayConfig = RayConfig()
    tracking: TrackingConfig = TrackingConfig(experiment="dspark-generate")
    sample_rows: int = Field(16, description="rows in the MLflow sample table")


def sample_table(output_uri: str, n: int) -> dict:
    """A few rows as columns (MLflow table-artifact layout): prompt, answer, counts."""
    rows = read_rollouts(output_uri).slice(0, n).to_pylist()
    first = lambda r, role: next((m["content"] for m in r["messages"] if m["role"] == role), "")  # noqa: E731
    return {"columns": ["prompt_id", "split", "domain", "prompt", "answer", "num_turns", "num_generated_tokens",
                        "finish_reason"],
            "data": [[r["prompt_id"], r["split"], r["domain"], first(r, "user")[:500], first(r, "assistant")[:500],
                      r["num_turns"], r["num_generated_tokens"], r["finish_reason"]] for r in rows]}


def rollout_plots(output_uri: str, directory: Path) -> list[str]:
    """Histograms of prompt and answer lengths (tokens) per domain, and the finish reasons."""
    table = read_rollouts(output_uri).select(["domain", "num_prompt_tokens", "num_generated_tokens",
                                               "finish_reason"]).to_pylist()
    prompts: dict[str, list[int]] = {}
    answers: dict[str, list[int]] = {}
    for row in table:
        prompts.setdefault(row["domain"] or "(none)", []).append(row["num_prompt_tokens"])
        answers.setdefault(row["domain"] or "(none)", []).append(row["num_generated_tokens"])
    reasons = Counter(row["finish_reason"] for row in table)
    return [report.plot_histogram(prompts, str(directory / "prompt_lengths.png"), "prompt length by domain",
                                  "prompt tokens", "rollouts"),
            report.plot_histogram(answers, str(directory / "answer_lengths.png"), "answer length by domain",
                                  "generated tokens", "rollouts"),
            report.plot_counts(dict(reasons), str(directory / "finish_reasons.png"), "finish reasons", "rollouts")]


def final_metrics(result: RolloutResult) -> dict:
    m, s = result.manifest, result.stats
    metrics = {"rows_in": m["counts"]["records_read"], "unique_prompts": m["counts"]["unique_prompts"],
               "duplicates": m["counts"]["duplicates"], "rows_out": m["counts"]["rows_out"],
               "errors": m["counts"]["errors"], "tokens_generated": m["tokens"]["generated"],
               "tokens_prompt": m["tokens"]["prompt"], "tokens_generated_this_run": s.generated_tokens,
               "tokens_per_s": s.tokens_per_s, "generation_wall_s": s.wall_s, "chunks_skipped": s.chunks_skipped}
    metrics.update({f"errors.{reason}": n for reason, n in m["errors_by_reason"].items()})
    return metrics


def run(cfg: GenerateConfig) -> RolloutResult:
    out = cfg.output.rstrip("/")
    from dspark.io import tracking
    from dspark.io.tracking import lineage

    with resumable_stage_run(cfg, "generate") as stage_run:
        run_id = stage_run.run_id
        if run_id:
            lineage.log_prompt_sources(cfg.sources, lineage.PROMPTS)
        result = run_rollouts(cfg, on_chunk=stage_run.on_chunk, on_start=stage_run.on_start)
        if run_id:
            lineage.log_rollouts(out, lineage.GENERATED)
            tracking.log_metrics(final_metrics(result), step=result.stats.chunks_total)
            tracking.log_dict(result.manifest, "manifest.json")
            tracking.log_dict(sample_table(out, cfg.sample_rows), "samples.json")
            with tempfile.TemporaryDirectory() as tmp:
                for path in rollout_plots(out, Path(tmp)):
                    tracking.log_artifact(path, "plots")
    return result


def run_summary(cfg: GenerateConfig, result: RolloutResult) -> dict:
    m = result.manifest
    return {"output": cfg.output, "rows_out": m["counts"]["rows_out"], "errors": m["counts"]["errors"],
            "errors_by_reason": m["errors_by_reason"], "tokens_generated": m["tokens"]["generated"],
            "tokens_per_s": round(result.stats.tokens_per_s, 2), "chunks_skipped": result.stats.chunks_skipped,
            "complete": m["complete"]}


def main(argv: list[str] | None = None) -> int:
    return job_main(GenerateConfig, run, argv, "Generate target rollouts for drafter training (Ray Data).",
                    summary=run_summary)


if __name__ == "__main__":
    sys.exit(main())
