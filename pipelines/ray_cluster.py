"""Connecting to Ray the way every job does: the address given (or $RAY_ADDRESS / the local stack's
GCS address), else a new local Ray bound to 127.0.0.1 — never an auto-detected cluster, so two Ray
clusters on one machine cannot be confused ("Found multiple active Ray instances")."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from dspark.config import ConfigError, RayConfig
from dspark.devstack.config import LOCAL_RAY_ENV


def loopback_env() -> None:
    """Set before Ray starts any process: a Ray on this machine binds to loopback (LOCAL_RAY_ENV)."""
    for key, value in LOCAL_RAY_ENV.items():
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
    except ImportError:  # another Ray version (tests/unit/pipelines/test_private_ray_names.py fails on it first)
        return
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def check_cpus_left(workers: int, cpus_per_worker: float, who: str, beside: str, knob: str) -> None:
    """Refuse up front when `workers` × `cpus_per_worker` take every CPU of the connected cluster: the
    work that must run beside them (`beside`, e.g. a Ray Data read) would never start and the job would
    wait forever. No-op when Ray is not started in this process."""
    if "ray" not in sys.modules:  # importing Ray here would freeze its auth settings
        return
    import ray

    if not ray.is_initialized():
        return
    total = ray.cluster_resources().get("CPU", 0.0)
    taken = workers * cpus_per_worker
    if total and total - taken < 0.5:
        raise ConfigError(f"the {who} take {taken:g} of the cluster's {total:g} CPUs, leaving none for {beside}; "
                          f"lower {knob} (e.g. {max(0.25, (total - 1) / workers):g}) or add CPUs")
