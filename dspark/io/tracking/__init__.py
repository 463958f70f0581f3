"""MLflow tracking: runs, metrics, the model registry and dataset lineage (the one place mlflow is imported).

Thin MLflow wrapper that never kills — and never stalls — a training run.

The tracking server comes from MLFLOW_TRACKING_URI; when unset, runs go to a local SQLite store
under `<repo>/.dspark/mlruns/` (mlflow.db + artifacts/; MLflow 3 refuses plain file stores).
This is the one module that talks to MLflow's tracking API.

- Metrics, params, tags and dataset inputs go through a bounded background queue drained by one
  thread (retrying a transient failure a few times, then logging a warning): a call never waits on
  the server, and when the server is slow or down the queue fills and further calls are dropped
  with a warning. `end_run`/`flush` wait for the queue, but only up to FLUSH_TIMEOUT_S. (Not MLflow's
  own async logging: against a hung server it grows without bound and delays exit; measured in
  dspark.io.tracking.background_logger.)
- Runs are addressed by id (MlflowClient), not through MLflow's thread-local "active run", so a
  Ray Train worker can log into the driver's run (`attach_run`) without owning it.
- A run this process started (`start_run`) never stays RUNNING: SIGTERM (`ray job stop`) and
  SIGINT end it KILLED within RAY_STOP_GRACE_S, and an interpreter exit with the run still open
  (an uncaught exception, `sys.exit` before `end_run`) ends it FAILED.
- Every new run is tagged with the source commit (`git_commit`): $DSPARK_GIT_COMMIT, which the
  launchers set at submission (the uploaded working_dir has no .git), else `git rev-parse HEAD`.
- `log_dataset_input` records lineage (name, source URI, digest, context) in MLflow's Inputs;
  `start_run(..., system_metrics=True)` / `attach_run(..., system_metrics=True)` sample CPU,
  memory, disk, network (psutil) and GPU (pynvml, when installed) into `system/...` metrics, through
  MLflow's public `mlflow.start_run(run_id=..., log_system_metrics=True)`.
- The model registry (drafters as MLflow models, versions, aliases) is dspark.io.tracking.registry,
  system metrics dspark.io.tracking.system_metrics; where runs go (tracking URI, reachability)
  dspark.io.tracking.store, the shaping of logged values dspark.io.tracking.values, the exit/signal hooks
  dspark.io.exit_hooks; this module is still the one that imports MLflow.

`start_run` and `check_reachable` raise TrackingError (one line with the fix): they run before any
work is done.
"""
from __future__ import annotations

import getpass
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import tenacity

from dspark.config import flatten
from dspark.io import exit_hooks
from dspark.io.tracking.background_logger import QUEUE_SIZE, BackgroundLogger
from dspark.io.tracking.system_metrics import start_system_metrics, stop_system_metrics, suppress_warning  # noqa: F401
from dspark.io.tracking.source_version import GIT_COMMIT_ENV, GIT_COMMIT_TAG, git_commit, submission_env  # noqa: F401 (re-exported)
from dspark.io.tracking.store import TrackingError, check_reachable, ensure_experiment, tracking_uri  # noqa: F401 (check_reachable re-exported)
from dspark.io.tracking.values import PARAM_VALUE_MAX, batches, finite_metrics, fit_digest, series_points

logger = logging.getLogger("dspark.io.tracking")

ATTEMPTS = 3
BACKOFF_S = 1.0
# Permanent MLflow errors: retrying cannot help.
# (RESOURCE_ALREADY_EXISTS is not among them: a retry finds an experiment created concurrently.)
PERMANENT_CODES = {"INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST",
                   "PERMISSION_DENIED", "INVALID_STATE", "BAD_REQUEST"}
FLUSH_TIMEOUT_S = float(os.environ.get("DSPARK_MLFLOW_FLUSH_TIMEOUT_S", "30"))  # end_run's wait for the queue
RAY_STOP_GRACE_S = 3.0  # `ray job stop` sends SIGKILL this long after SIGTERM (RAY_JOB_STOP_WAIT_TIME_S)
SIGNAL_FLUSH_S, SIGNAL_END_S = 0.5, 2.0  # the signal handler's budget: both fit in RAY_STOP_GRACE_S


# ---------------------------------------------------------------------------- configuration
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


# ---------------------------------------------------------------------------- retries
def _is_permanent(err: Exception) -> bool:
    return getattr(err, "error_code", None) in PERMANENT_CODES


def _transient(err: BaseException) -> bool:
    return isinstance(err, Exception) and not _is_permanent(err)


