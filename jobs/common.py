"""What every job entry point shares: the CLI, Ray start-up on loopback, config saving and MLflow runs.

    python -m jobs.X --config configs/x.yaml --set a.b=1 --set c=foo

A job's config model embeds `ray: RayConfig` and `tracking: TrackingConfig`; a job's main is then

    cfg = load_job_config(MyConfig, argv, "what the job does")
    init_ray(cfg.ray)
    with tracked_run(cfg.tracking, cfg, run_name="...") as run_id:
        ...
"""
from __future__ import annotations

from pydantic import Field

import argparse
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, TypeVar

from dspark.config import ConfigError, StrictModel, config_to_dict, dump_config, load_config

M = TypeVar("M", bound=StrictModel)

# Ray on one machine must bind to loopback (PLATFORM-NOTES); set before Ray starts any process.
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0", "DS_ACCELERATOR": "cpu"}


class RayConfig(StrictModel):
    address: str | None = Field(None, description="None: $RAY_ADDRESS if set, else start a (new) local Ray on 127.0.0.1")
    num_cpus: int | None = Field(None, description="CPUs of a local Ray (ignored when connecting to a cluster)")
    num_gpus: int | None = Field(None, description="GPUs of a local Ray")


class TrackingConfig(StrictModel):
    enabled: bool = Field(True, description="log to MLflow (MLFLOW_TRACKING_URI, else the local store under .dspark/mlruns)")
    experiment: str = Field("dspark", description="MLflow experiment")
    run_name: str | None = Field(None, description="None: the job picks one")


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
        return load_config(model, args.config, args.overrides)
    except ConfigError as err:
        sys.exit(f"error: {err}")


def loopback_env() -> None:
    for key, value in LOOPBACK_ENV.items():
        os.environ.setdefault(key, value)


def _is_loopback(address: str) -> bool:
    host = address.split("://")[-1].rsplit(":", 1)[0]
    return host in ("127.0.0.1", "localhost", "::1", "[::1]")


def _cluster_address(cfg: RayConfig) -> str | None:
    address = cfg.address or os.environ.get("RAY_ADDRESS") or None
    if address and address.startswith(("http://", "https://")):
        # a dashboard address (what `ray job submit` wants); a driver needs the cluster (GCS) address
        address = os.environ.get("DSPARK_RAY_GCS_ADDRESS")
        if not address:
            raise ValueError(f"RAY_ADDRESS={os.environ.get('RAY_ADDRESS')} is a dashboard URL; submit with "
                             f"`ray job submit ... -- python -m jobs.<stage>` or set ray.address=HOST:PORT (GCS)")
    return address


def init_ray(cfg: RayConfig) -> str:
    """Connect to `cfg.address` / $RAY_ADDRESS, or start a local Ray bound to 127.0.0.1.
    Returns the address used ("local" for a new local instance). Idempotent."""
    address = _cluster_address(cfg)
    on_this_machine = address is None or _is_loopback(address)
    if on_this_machine:
        loopback_env()
    import ray
    import ray._private.ray_constants as ray_constants

    if on_this_machine and os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == "0":
        # Ray reads this flag at import; if ray was imported before we set it, a driver would
        # rewrite 127.0.0.1 into the VM's address and never reach a loopback-bound cluster.
        ray_constants.ENABLE_RAY_CLUSTER = False
    if ray.is_initialized():
        return address or "local"
    _refresh_ray_auth()
    if address:
        if Path.home().joinpath(".ray", "auth_token").exists():
            os.environ.setdefault("RAY_AUTH_MODE", "token")
        ray.init(address=address, log_to_driver=True)
        return address
    # address="local": always a new instance. With address=None Ray would look for a running one
    # (/tmp/ray/ray_current_cluster) and, with two clusters on the machine, warn "Found multiple
    # active Ray instances" and attach to the newest, which need not be this job's.
    ray.init(address="local", num_cpus=cfg.num_cpus, num_gpus=cfg.num_gpus, include_dashboard=False,
             _node_ip_address="127.0.0.1", log_to_driver=True)
    return "local"


def _refresh_ray_auth() -> None:
    """Ray caches its auth mode and token at first use in a process; re-read them from the current
    env (RAY_AUTH_MODE / RAY_AUTH_TOKEN_PATH) so a process can join a stack set up after that."""
    try:
        from ray._private.authentication.authentication_token_setup import AuthenticationTokenLoader, Config
    except ImportError:  # another Ray version: nothing cached the way 2.60 does
        return
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


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
