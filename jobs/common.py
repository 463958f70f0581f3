"""What every job entry point shares: the CLI, config saving and MLflow runs (Ray start-up on loopback
is pipelines.ray_cluster.init_ray).

    python -m jobs.X --config configs/x.yaml --set a.b=1 --set c=foo

A job's config model embeds `ray: RayConfig` and `tracking: TrackingConfig`; its `run(cfg)` is then

    init_ray(cfg.ray)
    with tracked_run(cfg.tracking, cfg, run_name="...") as run_id:
        ...

and its `main` is `job_main(MyConfig, run, argv, "what the job does", summary=...)`.
"""
from __future__ import annotations

import argparse
import json
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, TypeVar

from dspark.config import ConfigError, StrictModel, TrackingConfig, config_to_dict, dump_config, load_config

M = TypeVar("M", bound=StrictModel)


def parse_args(description: str, argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", help="YAML config file (local path or s3:// URI)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, dotted keys, YAML values (repeatable): --set sampling.seed=3")
    return parser.parse_args(argv)


def load_job_config(model: type[M], argv: list[str] | None, description: str) -> M:
    """Parse `--config/--set` and validate; a bad config exits with its one-line message."""
    args = parse_args(description, argv)
    try:
        from dspark.io import storage

        return load_config(model, args.config, args.overrides, read_text=storage.read_text)
    except ConfigError as err:
        sys.exit(f"error: {err}")


def the_result(cfg, result):
    """job_main's `summary` for a job whose `run` returns its summary already."""
    return result


def job_main(model: type[M], run: Callable[[M], object], argv: list[str] | None, description: str,
             summary: Callable[[M, object], object] | None = None, log_info: bool = False) -> int:
    """A job's `main`: load the config, `run(cfg)`, print `summary(cfg, result)` as one JSON line (when
    given). An error the user can act on (bad input or config, storage or tracking unreachable, no
    workers) is one `error: ...` line on stderr and exit status 2, without a traceback."""
    from dspark.io.storage import StorageError
    from dspark.io.tracking import TrackingError
    from pipelines.actor_pool import WorkersUnavailable

    if log_info:
        import logging

        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    cfg = load_job_config(model, argv, description)
    try:
        result = run(cfg)
    except (ValueError, FileNotFoundError, TimeoutError, StorageError, TrackingError, WorkersUnavailable) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if summary is not None:
        print(json.dumps(summary(cfg, result), default=str), flush=True)
    return 0


def save_config(cfg: StrictModel, uri: str) -> None:
    """Write the resolved config as YAML to a local path or s3:// URI."""
    from dspark.io import storage

    storage.write_text(uri, dump_config(cfg))


@contextmanager
def tracked_run(tracking_cfg: TrackingConfig, cfg: StrictModel, run_name: str,
                run_id: str | None = None, tags: dict | None = None) -> Iterator[str | None]:
    """Start (or continue, given `run_id`) an MLflow run; log the flattened config as params and
    `config.yaml` as an artifact; end it FINISHED, or FAILED if the body raises. Yields the run id
    (None when tracking is disabled)."""
    if not tracking_cfg.enabled:
        yield None
        return
    from dspark.io import tracking

    tracking.check_reachable()
    run_id = tracking.start_run(tracking_cfg.experiment, tracking_cfg.run_name or run_name, run_id=run_id, tags=tags)
    tracking.log_params(config_to_dict(cfg))  # flattened to dotted keys
    tracking.log_text(dump_config(cfg), "config.yaml")
    try:
        yield run_id
    except BaseException:
        tracking.end_run("FAILED")
        raise
    tracking.end_run("FINISHED")


# ---- resumable output-writing stages (jobs.generate, jobs.synthesize) ----------------------------
RUN_ID_FILE = "_state/mlflow_run.json"  # inside the stage's output: a rerun continues the same MLflow run


@dataclass
class StageRun:
    """The MLflow side of a resumable stage: the run id (None without tracking) and the two hooks the
    stage calls — `on_start(output)` once the output holds the plan, `on_chunk(stats)` after every
    committed chunk."""

    run_id: str | None
    on_start: Callable[[str], None]
    on_chunk: Callable


@contextmanager
def resumable_stage_run(cfg, stage: str) -> Iterator[StageRun]:
    """tracked_run for a stage writing `cfg.output`: fails fast on an unwritable output (before Ray, MLflow
    or any generation), connects Ray, continues the run recorded in the output (a rerun after a kill
    logs into the same run), saves the config and the run id beside the output, and logs the stage's
    progress metrics after every chunk."""
    from dspark.io import storage, tracking
    from pipelines.ray_cluster import init_ray

    out = cfg.output.rstrip("/")
    storage.check_writable(out)
    init_ray(cfg.ray)
    try:
        previous = json.loads(storage.read_text(storage.join(out, RUN_ID_FILE))).get("run_id")
    except (FileNotFoundError, ValueError):
        previous = None
    run_name = f"{stage}-{cfg.target.rstrip('/').split('/')[-1]}"
    with tracked_run(cfg.tracking, cfg, run_name, run_id=previous) as run_id:
        def on_start(uri: str) -> None:
            save_config(cfg, storage.join(uri, "config.yaml"))
            if run_id:
                storage.write_text(storage.join(uri, RUN_ID_FILE), json.dumps({"run_id": run_id}))

        def on_chunk(stats) -> None:
            if run_id:
                tracking.log_metrics(stats.metrics(), step=stats.chunks_done + stats.chunks_skipped)

        yield StageRun(run_id, on_start, on_chunk)

