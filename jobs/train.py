"""Distributed drafter training: `python -m jobs.train --config configs/train/tiny-dspark.yaml [--set k=v ...]`.

The driver validates everything that can fail before training (config, rollouts, storage, MLflow),
creates the MLflow run once, saves the run record, config and DeepSpeed JSON beside the checkpoints
(dspark.io.storage.run_dir), runs a Ray Train `TorchTrainer` (workers: jobs.train_worker, DeepSpeed ZeRO, online target
features), then logs the drafter and registers it as an MLflow model version (its own alias only: the serving one
moves by `tracking.promote_to` or jobs.promote). Relaunching the same `run_name` + `checkpoint.storage_path`
resumes the run (checkpoints, DeepSpeed state and the MLflow run id from `<storage_path>/<run_name>/`).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from dspark.config import ConfigError, config_to_dict, dump_config, flatten
from dspark.io import tracking
from dspark.io.storage import StorageError
from dspark.io.storage.rollout_store import check_rollouts, parquet_paths
from dspark.io.storage.run_dir import RunDir, checkpoint_uri, copy_checkpoint_subdir
from dspark.io.tracking import TrackingError
from dspark.training.config import TrainJobConfig
from dspark.drafters.draft_vocab import DraftVocabPlan, count_parquet_frequencies
from dspark.training.plan import (TrainPlan, check_resume_matches, deepspeed_config, init_from_checkpoint,
                                  training_steps)


def check_target_spec(spec: str) -> None:
    """Fail in the driver, not in every worker, when the target cannot be found (reads its config only)."""
    from dspark.io import storage
    from dspark.models import builtin as models_builtin

    if spec in models_builtin.BUILTIN:
        return
    if storage.is_s3(spec):
        if not storage.exists(storage.join(spec, "config.json")):
            raise ConfigError(f"target {spec!r} holds no config.json; point `target` at a model directory")
        return
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(spec)
    except (OSError, ValueError) as err:
        raise ConfigError(f"cannot load target {spec!r} ({str(err).splitlines()[0]}); use 'tiny', 'smollm2-135m', "
                          f"a model directory, an s3:// copy or a hub name reachable from the cluster") from None


def resolve_init_from(cfg: TrainJobConfig) -> tuple[TrainJobConfig, str | None]:
    """With `init_from`: (cfg whose drafter architecture is the checkpoint's, the reference pinned to a
    version); see dspark.training.plan.init_from_checkpoint."""
    if not cfg.init_from:
        return cfg, None
    from dspark.drafters.checkpoint import read_checkpoint_config
    from dspark.io.drafter_source import local_dir, resolve_ref

    try:
        pinned = resolve_ref(cfg.init_from).uri
        saved = read_checkpoint_config(local_dir(pinned))["drafter_config"]
    except (ValueError, FileNotFoundError) as err:
        raise ConfigError(f"init_from {cfg.init_from!r}: {err}") from None
    return init_from_checkpoint(cfg, saved, pinned), pinned


# ----------------------------------------------------------------------------- run record / MLflow
def run_params(cfg: TrainJobConfig, num_rows: int, total_steps: int) -> dict:
    from dspark.io.tracking import lineage

    params = flatten(config_to_dict(cfg))
    params.update(lineage.package_versions())
    params.update({"git_sha": tracking.git_commit() or "unknown", "world_size": cfg.scaling.num_workers,
                   "grad_accum": cfg.grad_accum, "train_rows": num_rows, "total_steps": total_steps,
                   "precision": cfg.resolved_precision()})
    return params


def open_mlflow_run(cfg: TrainJobConfig, record: dict | None, params: dict) -> str | None:
    """The MLflow run of this training run: the recorded one on resume, else a new one (params and the
    rollouts it trains on logged once). System metrics are sampled on the workers (RankZeroLogger)."""
    from dspark.io.tracking import lineage

    if not cfg.tracking.enabled:
        return None
    run_id = record.get("mlflow_run_id") if record else None
    run_id = tracking.start_run(cfg.tracking.experiment, cfg.mlflow_run_name, run_id=run_id,
                                tags={"dspark.stage": "train", "dspark.algo": cfg.drafter.algo,
                                      "dspark.target": cfg.target})
    if record is None or not record.get("mlflow_run_id"):
        tracking.log_params(params)
        lineage.log_rollouts(cfg.data.rollouts, lineage.TRAINING)
    return run_id


# ----------------------------------------------------------------------------- driver
def worker_env() -> dict[str, str]:
    """Environment the workers need (tracking URI, object-store endpoint and credentials, caches)."""
    keys = ("MLFLOW_TRACKING_URI", "MLFLOW_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL", "DSPARK_S3_ENDPOINT",
            "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "DSPARK_CACHE", "HF_ENDPOINT", "HF_HOME",
            "TOKENIZERS_PARALLELISM", "MLFLOW_HTTP_REQUEST_MAX_RETRIES",
            "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "MLFLOW_SYSTEM_METRICS_SAMPLES_BEFORE_LOGGING")
    return {k: os.environ[k] for k in keys if k in os.environ}


def build_trainer(cfg: TrainJobConfig, loop_config: dict, dataset):
    """TorchTrainer: gloo on CPU, NCCL on GPU; checkpoints kept under <storage_path>/<run_name>."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from dspark.io import storage
    from jobs.train_worker import train_loop_per_worker

    sc = cfg.scaling
    resources = {"CPU": sc.cpus_per_worker, **sc.resources_per_worker}
    if sc.use_gpu:
        resources["GPU"] = sc.gpus_per_worker
    fs, path = storage.pyarrow_fs(cfg.checkpoint.storage_path)
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config=loop_config,
        torch_config=TorchConfig(backend="nccl" if sc.use_gpu else "gloo"),
        scaling_config=ScalingConfig(num_workers=sc.num_workers, use_gpu=sc.use_gpu,
                                     resources_per_worker=resources, placement_strategy=sc.placement_strategy),
        run_config=RunConfig(name=cfg.run_name, storage_path=path, storage_filesystem=fs,
                             checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.num_to_keep),
                             failure_config=FailureConfig(max_failures=cfg.checkpoint.max_failures)),
        datasets={"train": dataset},
    )


