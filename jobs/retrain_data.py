"""The flywheel's training set: `python -m jobs.retrain_data --set flywheel_output=s3://... --set output=s3://...`.

Reads every replica's committed capture shards under `flywheel_output/capture/`, mixes their train
rows with the original rollouts (`capture_fraction` of the result is captured traffic), writes a
rollout store jobs.train reads (`data.rollouts: <output>`), and writes the captured hold-out prompts
as per-domain benchmark files (`<output>/heldout/<domain>.jsonl`) for jobs.promote's evaluation.
Prints a JSON summary as its last line.
"""
from __future__ import annotations

import sys

from pydantic import Field

from dspark.config import StrictModel, TrackingConfig
from jobs.common import job_main, the_result, tracked_run


class RetrainDataConfig(StrictModel):
    flywheel_output: str = Field(description="the serve config's flywheel.output (captures under capture/)")
    original_rollouts: str | None = Field(None, description="the drafter's original rollouts (jobs.generate output); None: captured traffic only")
    capture_fraction: float = Field(0.5, gt=0, le=1, description="share of captured rows in the training set (all captured train rows are used)")
    output: str = Field(description="where the mixed training set is written (local dir or s3:// prefix)")
    max_heldout_per_domain: int | None = Field(64, ge=1, description="captured hold-out prompts per domain written as evaluation benchmarks")
    seed: int = Field(0, description="which original rows are drawn")
    tracking: TrackingConfig = Field(TrackingConfig(experiment="dspark-flywheel"), description="MLflow")


def run(cfg: RetrainDataConfig) -> dict:
    from dspark.flywheel import retrain_data as mix
    from dspark.flywheel.capture import unclosed_writers
    from dspark.data.schema import ROLLOUT_SCHEMA
    from dspark.io import storage

    storage.check_writable(cfg.output)
    captured = mix.load_captures(cfg.flywheel_output)
    if captured.num_rows == 0:
        raise ValueError(f"no committed captures under {cfg.flywheel_output}/capture/: enable flywheel.capture on "
                         f"the endpoint (and let traffic flow) first")
    original = mix.read_original(cfg.original_rollouts) if cfg.original_rollouts else ROLLOUT_SCHEMA.empty_table()
    table, counts = mix.mix(captured, original, cfg.capture_fraction, cfg.seed)
    heldout = mix.write_heldout_benchmarks(storage.join(cfg.output, "heldout"), captured, cfg.max_heldout_per_domain)
    unclosed = unclosed_writers(cfg.flywheel_output)  # replicas still serving, or killed with rows queued
    if unclosed:
        print(f"capture writers never closed (still serving, or killed): {sum(w['pending'] for w in unclosed.values())} "
              f"rows were pending at their last window and may be lost: {unclosed}", flush=True)
    info = {"source": "flywheel", "flywheel_output": cfg.flywheel_output, "original_rollouts": cfg.original_rollouts,
            **counts, "captured_total": captured.num_rows, "heldout": heldout,
            "capture_pending_unclosed": sum(w["pending"] for w in unclosed.values())}
    mix.write_training_set(cfg.output, table, info)
    with tracked_run(cfg.tracking, cfg, "retrain-data", tags={"dspark.stage": "retrain_data"}) as run_id:
        if run_id:
            from dspark.io import tracking

            tracking.log_metrics({k: v for k, v in counts.items() if isinstance(v, (int, float))})
            tracking.log_dict(info, "retrain_data.json")
    return {**info, "rollouts": cfg.output, "mlflow_run_id": run_id}


def main(argv: list[str] | None = None) -> int:
    return job_main(RetrainDataConfig, run, argv, "Mix captured traffic with the original rollouts for retraining.",
                    summary=the_result)


if __name__ == "__main__":
    sys.exit(main())
