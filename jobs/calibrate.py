"""Calibrate a DSpark drafter's confidence head with Sequential Temperature Scaling (paper §3.2.1).

    python -m jobs.calibrate --config configs/calibrate/tiny.yaml [--set drafter=models:/x@champion ...]

1. Decode held-out prompts (rows with split == "holdout" of a jobs.generate output, or a
   {"turns": [...]} JSONL file) with real speculative decoding, every draft verified, the drafter's
   calibration switched off: each round gives raw confidences c_1..c_γ and its accepted length.
2. Fit T_1..T_γ left to right (dspark.eval.calibrate.fit_sts: ECE of the cumulative product).
3. Save a NEW drafter checkpoint with the temperatures under `output`/drafter (the source is never
   written), log it to MLflow and, when the source is a registered model (or `registered_model` is
   set), register it as a new version with `aliases`.
4. Report per position: ECE before/after, ROC-AUC, Brier, temperature (report.json, report.md,
   reliability diagrams as PNG), printed as a Markdown table.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import tempfile

import numpy as np
from pydantic import Field, field_validator, model_validator

from dspark.eval import calibrate as cal
from dspark.eval import evaluate as ev
from dspark.eval import metrics
from dspark.config import ModelAlias, ModelRef, StrictModel
from pipelines.ray_cluster import init_ray
from jobs.common import job_main, tracked_run
from dspark.config import RayConfig, TrackingConfig
from pipelines.eval_decode import WorkersConfig, decode_items, worker_spec

log = logging.getLogger("dspark.calibrate")
DRAFTER_NAME = "drafter"


class CalibrationData(StrictModel):
    rollouts: str | None = Field(None, description="a jobs.generate output (local dir or s3:// prefix)")
    split: str = Field("holdout", description="rollout rows used (never the training split)")
    prompts: str | None = Field(None, description='or a {"turns": [...]} JSONL file (local or s3://)')
    max_prompts: int | None = Field(64, description="held-out prompts decoded at most")

    @model_validator(mode="after")
    def _one_source(self) -> "CalibrationData":
        if (self.rollouts is None) == (self.prompts is None):
            raise ValueError("set exactly one of data.rollouts (a jobs.generate output) or data.prompts (a JSONL file)")
        return self


class CalibrateConfig(StrictModel):
    target: str = Field("tiny", description='target model: "tiny" | "smollm2-135m" | local dir | s3:// dir | hub name')
    drafter: ModelRef = Field(description="local dir | s3:// | runs:/<run_id>/<path> | models:/<name>/<version> | models:/<name>@<alias>")
    data: CalibrationData = Field(description="held-out prompts: rollouts or a JSONL file")
    seed: int = Field(0, description="base seed of the decoding generators")
    decode: ev.DecodeSettings = Field(ev.DecodeSettings(), description="sampling while collecting calibration rounds (every position verified)")
    n_bins: int = Field(15, description="equal-width ECE bins")
    min_rounds: int = Field(100, description="fewer calibration rounds than this -> a warning (noisy temperatures)")
    output: str = Field("results/calibrate", description="report + the new drafter under <output>/drafter (local or s3://)")
    registered_model: str | None = Field(None, description="register under this name; None -> the source's name if models:/")
    aliases: list[ModelAlias] = Field(default_factory=lambda: ["calibrated"], description="aliases moved to the new registered version (only these; the serving alias moves through jobs.promote)")
    workers: WorkersConfig = Field(default_factory=WorkersConfig, description="the decoding actor pool")
    ray: RayConfig = Field(default_factory=RayConfig, description="Ray cluster to use")
    tracking: TrackingConfig = Field(TrackingConfig(experiment="dspark-calibrate"), description="MLflow")

    @field_validator("decode")
    @classmethod
    def _full_block(cls, value: ev.DecodeSettings) -> ev.DecodeSettings:
        if value.gamma is not None:
            raise ValueError("decode.gamma must stay null: temperatures are fitted for every position of the "
                             "drafter's block (block_size)")
        return value


# ---- held-out prompts ------------------------------------------------------------------------------
def rollout_prompts(uri: str, split: str) -> list[tuple[str | None, list[str]]]:
    """(system, user turns) of every rollout row in `split`."""
    from dspark.io.storage.rollout_store import read_rollouts

    rows = read_rollouts(uri).to_pylist()
    if not rows:
        raise FileNotFoundError(f"no committed rollout rows under {uri}; run jobs.generate first")
    prompts = []
    for row in rows:
        if row["split"] != split:
            continue
        system = next((m["content"] for m in row["messages"] if m["role"] == "system"), None)
        turns = [m["content"] for m in row["messages"] if m["role"] == "user"]
        if turns:
            prompts.append((system, turns))
    if not prompts:
        raise ValueError(f"rollouts {uri} have no rows with split == {split!r}; regenerate them with "
                         f"holdout_fraction > 0 or point data.prompts at a held-out JSONL file")
    return prompts


def calibration_prompts(data: CalibrationData) -> list[tuple[str | None, list[str]]]:
    if data.rollouts:
        prompts = rollout_prompts(data.rollouts, data.split)
    else:
        from dspark.io import storage

        try:
            text = storage.read_text(data.prompts)
        except FileNotFoundError:
            raise FileNotFoundError(f"calibration prompts file not found: {data.prompts}") from None
        prompts = [(None, turns) for turns in ev.parse_benchmark(text, data.prompts)]
    return prompts[: data.max_prompts]


# ---- fitting and the report ---------------------------------------------------------------------------
def fit(rounds, n_bins: int) -> tuple[cal.STSResult, dict]:
    """STS on raw-confidence rounds; also the per-position (raw, calibrated) prefix-survival arrays."""
    conf, accepted, verified = cal.rounds_to_arrays(rounds)
    result = cal.fit_sts(conf, accepted, verified, n_bins=n_bins)
    raw = np.cumprod(conf, axis=1)  # a_k = Π_{i≤k} c_i
    calibrated = np.cumprod(cal.apply_sts(conf, result.temperatures), axis=1)
    curves = {}
    for k in range(1, conf.shape[1] + 1):
        rows = verified >= k
        label = (accepted[rows] >= k).astype(float)
        curves[k] = {"before": (raw[rows, k - 1], label), "after": (calibrated[rows, k - 1], label)}
    return result, curves


def report_rows(result: cal.STSResult) -> list[dict]:
    keys = ("k", "n", "temperature", "survival", "ece_before", "ece_after", "auc_after", "cond_auc",
            "brier_before", "brier_after")
    return [{key: p[key] for key in keys} for p in result.positions]


def json_safe(value):
    """NaN/inf (e.g. ROC-AUC of a position with one class only) -> None, so the JSON stays standard."""
    if isinstance(value, float):
        return value if np.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def write_report(result: cal.STSResult, curves: dict, info: dict, out_dir: str, n_bins: int) -> dict[str, str]:
    """report.json, report.md and reliability_k{k}.png in a local dir; returns {name: path}."""
    rows = report_rows(result)
    report = {**info, "temperatures": result.temperatures, "positions": result.positions, "summary": result.summary()}
    md = "\n\n".join([f"## STS calibration of {info['source']}",
                      metrics.markdown_table(rows, floatfmt=".3f"),
                      metrics.markdown_table([{k: v for k, v in report["summary"].items()}], floatfmt=".4f")])
    paths = {"report.json": os.path.join(out_dir, "report.json"), "report.md": os.path.join(out_dir, "report.md")}
    with open(paths["report.json"], "w") as f:
        json.dump(json_safe(report), f, indent=2)
    with open(paths["report.md"], "w") as f:
        f.write(md + "\n")
    for k, pair in curves.items():
        if len(pair["before"][1]):
            name = f"reliability_k{k}.png"
            paths[name] = cal.write_reliability_diagram(os.path.join(out_dir, name), pair, n_bins,
                                                        title=f"prefix survival, position {k}")
    return paths


# ---- the new drafter version ----------------------------------------------------------------------------
def log_report(paths: dict[str, str], result: cal.STSResult, n_rounds: int) -> None:
    from dspark.io import tracking

    for name, path in paths.items():
        tracking.log_artifact(path, "reliability" if name.endswith(".png") else None)
    keys = ("temperature", "ece_before", "ece_after", "auc_after", "brier_before", "brier_after")
    tracking.log_metrics({f"{key}.k{p['k']}": p[key] for p in result.positions for key in keys})
    tracking.log_metrics({f"mean.{k}": v for k, v in result.summary().items()} | {"rounds": n_rounds})


def publish_drafter(drafter, new_uri: str, tmp: str, run_id: str | None, model_name: str | None,
                    aliases: list[str], source: str, tau: float | None = None) -> dict | None:
    """Save the calibrated drafter to `new_uri`, log it to the run and register it (with its engine
    exports attached); returns the registration."""
    from dspark import export
    from dspark.io import storage
    from dspark.drafters import save_drafter

    saved = save_drafter(drafter, os.path.join(tmp, DRAFTER_NAME))  # kept locally: the run logs it too
    storage.upload_dir(saved, new_uri)  # local dir or s3://
    if not run_id:
        if model_name:
            log.warning("tracking is disabled: the calibrated drafter was not registered as %s", model_name)
        return None
    from dspark.io import tracking
    from dspark.io.tracking import registry

    tracking.log_artifact(saved, DRAFTER_NAME)
    version = None
    if model_name:
        from dspark.io.tracking.drafter_model import drafter_version_tags

        version = registry.publish_drafter(run_id, model_name, saved, aliases,
                                           description=f"STS-calibrated from {source}",
                                           tags=drafter_version_tags(saved, tau, "calibration decode (mean accepted + 1)"))
    export.attach_exports(drafter, run_id, model_name, version)  # engine layouts, tagged on the version
    return {"name": model_name, "aliases": aliases, "version": version} if model_name else None


def log_calibration_data(data: CalibrationData) -> None:
    """The calibration set as an MLflow dataset input of the run (lineage)."""
    from dspark.io import tracking
    from dspark.io.tracking import lineage

    if data.rollouts:
        lineage.log_rollouts(data.rollouts, lineage.CALIBRATION, name=f"rollouts[{data.split}]")
    else:
        name = data.prompts.rstrip("/").rsplit("/", 1)[-1]
        tracking.log_dataset_input(name, data.prompts, None, lineage.CALIBRATION)


def run(cfg: CalibrateConfig) -> dict:
    from dspark.io import storage
    from dspark.io.drafter_source import load_drafter_ref, local_dir, resolve_ref
    from dspark.models.target import load_target

    storage.check_writable(cfg.output)
    new_uri = storage.join(cfg.output, DRAFTER_NAME)
    pinned = resolve_ref(cfg.drafter)  # an alias resolves once: the report names the exact source version
    if not storage.is_s3(new_uri) and os.path.realpath(new_uri) == os.path.realpath(local_dir(pinned)):
        raise ValueError(f"output {cfg.output} would overwrite the source drafter; choose another output")
    drafter = load_drafter_ref(pinned.uri, load_target(cfg.target, local_copy=storage.local_copy))
    if not drafter.has_confidences:
        raise ValueError(f"drafter {cfg.drafter} ({drafter.config.algo}) has no confidence head; STS calibrates "
                         f"DSpark drafters built with confidence_head=true")
    prompts = calibration_prompts(cfg.data)
    items = [{"benchmark": "calibration", "index": i, "turns": turns, "system": system,
              "modes": [ev.Mode(DRAFTER_NAME)]} for i, (system, turns) in enumerate(prompts)]
    spec = worker_spec(cfg.target, {DRAFTER_NAME: pinned.uri}, cfg.decode, cfg.seed, cfg.workers, raw_confidences=True)
    model_name = cfg.registered_model or (pinned.model_name if pinned.kind == "model" else None)
    with tracked_run(cfg.tracking, cfg, f"calibrate-{cfg.target}") as run_id:
        if run_id:
            log_calibration_data(cfg.data)
        if cfg.workers.num_workers:
            init_ray(cfg.ray)
        convs = decode_items(items, spec, cfg.workers, desc="calibration prompts")
        rounds = [r for c in convs if c.error is None for t in c.turns for r in t.rounds]
        if len(rounds) < cfg.min_rounds:
            log.warning("only %d calibration rounds (< min_rounds=%d): temperatures will be noisy; add held-out "
                        "prompts or raise decode.max_new_tokens", len(rounds), cfg.min_rounds)
        result, curves = fit(rounds, cfg.n_bins)
        drafter.calibration = [float(t) for t in result.temperatures]
        info = {"source": cfg.drafter, "source_pinned": pinned.uri, "calibrated_drafter": new_uri,
                "prompts": len(prompts), "rounds": len(rounds), "failed_prompts": [c.error for c in convs if c.error],
                "mlflow_run_id": run_id}
        with tempfile.TemporaryDirectory(prefix="dspark-calib-") as tmp:
            info["registered"] = publish_drafter(drafter, new_uri, tmp, run_id, model_name, cfg.aliases, pinned.uri,
                                                 metrics.summarize(rounds)["tau"] if rounds else None)
            paths = write_report(result, curves, info, tmp, cfg.n_bins)
            for name, path in paths.items():
                with open(path, "rb") as f:
                    storage.write_bytes(storage.join(cfg.output, name), f.read())
            if run_id:
                log_report(paths, result, len(rounds))
    print(metrics.markdown_table(report_rows(result), floatfmt=".3f"))
    print(json.dumps(json_safe({"calibrated_drafter": new_uri, "registered": info["registered"], **result.summary()})))
    return json_safe({**info, "temperatures": result.temperatures, "positions": result.positions,
                      "summary": result.summary()})


def main(argv: list[str] | None = None) -> int:
    return job_main(CalibrateConfig, run, argv, "Fit STS temperatures of a DSpark drafter's confidence head.",
                    log_info=True)


if __name__ == "__main__":
    sys.exit(main())
