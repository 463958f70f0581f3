"""Build a prompt corpus: user turns written by the target (Magpie) and/or real datasets, filtered
(length, degenerate text, decontamination, exact and near duplicates), as a resumable Ray Data job.

    python -m jobs.synthesize --config configs/synthesize/tiny.yaml [--set magpie.num_prompts=100 ...]
    ray job submit --working-dir . -- python -m jobs.synthesize --config configs/synthesize/smollm2-135m.yaml

The output directory is a prompt source for jobs.generate: `sources: [{uri: <output>}]`.
Rerunning the same command resumes an interrupted run (and continues its MLflow run).
Layout and row schema: pipelines/synthesize.py.
"""
from __future__ import annotations

import hashlib
import sys
import tempfile
from pathlib import Path

from pydantic import Field

from dspark.eval import report
from dspark.config import RayConfig, TrackingConfig
from jobs.common import job_main, resumable_stage_run
from dspark.data.magpie import DROP_REASONS
from pipelines.synthesize import (SynthesisResult, SynthesizeConfig, eval_files_text, read_prompts,
                                  run_synthesis)



class SynthesizeJobConfig(SynthesizeConfig):
    ray: RayConfig = RayConfig()
    tracking: TrackingConfig = TrackingConfig(experiment="dspark-synthesize")
    sample_rows: int = Field(16, description="rows in the MLflow sample table")


def final_metrics(result: SynthesisResult) -> dict:
    counts = result.manifest["counts"]
    metrics = {"candidates": counts["candidates"], "kept": counts["kept"], "load_errors": counts["load_errors"],
               "records_read": counts["records_read"], "magpie_generated": counts["magpie_generated"],
               "generated_tokens_this_run": result.stats.generated_tokens, "tokens_per_s": result.stats.tokens_per_s}
    metrics.update({f"dropped.{reason}": n for reason, n in counts["dropped"].items()})
    metrics.update({f"kept_by_domain.{d}": n for d, n in counts["kept_by_domain"].items()})
    return metrics


def length_plots(result: SynthesisResult, directory: Path) -> list[str]:
    """Histograms of prompt length (characters): kept prompts per domain; kept vs dropped per reason."""
    kept: dict[str, list[int]] = {}
    for c in result.outcome.kept:
        kept.setdefault(c.domain or "(none)", []).append(sum(len(t) for t in c.turns))
    dropped: dict[str, list[int]] = {}
    for d in result.outcome.dropped:
        dropped.setdefault(d["reason"], []).append(sum(len(t) for t in d["turns"]))
    everything = {"kept": [n for v in kept.values() for n in v], **dropped}
    return [report.plot_histogram(kept, str(directory / "kept_lengths_by_domain.png"), "kept prompts by domain",
                                  "characters per prompt", "prompts"),
            report.plot_histogram(everything, str(directory / "lengths_kept_vs_dropped.png"),
                                  "kept and dropped prompts (by reason)", "characters per prompt", "prompts")]


def sample_table(output_uri: str, n: int) -> dict:
    rows = read_prompts(output_uri).slice(0, n).to_pylist()
    return {"columns": ["prompt_id", "domain", "source", "prompt"],
            "data": [[r["prompt_id"], r["domain"], r["source"], r["turns"][0][:500]] for r in rows]}


def log_lineage(cfg: SynthesizeConfig, result: SynthesisResult) -> None:
    """mlflow.log_input for every prompt source, every evaluation file and the output itself."""
    from dspark.io import tracking

    for label, info in result.source_digests.items():
        tracking.log_dataset_input(label, info["uri"], info["digest"], context="prompt_source")
    for uri, text in eval_files_text(cfg.eval_files).items():
        tracking.log_dataset_input(Path(uri).name, uri, hashlib.sha256(text.encode()).hexdigest(),
                                   context="decontamination")
    tracking.log_dataset_input(f"prompts-{Path(cfg.output.rstrip('/')).name}", cfg.output,
                               result.manifest["digest"], context="synthesized_prompts")


def run(cfg: SynthesizeJobConfig) -> SynthesisResult:
    out = cfg.output.rstrip("/")
    from dspark.io import tracking

    with resumable_stage_run(cfg, "synthesize") as stage_run:
        run_id = stage_run.run_id
        result = run_synthesis(cfg, on_chunk=stage_run.on_chunk, on_start=stage_run.on_start)
        if run_id:
            tracking.log_metrics(final_metrics(result), step=result.stats.chunks_total)
            tracking.log_dict(result.manifest, "manifest.json")
            tracking.log_dict(sample_table(out, cfg.sample_rows), "samples.json")
            with tempfile.TemporaryDirectory() as tmp:
                for path in length_plots(result, Path(tmp)):
                    tracking.log_artifact(path, "plots")
            log_lineage(cfg, result)
    return result


def summary(result: SynthesisResult, output: str) -> dict:
    counts = result.manifest["counts"]
    return {"output": output, "candidates": counts["candidates"], "kept": counts["kept"],
            "dropped": {r: counts["dropped"][r] for r in DROP_REASONS}, "kept_by_domain": counts["kept_by_domain"],
            "load_errors": counts["load_errors"], "errors_by_reason": result.manifest["errors_by_reason"],
            "chunks_skipped": result.stats.chunks_skipped, "complete": result.manifest["complete"]}


def main(argv: list[str] | None = None) -> int:
    return job_main(SynthesizeJobConfig, run, argv, "Build a filtered prompt corpus (Magpie and/or datasets).",
                    summary=lambda cfg, result: summary(result, cfg.output))


if __name__ == "__main__":
    sys.exit(main())
