"""Dataset lineage and provenance for the jobs, on top of dspark.io.tracking.

- `log_rollouts`, `log_prompt_sources`, `log_benchmarks`: record what a run read or wrote as MLflow
  dataset inputs (tracking.log_dataset_input: name, source URI, digest, context).
- `write_runtime_env`: a launcher's Ray runtime env with the submitting checkout's commit
  (DSPARK_GIT_COMMIT), so a job whose uploaded working_dir has no .git still records its source.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterable

import yaml

from dspark.io import storage, tracking


# Contexts used by the jobs (MLflow's `mlflow.data.context` input tag).
PROMPTS, GENERATED, TRAINING, EVALUATION, CALIBRATION = "prompts", "generated", "training", "evaluation", "calibration"


def rollouts_digest(uri: str) -> str | None:
    """Digest of a jobs.generate output from its manifest.json (plan fingerprint = prompts +
    settings, the committed shards, the row count) without reading the Parquet data; None when
    there is no manifest (then log_dataset_input reads the files)."""
    try:
        manifest = json.loads(storage.read_text(storage.join(uri, "manifest.json")))
    except (FileNotFoundError, ValueError):
        return None
    key = {"plan": manifest.get("plan", {}).get("fingerprint"), "shards": sorted(manifest.get("shards", [])),
           "rows_out": manifest.get("counts", {}).get("rows_out"), "complete": manifest.get("complete")}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


def log_rollouts(uri: str, context: str, name: str = "rollouts") -> str | None:
    """Log a rollouts dataset (local dir or s3:// prefix) as an input of the current run."""
    return tracking.log_dataset_input(name, uri, rollouts_digest(uri), context)


def log_prompt_sources(sources: Iterable, context: str = PROMPTS) -> None:
    """Log each prompt source (dspark.data.prompts.PromptSource: uri, optional name) of a run."""
    for source in sources:
        name = source.name or source.uri.rstrip("/").rsplit("/", 1)[-1]
        tracking.log_dataset_input(name, source.uri, None, context)


def log_benchmarks(benchmarks: Iterable, context: str = EVALUATION) -> None:
    """Log each loaded evaluation set (dspark.eval.benchmark_files.Benchmark: name, source) of a run."""
    for bench in benchmarks:
        tracking.log_dataset_input(bench.name, bench.source, None, context)


def write_runtime_env(base: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Copy the runtime env YAML `base` to `out` with env_vars.DSPARK_GIT_COMMIT set to this
    checkout's commit (when known). Returns `out`."""
    data = yaml.safe_load(Path(base).read_text()) or {}
    data["env_vars"] = {**(data.get("env_vars") or {}), **tracking.submission_env()}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


def package_versions(names: tuple[str, ...] = ("dspark", "torch", "ray", "deepspeed", "transformers", "mlflow",
                                               "pyarrow")) -> dict[str, str]:
    """{"version.<package>": installed version or "not-installed"}, logged as run params."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in names:
        try:
            out[f"version.{name}"] = version(name)
        except PackageNotFoundError:
            out[f"version.{name}"] = "not-installed"
    return out