def read_rollouts(cfg: TrainJobConfig, files: list[str]):
    """Ray Dataset of the training rows, only the columns training needs."""
    import ray.data
    from ray.data.expressions import col

    ray.data.DataContext.get_current().enable_progress_bars = False  # the workers log training progress
    fs, paths = parquet_paths(files)
    ds = ray.data.read_parquet(paths, filesystem=fs)
    return ds.filter(expr=col("split") == cfg.data.split).select_columns(["input_ids", "loss_mask"])


def build_draft_vocab(cfg: TrainJobConfig, files: list[str], init_from: str | None = None) -> DraftVocabPlan:
    """With drafter.draft_vocab_size = N: the N most frequent supervised (loss_mask = 1) rollout tokens, ascending
    target ids for the workers' build_drafter (Eagle3's d2t/t2d); init_from keeps the drafter's own (its LM head)."""
    from dspark.drafters.checkpoint import saved_draft_ids
    from dspark.io.drafter_source import local_dir

    size = cfg.drafter.draft_vocab_size
    if size is None:
        return DraftVocabPlan()
    kept = saved_draft_ids(local_dir(init_from)) if init_from else None
    fs, paths = parquet_paths(files)
    try:
        counts = count_parquet_frequencies(paths, None, cfg.data.split, filesystem=fs)
        vocab = DraftVocabPlan.from_counts(counts, size, vocab_size=max(size, counts.numel()), kept=kept)
    except ValueError as err:
        raise ConfigError(f"cannot build the draft vocabulary (drafter.draft_vocab_size={size}) from rollouts "
                          f"{cfg.data.rollouts!r}: {err}") from None
    print(f"[train] draft vocabulary{'' if kept is None else f' (kept from {init_from})'}: {size} tokens cover "
          f"{vocab.coverage:.1%} of the {int(counts.sum())} supervised rollout tokens", file=sys.stderr)
    return vocab


