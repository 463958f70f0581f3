"""Thin MLflow wrapper that never kills a training run.

The tracking server comes from MLFLOW_TRACKING_URI; when unset, runs go to a local SQLite store
under `<repo>/.dspark/mlruns/` (mlflow.db + artifacts/; MLflow 3 refuses plain file stores).

Logging calls retry a transient failure a few times and then log a warning instead of raising,
so an MLflow hiccup mid-training costs a metric, not the run. `start_run` and `check_reachable`
do raise (TrackingError, one line with the fix): they run before any work is done.
"""
from __future__ import annotations

import logging
import math
import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable

from dspark.config import flatten

logger = logging.getLogger("dspark.tracking")

ATTEMPTS = 3
BACKOFF_S = 1.0
# Permanent MLflow errors: retrying cannot help.
# (RESOURCE_ALREADY_EXISTS is not among them: a retry finds an experiment created concurrently.)
PERMANENT_CODES = {"INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST",
                   "PERMISSION_DENIED", "INVALID_STATE", "BAD_REQUEST"}


class TrackingError(RuntimeError):
    """MLflow cannot be used; the message names the cause and the fix."""


# ---------------------------------------------------------------------------- configuration
def local_store_dir() -> Path:
    from dspark.stack import default_state_dir

    return default_state_dir() / "mlruns"


def tracking_uri() -> str:
    """MLFLOW_TRACKING_URI, or the local SQLite store under .dspark/mlruns."""
    uri = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    if uri:
        return uri
    store = local_store_dir()
    store.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{store / 'mlflow.db'}"


def _is_local_store(uri: str) -> bool:
    return not uri.startswith(("http://", "https://", "databricks"))


def _configure():
    """Point mlflow at our tracking URI with short HTTP retries (ours come on top)."""
    import mlflow

    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "60")
    uri = tracking_uri()
    if mlflow.get_tracking_uri() != uri:
        mlflow.set_tracking_uri(uri)
    return mlflow


def check_reachable(timeout_s: float = 5.0) -> str:
    """Fail fast when the tracking server does not answer; returns the tracking URI."""
    uri = tracking_uri()
    if _is_local_store(uri):
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


# ---------------------------------------------------------------------------- retries
def _is_permanent(err: Exception) -> bool:
    return getattr(err, "error_code", None) in PERMANENT_CODES


def _retry(what: str, fn: Callable[[], Any], raise_on_failure: bool = False) -> Any:
    """Call fn; retry transient errors ATTEMPTS times with backoff. On final failure log a warning
    and return None, or raise TrackingError when raise_on_failure."""
    for attempt in range(1, ATTEMPTS + 1):
        try:
            return fn()
        except Exception as err:  # noqa: BLE001 - MLflow raises many types for transient failures
            final = attempt == ATTEMPTS or _is_permanent(err)
            if not final:
                time.sleep(BACKOFF_S * 2 ** (attempt - 1))
                continue
            message = f"MLflow {what} failed after {attempt} attempt(s): {type(err).__name__}: {err}"
            if raise_on_failure:
                raise TrackingError(f"{message}; check the tracking server ({tracking_uri()})") from err
            logger.warning(message)
            return None


# ---------------------------------------------------------------------------- runs
def start_run(experiment: str, run_name: str | None = None, run_id: str | None = None,
              tags: dict | None = None) -> str:
    """Start (or, given run_id, resume) a run in `experiment` (created if missing); returns its id.
    Ends any run still active in this process first."""
    mlflow = _configure()

    def begin():
        if mlflow.active_run() is not None:
            if run_id and mlflow.active_run().info.run_id == run_id:
                return run_id
            mlflow.end_run()
        _ensure_experiment(mlflow, experiment)
        run = mlflow.start_run(run_id=run_id, run_name=None if run_id else run_name,
                               tags={k: str(v) for k, v in (tags or {}).items()} or None)
        return run.info.run_id

    return _retry(f"start_run({experiment!r})", begin, raise_on_failure=True)


def _ensure_experiment(mlflow, name: str) -> None:
    """Select `name`; in the local store, keep its artifacts under .dspark/mlruns/artifacts."""
    if _is_local_store(mlflow.get_tracking_uri()) and mlflow.get_experiment_by_name(name) is None:
        location = (local_store_dir() / "artifacts" / name).as_uri()
        try:
            mlflow.create_experiment(name, artifact_location=location)
        except Exception as err:  # noqa: BLE001 - created concurrently by another process
            if getattr(err, "error_code", None) != "RESOURCE_ALREADY_EXISTS":
                raise
    mlflow.set_experiment(name)


def active_run_id() -> str | None:
    import mlflow

    run = mlflow.active_run()
    return run.info.run_id if run else None


def end_run(status: str = "FINISHED") -> None:
    """status: FINISHED, FAILED or KILLED."""
    import mlflow

    if mlflow.active_run() is not None:
        _retry("end_run", lambda: mlflow.end_run(status=status))


# ---------------------------------------------------------------------------- logging
def log_params(params: dict) -> None:
    """Nested dicts are flattened to dotted keys; values are stringified (MLflow limit 6000 chars)."""
    mlflow = _configure()
    flat = {k: str(v)[:6000] for k, v in flatten(params).items()}
    _retry("log_params", lambda: mlflow.log_params(flat))


def log_metrics(metrics: dict, step: int | None = None) -> None:
    """Numeric values only (tensors/numpy scalars are converted); non-finite and non-numeric
    values are dropped with a debug message rather than failing the batch."""
    mlflow = _configure()
    clean = {}
    for key, value in metrics.items():
        try:
            number = float(value)
        except (TypeError, ValueError, RuntimeError):
            logger.debug("skipping non-numeric metric %s=%r", key, value)
            continue
        if math.isfinite(number):
            clean[key] = number
        else:
            logger.debug("skipping non-finite metric %s=%r", key, value)
    if clean:
        _retry("log_metrics", lambda: mlflow.log_metrics(clean, step=step))


def last_logged_step(run_id: str, key: str) -> int | None:
    """The highest step at which metric `key` was logged in run `run_id` (None: never)."""
    mlflow = _configure()
    history = _retry(f"get_metric_history({key})", lambda: mlflow.MlflowClient().get_metric_history(run_id, key),
                     raise_on_failure=True)
    return max((m.step for m in history), default=None)


def log_artifact(path: str | os.PathLike, artifact_path: str | None = None) -> None:
    """Log a file, or every file of a directory, under `artifact_path`."""
    mlflow = _configure()
    path = str(path)
    if os.path.isdir(path):
        _retry(f"log_artifacts({path})", lambda: mlflow.log_artifacts(path, artifact_path))
    else:
        _retry(f"log_artifact({path})", lambda: mlflow.log_artifact(path, artifact_path))


def log_dict(data: dict, artifact_file: str) -> None:
    """Save a dict as a .json/.yaml artifact (format from the file extension)."""
    mlflow = _configure()
    _retry(f"log_dict({artifact_file})", lambda: mlflow.log_dict(data, artifact_file))


def log_text(text: str, artifact_file: str) -> None:
    mlflow = _configure()
    _retry(f"log_text({artifact_file})", lambda: mlflow.log_text(text, artifact_file))


def set_tags(tags: dict) -> None:
    mlflow = _configure()
    _retry("set_tags", lambda: mlflow.set_tags({k: str(v) for k, v in tags.items()}))