def _retry(what: str, fn: Callable[[], Any], raise_on_failure: bool = False) -> Any:
    """Call fn; retry transient errors (ATTEMPTS calls in all, waiting BACKOFF_S, 2*BACKOFF_S, ...
    in between). On final failure log a warning and return None, or raise TrackingError when
    raise_on_failure. A permanent error (PERMANENT_CODES) is final at once."""
    retrying = tenacity.Retrying(stop=tenacity.stop_after_attempt(ATTEMPTS),
                                 wait=tenacity.wait_exponential(multiplier=BACKOFF_S, min=0),
                                 retry=tenacity.retry_if_exception(_transient), reraise=True)
    try:
        return retrying(fn)
    except Exception as err:  # noqa: BLE001 - MLflow raises many types for transient failures
        attempts = retrying.statistics.get("attempt_number", 1)
        message = f"MLflow {what} failed after {attempts} attempt(s): {type(err).__name__}: {err}"
        if raise_on_failure:
            raise TrackingError(f"{message}; check the tracking server ({tracking_uri()})") from err
        logger.warning(message)
        return None


_clients: dict[str, Any] = {}


def _client():
    """The MlflowClient of the current tracking URI (also made mlflow's default for other callers).
    Queued calls capture it when submitted, so they reach the store that was current then."""
    mlflow = _configure()
    uri = tracking_uri()
    if uri not in _clients:
        _clients[uri] = mlflow.MlflowClient(uri)
    return _clients[uri]


def new_background_logger(maxsize: int = QUEUE_SIZE) -> BackgroundLogger:
    """A logging queue whose calls run through `_retry` (the process uses one: `_background`)."""
    return BackgroundLogger(run=lambda what, fn: _retry(what, fn), maxsize=maxsize)


_background = new_background_logger()


def flush(timeout_s: float = FLUSH_TIMEOUT_S) -> bool:
    """Wait (bounded) for queued logging calls; True when none is left."""
    return _background.flush(timeout_s)


def _submit(what: str, fn: Callable[[], Any]) -> None:
    _background.submit(what, fn)


# ---------------------------------------------------------------------------- runs
@dataclass
class _Run:
    """The run this process logs to. owned: started here (we end it, also on signals and at exit);
    otherwise attached to a run another process owns (a Ray Train worker logging into the driver's)."""
    run_id: str
    owned: bool
    monitor: Any = None  # mlflow SystemMetricsMonitor, when system metrics are on
    pid: int = field(default_factory=os.getpid)  # a forked child inherits _current but must not end the run


_current: _Run | None = None
_exit_hooks_installed = False


def start_run(experiment: str, run_name: str | None = None, run_id: str | None = None,
              tags: dict | None = None, system_metrics: bool = False) -> str:
    """Start (or, given run_id, resume) a run in `experiment` (created if missing); returns its id.
    Ends any other run this process owns first. The run is tagged with `git_commit()`; with
    `system_metrics`, CPU/GPU/memory/disk/network are sampled into it until it ends."""
    global _current
    client = _client()
    if _current is not None:
        if _current.run_id == run_id:
            return run_id
        end_run()
    str_tags = {k: str(v) for k, v in (tags or {}).items()}

    def begin() -> str:
        if run_id:
            client.update_run(run_id, status="RUNNING")
            return run_id
        return client.create_run(ensure_experiment(client, experiment), run_name=run_name,
                                 tags=_default_tags() | str_tags).info.run_id

    started = _retry(f"start_run({experiment!r})", begin, raise_on_failure=True)
    _current = _Run(started, owned=True)
    if run_id and str_tags:
        set_tags(str_tags)
    _install_exit_hooks()
    if system_metrics:
        _current.monitor = start_system_metrics(_configure(), started, node_id=None, owned=True)
    return started


def attach_run(run_id: str, system_metrics: bool = False, node_id: str | None = None) -> None:
    """Log into an existing run owned by another process (it stays RUNNING; that process ends it).
    `node_id` prefixes this process's system metrics (system/<node_id>/...) on multi-node runs."""
    global _current
    if _current is not None:
        end_run()
    _configure()
    _current = _Run(run_id, owned=False)
    _install_exit_hooks()
    if system_metrics:
        _current.monitor = start_system_metrics(_configure(), run_id, node_id, owned=_current.owned)