@dataclass(frozen=True)
class AlreadyComplete:
    """prepare_run's answer for a run that has trained all its steps already."""

    total_steps: int
    mlflow_run_id: str | None


def prepare_run(cfg: TrainJobConfig, init_from: str | None = None) -> TrainPlan | AlreadyComplete:
    """Every check that can fail before training; returns the plan handed to the workers."""
    from dspark.io import storage

    from pipelines.ray_cluster import check_cpus_left

    check_cpus_left(cfg.scaling.num_workers, cfg.scaling.cpus_per_worker, "training workers",
                    "Ray Data to read the rollouts", "scaling.cpus_per_worker")
    run_dir = RunDir.of(cfg.checkpoint.storage_path, cfg.run_name)
    storage.check_writable(run_dir.uri)
    if cfg.tracking.enabled:
        tracking.check_reachable()
    check_target_spec(cfg.target)
    files, num_rows = check_rollouts(cfg.data.rollouts, cfg.data.split)
    total_steps, steps_per_epoch = training_steps(cfg, num_rows)
    vocab = build_draft_vocab(cfg, files, init_from)
    record = run_dir.read_record()
    if record:
        check_resume_matches(record, cfg)
        if record.get("completed_steps", 0) >= total_steps:
            return AlreadyComplete(total_steps, record.get("mlflow_run_id"))
        print(f"[train] resuming run {cfg.run_name!r} from {run_dir.uri}", file=sys.stderr)
    ds_config = deepspeed_config(cfg)
    run_id = open_mlflow_run(cfg, record, run_params(cfg, num_rows, total_steps))
    record = {**(record or {}), "run_name": cfg.run_name, "target": cfg.target,
              "drafter": config_to_dict(cfg.drafter), "mlflow_run_id": run_id,
              "mlflow_experiment": cfg.tracking.experiment, "num_workers": cfg.scaling.num_workers,
              "zero_stage": cfg.deepspeed.zero_stage, "launches": (record or {}).get("launches", 0) + 1}
    run_dir.write_record(record)
    run_dir.write_text("config.yaml", dump_config(cfg))
    run_dir.write_text("ds_config.json", json.dumps(ds_config, indent=2))
    return TrainPlan(total_steps=total_steps, steps_per_epoch=steps_per_epoch, train_rows=num_rows,
                     grad_accum=cfg.grad_accum, precision=cfg.resolved_precision(), ds_config=ds_config,
                     mlflow_run_id=run_id, launch=record["launches"], files=tuple(files), draft_vocab=vocab)


def finish_run(cfg: TrainJobConfig, plan: TrainPlan, result) -> dict:
    """Log the final drafter and the config, register the drafter with its engine exports attached
    (dspark.export.attach_exports), close the MLflow run."""
    from dspark import export
    from dspark.io.tracking import registry

    summary = {"run_name": cfg.run_name, "checkpoint": checkpoint_uri(cfg.checkpoint.storage_path, result.checkpoint),
               "metrics": dict(result.metrics or {}), "mlflow_run_id": plan.mlflow_run_id}
    if not cfg.tracking.enabled:
        return summary
    with tempfile.TemporaryDirectory() as tmp:
        drafter_dir = os.path.join(tmp, "drafter")
        copy_checkpoint_subdir(result.checkpoint, "drafter", drafter_dir)
        tracking.log_artifact(drafter_dir, "drafter")
        for name, text in (("config.yaml", dump_config(cfg)), ("ds_config.json", json.dumps(plan.ds_config, indent=2))):
            Path(tmp, name).write_text(text)
            tracking.log_artifact(os.path.join(tmp, name))
        version = register_drafter(plan.mlflow_run_id, cfg.registered_model_name, cfg.tracking.alias, drafter_dir,
                                   summary["metrics"])
        export.attach_exports(drafter_dir, plan.mlflow_run_id, cfg.registered_model_name, version, target=cfg.target)
    summary["registered_model"] = {"name": cfg.registered_model_name, "version": version, "alias": cfg.tracking.alias}
    if cfg.tracking.promote_to:  # an explicit promotion the user asked for (never the default)
        registry.promote(cfg.registered_model_name, version, cfg.tracking.promote_to,
                         f"jobs.train run {cfg.run_name}: tracking.promote_to (no evaluation)")
        summary["registered_model"]["promoted_to"] = cfg.tracking.promote_to
    tracking.set_tags({"dspark.registered_model": cfg.registered_model_name, "dspark.registered_version": version})
    tracking.end_run("FINISHED")
    return summary


