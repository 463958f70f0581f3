"""Evaluate drafters with real speculative decoding on benchmark prompts (paper §4.1, Table 1, Fig. 5).

    python -m jobs.evaluate --config configs/evaluate/tiny.yaml [--set decode.max_new_tokens=64 ...]
    python -m jobs.evaluate --config configs/evaluate/smollm2-135m.yaml \
        --set 'drafters=[{ref: "models:/drafter-dspark@champion"}, {ref: "runs:/<id>/drafter", name: dflash}]'

Each prompt is decoded target-only (the speedup baseline) and with every drafter, on the same worker
back to back; prompts are spread over a pool of Ray actors (`workers.num_workers`, 0 = in this
process). Every (prompt, mode) has its own generator seeded from (seed, benchmark, prompt index),
so tokens and τ are the same whatever the number of workers. Outputs under `output`: results.json,
report.md, samples.jsonl and PNG plots; the same plus metrics go to MLflow. The Markdown report is
printed to stdout.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time
from typing import Literal, Sequence

from pydantic import Field, field_validator

from dspark.eval import evaluate as ev
from dspark.eval import report
from dspark.config import ModelRef, StrictModel, config_to_dict
from pipelines.ray_cluster import init_ray
from jobs.common import job_main, tracked_run
from dspark.config import RayConfig, TrackingConfig
from pipelines.eval_decode import WorkersConfig, decode_items, worker_spec

log = logging.getLogger("dspark.evaluate")


# ---- config ---------------------------------------------------------------------------------------
class DrafterEntry(StrictModel):
    ref: ModelRef = Field(description="local dir | s3:// | runs:/<run_id>/<path> | models:/<name>/<version> | models:/<name>@<alias>")
    name: str | None = Field(None, description="label in tables and metrics; default: the drafter's algo")


class SweepConfig(StrictModel):
    """Static confidence-threshold sweep (paper Fig. 5) for drafters with a confidence head."""
    enabled: bool = Field(False, description="run the static-threshold sweep (extra decoding per threshold)")
    thresholds: list[float] = Field(ev.DEFAULT_THRESHOLDS, description="confidence thresholds tried")
    threshold_on: Literal["prefix", "confidence"] = Field("prefix", description="threshold a_k = Π c_i (prefix) or c_k")
    max_prompts_per_benchmark: int | None = Field(4, description="the sweep decodes each prompt once per threshold")
    drafters: list[str] | None = Field(None, description="names; None = every drafter with a confidence head")


class EvalConfig(StrictModel):
    target: str = Field("tiny", description='target model: "tiny" | "smollm2-135m" | local dir | s3:// dir | hub name')
    drafters: list[DrafterEntry] = Field(description="drafters to compare: references (local dir, s3://, runs:/, models:/) with optional names")
    benchmark_dir: str | None = Field("data/eval", description="base of relative benchmark paths (local dir or s3:// prefix)")
    benchmarks: list[ev.BenchmarkSpec] = Field(
        default_factory=lambda: [ev.BenchmarkSpec(path=f"{b}.jsonl", domain=d) for b, d in
                                 (("gsm8k", "math"), ("humaneval", "code"), ("mt-bench", "chat"))],
        description='benchmark JSONL files ({"turns": [...]} per line) and their domains')
    max_prompts_per_benchmark: int | None = Field(None, description="sample cap (the first N prompts of each file)")
    seed: int = Field(0, description="base seed; each (prompt, mode) gets its own generator derived from it")
    decode: ev.DecodeSettings = Field(ev.DecodeSettings(), description="sampling and decoding settings (temperature 1: the paper's protocol)")
    baseline: bool = Field(True, description="target-only decoding of the same prompts, for the speedup column")
    compare_reference: str | None = Field(None, description="numerator of the ratios; default: the first dspark drafter")
    threshold_sweep: SweepConfig = Field(default_factory=SweepConfig, description="paper Fig. 5: static confidence thresholds")
    output: str = Field("results/eval", description="local dir or s3:// prefix")
    workers: WorkersConfig = Field(default_factory=WorkersConfig, description="the decoding actor pool")
    ray: RayConfig = Field(default_factory=RayConfig, description="Ray cluster to use")
    tracking: TrackingConfig = Field(TrackingConfig(experiment="dspark-eval"), description="MLflow")

    @field_validator("drafters", mode="before")
    @classmethod
    def _refs(cls, value):
        """Accept bare references: drafters: [path1, "models:/x@champion"]."""
        if isinstance(value, (str, dict)):
            value = [value]
        return [{"ref": v} if isinstance(v, str) else v for v in value or []]

    @field_validator("drafters")
    @classmethod
    def _some(cls, value):
        if not value:
            raise ValueError("give at least one drafter: drafters: [{ref: <dir | s3:// | runs:/ | models:/>}]")
        return value


# ---- drafters: validate on the driver ---------------------------------------------------------------
def load_drafter_infos(entries: Sequence[DrafterEntry], target) -> dict[str, dict]:
    """Resolve and load every drafter once against the target (fail fast, all problems in one error).
    Returns {name: {ref (pinned), algo, block_size, calibrated, confidence_head, source}}."""
    from dspark.io.drafter_source import load_drafter_ref, resolve_ref

    infos, problems = {}, []
    for entry in entries:
        try:
            pinned = resolve_ref(entry.ref).uri  # an alias resolves once, so every worker loads the same version
            drafter = load_drafter_ref(pinned, target)
        except (ValueError, FileNotFoundError, OSError) as err:
            problems.append(str(err))
            continue
        name = entry.name or drafter.config.algo
        base, copy = name, 2
        while name in infos:  # two drafters of one algo: dspark, dspark-2, ...
            name, copy = f"{base}-{copy}", copy + 1
        infos[name] = {"ref": pinned, "source": entry.ref, "algo": drafter.config.algo,
                       "block_size": drafter.config.block_size, "num_layers": drafter.config.depth,
                       "calibrated": drafter.calibration is not None,
                       "confidence_head": drafter.has_confidences}
    if problems:
        raise ValueError("cannot evaluate: " + " | ".join(problems))
    return infos


# ---- work items and workers -------------------------------------------------------------------------
def plan_items(benchmarks: Sequence[ev.Benchmark], drafter_names: Sequence[str], baseline: bool,
               sweep: dict[str, list[float]], sweep_cap: int | None) -> list[dict]:
    """One item per prompt: its turns and the modes to decode it in."""
    base = ([ev.Mode()] if baseline else []) + [ev.Mode(name) for name in drafter_names]
    items = []
    for bench in benchmarks:
        for index, turns in enumerate(bench.prompts):
            modes = list(base)
            if sweep_cap is None or index < sweep_cap:
                modes += [ev.Mode(name, t) for name, ts in sweep.items() for t in ts]
            items.append({"benchmark": bench.name, "index": index, "turns": turns, "modes": modes})
    return items


# ---- outputs ----------------------------------------------------------------------------------------
def flat_metrics(results: dict) -> dict[str, float]:
    """MLflow metrics: tau/speedup/... per drafter and benchmark or domain, ratios, target tokens/s."""
    out = {}
    for name, block in results["drafters"].items():
        for level in ("per_benchmark", "per_domain"):
            for key, summary in block[level].items():
                for metric in ("tau", "speedup", "decode_tokens_per_s", "mean_proposal_len"):
                    out[f"{name}.{key}.{metric}"] = summary.get(metric)
                for k, value in (summary.get("cond_accept") or {}).items():
                    out[f"{name}.{key}.cond_accept.{k}"] = value
        for metric in ("tau", "speedup"):
            out[f"{name}.mean.{metric}"] = block["overall"].get(metric)
    for ratio, block in results["ratios"].items():
        for level in ("per_benchmark", "per_domain"):
            for key, values in block[level].items():
                out.update({f"{ratio}.{key}.{m}": v for m, v in values.items()})
    for bench, summary in results["target_only"]["per_benchmark"].items():
        out[f"target.{bench}.decode_tokens_per_s"] = summary.get("decode_tokens_per_s")
    return {k: v for k, v in out.items() if isinstance(v, (int, float))}


def position_series(results: dict) -> dict[str, dict[int, float]]:
    """Acceptance by draft position as MLflow step series (x = position k, so the UI plots a curve):
    `<drafter>.<benchmark|domain|pooled>.{cond_accept,prefix_survival}_by_position`."""
    out = {}
    for name, block in results["drafters"].items():
        groups = {**block["per_benchmark"], **block["per_domain"], "pooled": block.get("pooled_positions", {})}
        for key, summary in groups.items():
            for curve in ("cond_accept", "prefix_survival"):
                points = {int(k): v for k, v in (summary.get(curve) or {}).items() if isinstance(v, (int, float))}
                if points:
                    out[f"{name}.{key}.{curve}_by_position"] = points
    return out


def write_outputs(results: dict, convs: list, report_md: str, out_dir: str) -> dict[str, str]:
    """results.json, report.md, samples.jsonl and the PNG plots in a local dir; returns {name: path}."""
    files = {"results.json": json.dumps(results, indent=2, default=str), "report.md": report_md + "\n",
             "samples.jsonl": "".join(json.dumps(r) + "\n" for r in ev.sample_records(convs))}
    paths = {}
    for name, text in files.items():
        paths[name] = os.path.join(out_dir, name)
        with open(paths[name], "w") as f:
            f.write(text)
    plots = {"tau_by_benchmark.png": lambda path: report.plot_tau_by_benchmark(results, path),
             "cond_accept_by_position.png": lambda path: report.plot_cond_accept(results, path)}
    if results.get("threshold_sweep"):
        plots["threshold_sweep.png"] = lambda path: report.plot_threshold_sweep(results["threshold_sweep"], path)
    for name, plot in plots.items():
        paths[name] = plot(os.path.join(out_dir, name))
    return paths


def publish(paths: dict[str, str], output: str, run_id: str | None) -> None:
    """Copy the local outputs to `output` (local or s3://) and log them to the MLflow run."""
    from dspark.io import storage

    for name, path in paths.items():
        with open(path, "rb") as f:
            storage.write_bytes(storage.join(output, name), f.read())
    if run_id:
        from dspark.io import tracking

        for name, path in paths.items():
            tracking.log_artifact(path, "plots" if name.endswith(".png") else None)


# ---- the job ----------------------------------------------------------------------------------------
def sweep_plan(cfg: EvalConfig, infos: dict[str, dict]) -> dict[str, list[float]]:
    if not cfg.threshold_sweep.enabled:
        return {}
    names = cfg.threshold_sweep.drafters or [n for n, i in infos.items() if i["confidence_head"]]
    unknown = [n for n in names if n not in infos]
    if unknown:
        raise ValueError(f"threshold_sweep.drafters {unknown} are not among the drafters {list(infos)}")
    no_head = [n for n in names if not infos[n]["confidence_head"]]
    if no_head:
        raise ValueError(f"threshold_sweep needs a confidence head; drafters {no_head} have none")
    if not names:
        log.warning("threshold sweep skipped: no drafter has a confidence head")
    return {n: sorted(set(cfg.threshold_sweep.thresholds)) for n in names}


def run(cfg: EvalConfig) -> dict:
    from dspark.io import storage
    from dspark.models.target import load_target

    storage.check_writable(cfg.output)  # fail fast, before any decoding
    benchmarks, problems = ev.load_benchmarks(cfg.benchmarks, cfg.benchmark_dir, cfg.max_prompts_per_benchmark,
                                              read_text=storage.read_text)
    target = load_target(cfg.target, local_copy=storage.local_copy)
    infos = load_drafter_infos(cfg.drafters, target)
    del target  # the workers load their own
    sweep = sweep_plan(cfg, infos)
    items = plan_items(benchmarks, list(infos), cfg.baseline, sweep, cfg.threshold_sweep.max_prompts_per_benchmark)
    spec = worker_spec(cfg.target, {n: i["ref"] for n, i in infos.items()}, cfg.decode, cfg.seed, cfg.workers,
                       threshold_on=cfg.threshold_sweep.threshold_on)
    run_name = cfg.tracking.run_name or f"eval-{'-'.join(infos)}"
    with tracked_run(cfg.tracking, cfg, run_name) as run_id:
        start = time.perf_counter()
        if cfg.workers.num_workers:
            init_ray(cfg.ray)
        convs = decode_items(items, spec, cfg.workers)
        sweep_modes = [ev.Mode(n, t) for n, ts in sweep.items() for t in ts]
        results = ev.aggregate(convs, benchmarks, {n: i["algo"] for n, i in infos.items()},
                               cfg.compare_reference, sweep_modes)
        results["warnings"] = problems + results["warnings"]
        results.update(target=cfg.target, drafters_info=infos, config=config_to_dict(cfg),
                       wall_s=time.perf_counter() - start, mlflow_run_id=run_id)
        sp = cfg.decode.sampling()
        report_md = report.markdown_report(results, title=(
            f"{cfg.target}: {', '.join(infos)} — temperature {sp.temperature:g}, "
            f"γ {cfg.decode.gamma or 'block size'}, ≤{cfg.decode.max_new_tokens} new tokens per turn, "
            f"seed {cfg.seed}"))
        with tempfile.TemporaryDirectory(prefix="dspark-eval-") as tmp:
            publish(write_outputs(results, convs, report_md, tmp), cfg.output, run_id)
        if run_id:
            from dspark.io import tracking
            from dspark.io.tracking import lineage

            tracking.log_metrics(flat_metrics(results))
            for key, series in position_series(results).items():
                tracking.log_series(key, series)
            lineage.log_benchmarks(benchmarks, lineage.EVALUATION)
            tracking.set_tags({"drafters": ",".join(f"{n}={i['source']}" for n, i in infos.items()),
                               "target": cfg.target})
    for warning in results["warnings"]:
        log.warning(warning)
    print(report_md)
    return results


def main(argv: list[str] | None = None) -> int:
    return job_main(EvalConfig, run, argv, "Evaluate drafters by real speculative decoding on benchmark prompts.",
                    log_info=True)


if __name__ == "__main__":
    sys.exit(main())
