"""Where MLflow runs go, without importing MLflow: the tracking URI (MLFLOW_TRACKING_URI, else a local
SQLite store under `<state dir>/mlruns/`), whether it is a local store, a fail-fast reachability
check of a tracking server, and the experiment a run is created in (through a given MlflowClient).
dspark.io.tracking (the one module that imports MLflow) builds on these."""
from __future__ import annotations

import os
import urllib.error
import urllib.request
from pathlib import Path


class TrackingError(RuntimeError):
    """MLflow cannot be used; the message names the cause and the fix."""


def local_store_dir() -> Path:
    from dspark.settings import settings

    return settings().absolute_state_dir / "mlruns"


def tracking_uri() -> str:
    """MLFLOW_TRACKING_URI, or the local SQLite store under .dspark/mlruns."""
    uri = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    if uri:
        return uri
    store = local_store_dir()
    store.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{store / 'mlflow.db'}"


def is_local_store(uri: str) -> bool:
    return not uri.startswith(("http://", "https://", "databricks"))


def check_reachable(timeout_s: float = 5.0) -> str:
    """Fail fast when the tracking server does not answer; returns the tracking URI."""
    uri = tracking_uri()
    if is_local_store(uri):
        return uri
    health = uri.rstrip("/") + "/health"
    try:
        with urllib.request.urlopen(health, timeout=timeout_s) as resp:
            if resp.status == 200:
                return uri
            cause = f"HTTP {resp.status}"
    except urllib.error.HTTPError as err:
        cause = f"HTTP {err.code}"
    except (urllib.error.URLError, OSError) as err:
        cause = str(getattr(err, "reason", err))
    raise TrackingError(f"MLflow tracking server {uri} is unreachable ({cause}); start it with "
                        f"`dspark stack up` and `source .dspark/env.sh`, or unset MLFLOW_TRACKING_URI "
                        f"to log to {local_store_dir()}")


def ensure_experiment(client, name: str) -> str:
    """The id of experiment `name` (created if missing; in the local store, with its artifacts under
    .dspark/mlruns/artifacts). `client`: an MlflowClient of the current tracking URI."""
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    location = (local_store_dir() / "artifacts" / name).as_uri() if is_local_store(tracking_uri()) else None
    try:
        return client.create_experiment(name, artifact_location=location)
    except Exception as err:  # noqa: BLE001 - created concurrently by another process
        if getattr(err, "error_code", None) != "RESOURCE_ALREADY_EXISTS":
            raise
        return client.get_experiment_by_name(name).experiment_id