def register_drafter(run_id: str, name: str, alias: str, drafter_dir: str, metrics: dict) -> str:
    """Log the drafter as an MLflow model and register it as a new version of `name` with `alias` only (training
    never moves the serving alias itself), tagged with what it is and its training-time expected τ; a failure
    keeps the trained drafter (checkpoint and run artifacts) and says how to register it."""
    from dspark.io.tracking import registry
    from dspark.io.tracking.drafter_model import drafter_version_tags

    tags = drafter_version_tags(drafter_dir, metrics.get("expected_accept_len"), "training expected_accept_len (teacher-forced)")
    try:
        return registry.publish_drafter(run_id, name, drafter_dir, [alias], description="dspark drafter (jobs.train)",
                                        tags=tags)
    except TrackingError as err:
        raise TrackingError(f"{err}; the drafter is logged under the run's 'drafter' artifacts — register it by "
                            f"hand or rerun the same run_name") from err


def run(cfg: TrainJobConfig) -> dict:
    """Train (or resume) one run; returns a summary (checkpoint URI, final metrics, MLflow ids)."""

    cfg, init_from = resolve_init_from(cfg)
    plan = prepare_run(cfg, init_from)
    if isinstance(plan, AlreadyComplete):
        print(f"[train] run {cfg.run_name!r} already completed {plan.total_steps} steps: nothing to do "
              f"(raise optim.max_steps or optim.epochs to continue it)", file=sys.stderr)
        return {"run_name": cfg.run_name, "already_complete": True,
                "mlflow_run_id": plan.mlflow_run_id}
    if init_from:
        plan = replace(plan, init_from=init_from)
        if cfg.tracking.enabled:
            tracking.set_tags({"dspark.init_from": init_from})
    loop_config = {"job": config_to_dict(cfg), "plan": plan, "env": worker_env()}
    trainer = build_trainer(cfg, loop_config, read_rollouts(cfg, list(plan.files)))
    start = time.perf_counter()
    try:
        result = trainer.fit()
    except Exception:
        if cfg.tracking.enabled:
            tracking.end_run("FAILED")
        raise
    summary = finish_run(cfg, plan, result)
    run_dir = RunDir.of(cfg.checkpoint.storage_path, cfg.run_name)
    run_dir.write_record({**run_dir.read_record(), "completed_steps": int(summary["metrics"].get("step", 0))})
    summary["wall_s"] = round(time.perf_counter() - start, 1)
    return summary


def main(argv: list[str] | None = None) -> None:
    from jobs import common
    from pipelines.ray_cluster import init_ray

    cfg = common.load_job_config(TrainJobConfig, argv, "Train a drafter with Ray Train + DeepSpeed ZeRO.")
    try:
        init_ray(cfg.ray)
        summary = run(cfg)
    except (ConfigError, StorageError, TrackingError) as err:
        sys.exit(f"error: {err}")
    print(json.dumps(summary, default=str))


if __name__ == "__main__":
    main()