def _default_tags() -> dict[str, str]:
    """MLflow's documented system tags for who ran what (mlflow.user, mlflow.source.name / .type), with our
    commit as the source version."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (some containers)
        user = "unknown"
    tags = {"mlflow.user": user, "mlflow.source.name": os.path.basename(sys.argv[0] or "") or "python",
            "mlflow.source.type": "LOCAL"}
    commit = git_commit()
    if commit:
        tags[GIT_COMMIT_TAG] = commit
    else:
        tags.pop(GIT_COMMIT_TAG, None)
    return tags


def end_run(status: str = "FINISHED", flush_timeout_s: float | None = None) -> None:
    """status: FINISHED, FAILED or KILLED. Waits (bounded) for queued logging calls first. An
    attached run is only detached: its owner ends it."""
    _close(status, FLUSH_TIMEOUT_S if flush_timeout_s is None else flush_timeout_s, end_timeout_s=None)


def _close(status: str, flush_timeout_s: float, end_timeout_s: float | None) -> None:
    global _current
    run, _current = _current, None  # first: a signal arriving now finds nothing left to end
    if run is None:
        return
    stop_system_metrics(run.monitor, timeout_s=min(flush_timeout_s, 5.0), status=status)
    _background.flush(flush_timeout_s)
    if not run.owned:
        return
    client = _client()
    terminate = lambda: _retry("end_run", lambda: client.set_terminated(run.run_id, status))  # noqa: E731
    if end_timeout_s is None:
        terminate()
        return
    worker = threading.Thread(target=terminate, name="dspark-mlflow-end", daemon=True)
    worker.start()
    worker.join(end_timeout_s)
    if worker.is_alive():
        logger.warning("MLflow: could not mark run %s %s within %.1f s", run.run_id, status, end_timeout_s)


# ---------------------------------------------------------------------------- exit, signals
def _install_exit_hooks() -> None:
    """atexit: an owned run still open at exit ends FAILED; SIGTERM/SIGINT: it ends KILLED, then the
    signal does what it did before (chained handler, or the default action)."""
    global _exit_hooks_installed
    if _exit_hooks_installed:
        return
    _exit_hooks_installed = True
    exit_hooks.install(_at_exit, _on_signal, "the MLflow run")


def _at_exit() -> None:
    # A job ends its run explicitly when it succeeds; one still open here did not get that far.
    if _current is None or _current.pid != os.getpid():
        return
    _close("FAILED", flush_timeout_s=min(FLUSH_TIMEOUT_S, 5.0), end_timeout_s=SIGNAL_END_S)


def _on_signal(signum: int) -> None:
    if _current is not None and _current.pid == os.getpid():
        logger.warning("received %s: ending MLflow run %s as KILLED", signal.Signals(signum).name, _current.run_id)
        _close("KILLED", SIGNAL_FLUSH_S, SIGNAL_END_S)


# ---------------------------------------------------------------------------- logging
def _run_id_or_warn(what: str) -> str | None:
    if _current is None:
        logger.warning("MLflow %s skipped: no run started in this process (tracking.start_run/attach_run)", what)
        return None
    return _current.run_id


def log_params(params: dict) -> None:
    """Nested dicts are flattened to dotted keys; values are stringified (MLflow limit 6000 chars)."""
    from mlflow.entities import Param

    run_id = _run_id_or_warn("log_params")
    if run_id is None:
        return
    flat = [Param(k, str(v)[:PARAM_VALUE_MAX]) for k, v in flatten(params).items()]
    client = _client()
    for batch in batches(flat, 100):  # MLflow's log_batch limit: 100 params
        _submit("log_params", lambda b=batch: client.log_batch(run_id, params=b, synchronous=True))


def log_metrics(metrics: dict, step: int | None = None) -> None:
    """Numeric values only (tensors/numpy scalars are converted); non-finite and non-numeric
    values are dropped with a debug message rather than failing the batch. Returns at once."""
    clean = finite_metrics(metrics)
    if clean:
        _log_metric_points([(key, value, step or 0) for key, value in clean.items()])


def log_series(key: str, values: dict[int, float]) -> None:
    """One metric as a series over x = step (e.g. acceptance by draft position), so MLflow's UI
    plots it as a curve. Non-finite points are skipped."""
    points = series_points(key, values)
    if points:
        _log_metric_points(points)


def _log_metric_points(points: list[tuple[str, float, int]]) -> None:
    from mlflow.entities import Metric

    run_id = _run_id_or_warn("log_metrics")
    if run_id is None:
        return
    now = int(time.time() * 1000)
    metrics = [Metric(key, value, now, step) for key, value, step in points]
    client = _client()
    for batch in batches(metrics, 1000):  # MLflow's log_batch limit: 1000 metrics
        _submit("log_metrics", lambda b=batch: client.log_batch(run_id, metrics=b, synchronous=True))


def set_tags(tags: dict) -> None:
    from mlflow.entities import RunTag

    run_id = _run_id_or_warn("set_tags")
    if run_id is None:
        return
    run_tags = [RunTag(k, str(v)) for k, v in tags.items()]
    client = _client()
    for batch in batches(run_tags, 100):
        _submit("set_tags", lambda b=batch: client.log_batch(run_id, tags=b, synchronous=True))


def log_artifact(path: str | os.PathLike, artifact_path: str | None = None) -> None:
    """Log a file, or every file of a directory, under `artifact_path` (synchronous: artifacts are
    logged between steps, at the end of a stage)."""
    run_id = _run_id_or_warn("log_artifact")
    if run_id is None:
        return
    client, path = _client(), str(path)
    if os.path.isdir(path):
        _retry(f"log_artifacts({path})", lambda: client.log_artifacts(run_id, path, artifact_path))
    else:
        _retry(f"log_artifact({path})", lambda: client.log_artifact(run_id, path, artifact_path))


def log_dict(data: dict, artifact_file: str) -> None:
    """Save a dict as a .json/.yaml artifact (format from the file extension)."""
    run_id = _run_id_or_warn("log_dict")
    if run_id is not None:
        client = _client()
        _retry(f"log_dict({artifact_file})", lambda: client.log_dict(run_id, data, artifact_file))


def log_text(text: str, artifact_file: str) -> None:
    run_id = _run_id_or_warn("log_text")
    if run_id is not None:
        client = _client()
        _retry(f"log_text({artifact_file})", lambda: client.log_text(run_id, text, artifact_file))


# ---------------------------------------------------------------------------- dataset lineage
def log_dataset_input(name: str, source_uri: str, digest: str | None, context: str) -> str | None:
    """Record that the current run used dataset `name` from `source_uri` (local path, s3:// or
    http(s)://) in `context` (e.g. "prompts", "training", "evaluation"): MLflow's run Inputs.
    `digest` identifies the content; None computes it (`dataset_digest`). Digests longer than
    MLflow's 36-character column keep their first 32 characters. Returns the digest logged, or
    None (with a warning) when it could not be logged. Never raises for MLflow or I/O trouble."""
    run_id = _run_id_or_warn(f"log_dataset_input({name!r})")
    if run_id is None:
        return None
    uri = source_uri if "://" in source_uri else os.path.abspath(source_uri)
    if digest is None:
        try:
            from dspark.io.storage import dataset_digest

            digest = dataset_digest(uri)
        except (OSError, RuntimeError, ValueError) as err:  # StorageError is a RuntimeError
            logger.warning("MLflow dataset input %r not logged: cannot read %s to digest it: %s", name, uri, err)
            return None
    digest = fit_digest(digest)
    entity = _dataset_input(name, uri, digest, context)
    client = _client()
    _submit(f"log_dataset_input({name!r})", lambda: client.log_inputs(run_id, datasets=[entity]))
    return digest


def _dataset_input(name: str, uri: str, digest: str, context: str):
    """The public entities MLflow's UI reads: a Dataset whose source is MLflow's artifact source for the URI
    ("s3" or "local", source JSON {"uri": ...}) and the `mlflow.data.context` input tag."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    source_type = "s3" if uri.startswith("s3://") else "local"
    dataset = Dataset(name=name, digest=digest, source_type=source_type, source=json.dumps({"uri": uri}))
    return DatasetInput(dataset, tags=[InputTag("mlflow.data.context", context)])


def last_logged_step(run_id: str, key: str) -> int | None:
    """The highest step at which metric `key` was logged in run `run_id` (None: never). Raises on failure."""
    flush()  # points still queued here count as logged
    history = _retry(f"get_metric_history({key})", lambda: _client().get_metric_history(run_id, key),
                     raise_on_failure=True)
    return max((m.step for m in history), default=None)


# ---------------------------------------------------------------------------- model registry


def mlflow_module():
    """The configured `mlflow` module (this is the one file that imports MLflow; other io modules reach
    it through here)."""
    return _configure()


def python_model_base() -> type:
    """mlflow.pyfunc.PythonModel, the base class of the drafter's MLflow model."""
    import mlflow.pyfunc

    return mlflow.pyfunc.PythonModel


# the io modules beside this one (registry, drafter_model) use these
client, retry = _client, _retry  # (and batches, from dspark.io.tracking.values)
