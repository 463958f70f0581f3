"""Thin MLflow wrapper that never kills — and never stalls — a training run.

(Over 400 lines on purpose: the project keeps every MLflow call in this one module — runs, the
background queue, lineage inputs and the model registry.)

The tracking server comes from MLFLOW_TRACKING_URI; when unset, runs go to a local SQLite store
under `<repo>/.dspark/mlruns/` (mlflow.db + artifacts/; MLflow 3 refuses plain file stores).
This is the one module that talks to MLflow's tracking API.

- Metrics, params, tags and dataset inputs go through a bounded background queue drained by one
  thread (retrying a transient failure a few times, then logging a warning): a call never waits on
  the server, and when the server is slow or down the queue fills and further calls are dropped
  with a warning. `end_run`/`flush` wait for the queue, but only up to FLUSH_TIMEOUT_S.
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
- Drafters are MLflow models: `log_drafter_model` logs a checkpoint as a pyfunc model (a LoggedModel
  of the run, dspark.io.drafter_model) with the run's metrics linked to it; `register_model_version`
  registers it, tags the version and moves its aliases and the serving alias `champion`
  (SERVING_ALIAS). MLflow reserves `latest`: `models:/<name>@latest` still resolves to the newest
  version (dspark.io.drafter_source) with a deprecation warning.

`start_run` and `check_reachable` raise TrackingError (one line with the fix): they run before any
work is done.
"""
from __future__ import annotations

import atexit
import hashlib
import logging
import math
import os
import queue
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from dspark.config import flatten

logger = logging.getLogger("dspark.io.tracking")

ATTEMPTS = 3
BACKOFF_S = 1.0
# Permanent MLflow errors: retrying cannot help.
# (RESOURCE_ALREADY_EXISTS is not among them: a retry finds an experiment created concurrently.)
PERMANENT_CODES = {"INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST",
                   "PERMISSION_DENIED", "INVALID_STATE", "BAD_REQUEST"}
QUEUE_SIZE = 10_000  # pending logging calls; beyond this, calls are dropped (with a warning)
FLUSH_TIMEOUT_S = float(os.environ.get("DSPARK_MLFLOW_FLUSH_TIMEOUT_S", "30"))  # end_run's wait for the queue
RAY_STOP_GRACE_S = 3.0  # `ray job stop` sends SIGKILL this long after SIGTERM (RAY_JOB_STOP_WAIT_TIME_S)
SIGNAL_FLUSH_S, SIGNAL_END_S = 0.5, 2.0  # the signal handler's budget: both fit in RAY_STOP_GRACE_S
GIT_COMMIT_ENV = "DSPARK_GIT_COMMIT"
GIT_COMMIT_TAG = "mlflow.source.git.commit"  # the tag MLflow's UI shows as the run's source version
DIGEST_MAX = 36  # MLflow stores a dataset digest in a 36-character column


class TrackingError(RuntimeError):
    """MLflow cannot be used; the message names the cause and the fix."""


# ---------------------------------------------------------------------------- configuration
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


_clients: dict[str, Any] = {}


def _client():
    """The MlflowClient of the current tracking URI (also made mlflow's default for other callers).
    Queued calls capture it when submitted, so they reach the store that was current then."""
    mlflow = _configure()
    uri = tracking_uri()
    if uri not in _clients:
        _clients[uri] = mlflow.MlflowClient(uri)
    return _clients[uri]


# ---------------------------------------------------------------------------- background queue
class BackgroundLogger:
    """A bounded FIFO of logging calls drained by one daemon thread.

    Invariant: `submit` never blocks — it enqueues, or drops the call when QUEUE_SIZE calls are
    already pending (the server is slow or down) and warns. Calls run in submission order, each
    through `_retry`, so a failure costs that call only. `flush` waits at most `timeout_s`."""

    def __init__(self, maxsize: int = QUEUE_SIZE):
        self.maxsize = maxsize
        self.dropped = 0
        self._queue: queue.Queue = queue.Queue()  # bounded by `maxsize` in submit (end_run may exceed it)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, what: str, fn: Callable[[], Any], force: bool = False) -> bool:
        """Queue fn; False (and a warning) if it was dropped. `force` ignores the bound."""
        if not force and self._queue.unfinished_tasks >= self.maxsize:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                logger.warning("MLflow is not keeping up (%d logging calls pending): dropped %s (%d dropped so "
                               "far); training continues", self.maxsize, what, self.dropped)
            return False
        self._ensure_thread()
        self._queue.put((what, fn))
        return True

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._drain, name="dspark-mlflow-logger", daemon=True)
                self._thread.start()

    def _drain(self) -> None:
        while True:
            what, fn = self._queue.get()
            try:
                _retry(what, fn)
            except BaseException as err:  # noqa: BLE001 - the drain thread must survive anything
                logger.warning("MLflow %s failed: %s", what, err)
            finally:
                self._queue.task_done()

    def pending(self) -> int:
        return self._queue.unfinished_tasks

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued call ran, at most timeout_s; False (with a warning) if some did not."""
        deadline = time.monotonic() + timeout_s
        # The queue's mutex with a timeout, not `with all_tasks_done`: a signal handler may run while
        # this very thread is inside queue.put holding it (a plain acquire would deadlock).
        if not self._queue.mutex.acquire(timeout=max(timeout_s, 0.0)):
            logger.warning("MLflow: logging queue busy; not waiting for its %d pending calls", self.pending())
            return False
        try:
            while self._queue.unfinished_tasks:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    logger.warning("MLflow: %d logging calls still pending after %.1f s (tracking server %s slow "
                                   "or down); not waiting longer", self._queue.unfinished_tasks, timeout_s,
                                   tracking_uri())
                    return False
                self._queue.all_tasks_done.wait(remaining)  # all_tasks_done's lock is the queue's mutex
        finally:
            self._queue.mutex.release()
        return True


_background = BackgroundLogger()


def flush(timeout_s: float = FLUSH_TIMEOUT_S) -> bool:
    """Wait (bounded) for queued logging calls; True when none is left."""
    return _background.flush(timeout_s)


def _submit(what: str, fn: Callable[[], Any], force: bool = False) -> None:
    _background.submit(what, fn, force=force)


def _batches(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


# ---------------------------------------------------------------------------- provenance
def git_commit() -> str | None:
    """The source commit: $DSPARK_GIT_COMMIT (set by launchers at submission: a Ray job's uploaded
    working_dir and the image have no .git), else `git rev-parse HEAD` of this checkout (+ "-dirty"
    when it has uncommitted changes), else None."""
    commit = os.environ.get(GIT_COMMIT_ENV, "").strip()
    if commit:
        return commit
    root = Path(__file__).resolve().parents[2]  # the checkout (dspark/io/tracking.py)
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if sha.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def submission_env() -> dict[str, str]:
    """Env vars a launcher adds to a job's runtime env so the job can record its provenance."""
    commit = git_commit()
    return {GIT_COMMIT_ENV: commit} if commit else {}


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
        return client.create_run(_ensure_experiment(client, experiment), run_name=run_name,
                                 tags=_default_tags() | str_tags).info.run_id

    started = _retry(f"start_run({experiment!r})", begin, raise_on_failure=True)
    _current = _Run(started, owned=True)
    if run_id and str_tags:
        set_tags(str_tags)
    _install_exit_hooks()
    if system_metrics:
        _current.monitor = _start_system_metrics(started, node_id=None)
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
        _current.monitor = _start_system_metrics(run_id, node_id)


def _default_tags() -> dict[str, str]:
    """MLflow's usual source/user tags, with our commit as the source version."""
    try:
        from mlflow.tracking.context.registry import resolve_tags

        tags = dict(resolve_tags({}))
    except Exception:  # noqa: BLE001 - context providers are best-effort
        tags = {}
    commit = git_commit()
    if commit:
        tags[GIT_COMMIT_TAG] = commit
    else:
        tags.pop(GIT_COMMIT_TAG, None)
    return tags


def _ensure_experiment(client, name: str) -> str:
    """The id of experiment `name` (created if missing; in the local store, with its artifacts under
    .dspark/mlruns/artifacts)."""
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    location = (local_store_dir() / "artifacts" / name).as_uri() if _is_local_store(tracking_uri()) else None
    try:
        return client.create_experiment(name, artifact_location=location)
    except Exception as err:  # noqa: BLE001 - created concurrently by another process
        if getattr(err, "error_code", None) != "RESOURCE_ALREADY_EXISTS":
            raise
        return client.get_experiment_by_name(name).experiment_id


def active_run_id() -> str | None:
    return _current.run_id if _current else None


def end_run(status: str = "FINISHED", flush_timeout_s: float | None = None) -> None:
    """status: FINISHED, FAILED or KILLED. Waits (bounded) for queued logging calls first. An
    attached run is only detached: its owner ends it."""
    _close(status, FLUSH_TIMEOUT_S if flush_timeout_s is None else flush_timeout_s, end_timeout_s=None)


def _close(status: str, flush_timeout_s: float, end_timeout_s: float | None) -> None:
    global _current
    run, _current = _current, None  # first: a signal arriving now finds nothing left to end
    if run is None:
        return
    _stop_system_metrics(run.monitor, timeout_s=min(flush_timeout_s, 5.0), status=status)
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
    atexit.register(_at_exit)
    if threading.current_thread() is not threading.main_thread():
        logger.debug("not in the main thread: no SIGTERM/SIGINT handler for the MLflow run")
        return
    for signum in (signal.SIGTERM, signal.SIGINT):
        previous = signal.getsignal(signum)
        signal.signal(signum, lambda num, frame, prev=previous: _on_signal(num, frame, prev))


def _at_exit() -> None:
    # A job ends its run explicitly when it succeeds; one still open here did not get that far.
    if _current is None or _current.pid != os.getpid():
        return
    _close("FAILED", flush_timeout_s=min(FLUSH_TIMEOUT_S, 5.0), end_timeout_s=SIGNAL_END_S)


def _on_signal(signum: int, frame, previous) -> None:
    if _current is not None and _current.pid == os.getpid():
        logger.warning("received %s: ending MLflow run %s as KILLED", signal.Signals(signum).name, _current.run_id)
        _close("KILLED", SIGNAL_FLUSH_S, SIGNAL_END_S)
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:  # SIG_DFL (or None: set outside Python): die of the signal
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


# ---------------------------------------------------------------------------- system metrics
class _SystemMetrics:
    """MLflow's own system-metrics sampler for one run, through the public API: a helper thread makes the
    run its active run with `mlflow.start_run(run_id=..., log_system_metrics=True)` (MLflow samples psutil
    / pynvml into `system/...` on its own thread) and ends it with `mlflow.end_run` when stopped. Being on
    a helper thread, it never touches the caller's thread-local MLflow run and can be stopped with a
    deadline. An attached run (a worker logging into the driver's run) is ended with status RUNNING:
    the sampler stops and the driver keeps setting the final status."""

    def __init__(self, run_id: str, owned: bool, node_id: str | None):
        self.run_id, self.owned, self.node_id = run_id, owned, node_id
        self.status = "FINISHED"
        self.started, self.stop_requested = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, name="dspark-mlflow-sysmetrics", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        mlflow = _configure()
        try:
            mlflow.set_system_metrics_node_id(self.node_id)  # process-wide: set (or clear) it for this run
            mlflow.start_run(run_id=self.run_id, log_system_metrics=True)
        except Exception as err:  # noqa: BLE001 - metrics about the machine are never worth a failed run
            logger.warning("MLflow system metrics are off: %s: %s", type(err).__name__, err)
            return
        finally:
            self.started.set()
        self.stop_requested.wait()
        with _suppress_warning("stopping MLflow system metrics"):
            mlflow.end_run(status=self.status if self.owned else "RUNNING")

    def stop(self, status: str, timeout_s: float) -> None:
        self.status = status
        self.stop_requested.set()
        self.thread.join(timeout_s)


def _start_system_metrics(run_id: str, node_id: str | None) -> _SystemMetrics:
    """Sample CPU/GPU/memory/disk/network into the run (see _SystemMetrics)."""
    monitor = _SystemMetrics(run_id, owned=_current is not None and _current.owned, node_id=node_id)
    monitor.started.wait(10.0)
    return monitor


def _stop_system_metrics(monitor: _SystemMetrics | None, timeout_s: float, status: str = "FINISHED") -> None:
    """Stop sampling without waiting on a slow server for more than timeout_s."""
    if monitor is not None:
        monitor.stop(status, timeout_s)


class _suppress_warning:
    """Log (never raise) any error of the block."""

    def __init__(self, what: str):
        self.what = what

    def __enter__(self):
        return self

    def __exit__(self, kind, err, tb) -> bool:
        if err is not None:
            logger.warning("%s failed: %s: %s", self.what, kind.__name__, err)
        return True


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
    flat = [Param(k, str(v)[:6000]) for k, v in flatten(params).items()]
    client = _client()
    for batch in _batches(flat, 100):  # MLflow's log_batch limit: 100 params
        _submit("log_params", lambda b=batch: client.log_batch(run_id, params=b, synchronous=True))


def log_metrics(metrics: dict, step: int | None = None) -> None:
    """Numeric values only (tensors/numpy scalars are converted); non-finite and non-numeric
    values are dropped with a debug message rather than failing the batch. Returns at once."""
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
        _log_metric_points([(key, value, step or 0) for key, value in clean.items()])


def log_series(key: str, values: dict[int, float]) -> None:
    """One metric as a series over x = step (e.g. acceptance by draft position), so MLflow's UI
    plots it as a curve. Non-finite points are skipped."""
    points = [(key, float(v), int(x)) for x, v in sorted(values.items()) if v is not None and math.isfinite(float(v))]
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
    for batch in _batches(metrics, 1000):  # MLflow's log_batch limit: 1000 metrics
        _submit("log_metrics", lambda b=batch: client.log_batch(run_id, metrics=b, synchronous=True))


def set_tags(tags: dict) -> None:
    from mlflow.entities import RunTag

    run_id = _run_id_or_warn("set_tags")
    if run_id is None:
        return
    run_tags = [RunTag(k, str(v)) for k, v in tags.items()]
    client = _client()
    for batch in _batches(run_tags, 100):
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
            digest = dataset_digest(uri)
        except (OSError, RuntimeError, ValueError) as err:  # StorageError is a RuntimeError
            logger.warning("MLflow dataset input %r not logged: cannot read %s to digest it: %s", name, uri, err)
            return None
    digest = digest if len(digest) <= DIGEST_MAX else digest[:32]
    entity = _dataset_input(name, uri, digest, context)
    client = _client()
    _submit(f"log_dataset_input({name!r})", lambda: client.log_inputs(run_id, datasets=[entity]))
    return digest


def _dataset_input(name: str, uri: str, digest: str, context: str):
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    with warnings.catch_warnings():  # "can be interpreted in multiple ways": local paths match twice
        warnings.simplefilter("ignore")
        source = resolve_dataset_source(uri)
    dataset = MetaDataset(source, name=name, digest=digest)._to_mlflow_entity()
    return DatasetInput(dataset, tags=[InputTag(MLFLOW_DATASET_CONTEXT, context)])


def dataset_digest(uri: str) -> str:
    """Content digest of a file, or of every file under a directory/prefix: sha256 over each file's
    path relative to `uri` and the sha256 of its bytes (so renames and edits both change it).
    Reads the data: give large datasets' digest explicitly (e.g. from their manifest)."""
    from dspark.io import storage

    files = storage.list_files(uri)
    if not files:
        raise FileNotFoundError(f"no file at {uri}")
    total = hashlib.sha256()
    base = uri.rstrip("/")
    for file in files:
        relative = file[len(base):].lstrip("/") if file.startswith(base) else file
        total.update(f"{relative}\0{storage.content_hash(file)}\n".encode())
    return total.hexdigest()[:32]


def last_logged_step(run_id: str, key: str) -> int | None:
    """The highest step at which metric `key` was logged in run `run_id` (None: never). Raises on failure."""
    flush()  # points still queued here count as logged
    history = _retry(f"get_metric_history({key})", lambda: _client().get_metric_history(run_id, key),
                     raise_on_failure=True)
    return max((m.step for m in history), default=None)


# ---------------------------------------------------------------------------- model registry
def set_model_version_tags(name: str, version: str, tags: dict[str, str]) -> None:
    """Tag one registered model version (values cut to MLflow's 5000-character limit). Raises on failure."""
    client = _client()
    for key, value in tags.items():
        client.set_model_version_tag(name, str(version), key, str(value)[:5000])


SERVING_ALIAS = "champion"  # the version serving, evaluation and calibration use by default (configs/*)
RESERVED_ALIAS = "latest"  # MLflow's own `models:/<name>/latest` keyword: not an alias we may set
DRAFTER_MODEL_TYPE = "dspark-drafter"


def log_drafter_model(run_id: str, checkpoint_dir: str, name: str = "drafter", tags: dict | None = None) -> str:
    """Log a local drafter checkpoint as an MLflow model of the run: a LoggedModel (pyfunc flavor,
    dspark.io.drafter_model.DrafterModel; the checkpoint under artifacts/drafter/) with the run's metrics
    and the drafter config (as params) linked to it. Returns the model id. Raises TrackingError."""
    import tempfile

    def log() -> str:
        mlflow, client = _configure(), _client()
        from dspark.drafters.checkpoint import read_checkpoint_config
        from dspark.io.drafter_model import ARTIFACT_KEY, DrafterModel, pip_requirements

        params = {k: str(v)[:6000] for k, v in flatten(read_checkpoint_config(checkpoint_dir)).items()}
        model = client.create_logged_model(client.get_run(run_id).info.experiment_id, name=name,
                                           source_run_id=run_id, params=params, model_type=DRAFTER_MODEL_TYPE,
                                           tags={k: str(v) for k, v in (tags or {}).items()})
        with tempfile.TemporaryDirectory(prefix="dspark-mlflow-model-") as tmp:
            mlflow.pyfunc.save_model(os.path.join(tmp, "model"), python_model=DrafterModel(),
                                     artifacts={ARTIFACT_KEY: checkpoint_dir}, pip_requirements=pip_requirements())
            client.log_model_artifacts(model.model_id, os.path.join(tmp, "model"))
        client.finalize_logged_model(model.model_id, "READY")
        link_run_metrics(run_id, model.model_id)
        return model.model_id

    return _retry(f"logging {checkpoint_dir} as an MLflow model of run {run_id}", log, raise_on_failure=True)


def link_run_metrics(run_id: str, model_id: str) -> None:
    """Attach the run's latest metric values (same step and timestamp) to the LoggedModel `model_id`,
    so the Models tab shows the metrics the drafter was trained/calibrated with."""
    from mlflow.entities import Metric

    flush()
    client = _client()
    latest = client.get_run(run_id).data._metric_objs  # the latest point of every metric
    points = [Metric(m.key, m.value, m.timestamp, m.step, model_id=model_id, run_id=run_id) for m in latest]
    for batch in _batches(points, 1000):
        client.log_batch(run_id, metrics=batch)


def register_model_version(run_id: str, name: str, artifact_path: str, aliases: list[str],
                           description: str = "", model_id: str | None = None, tags: dict | None = None) -> str:
    """Register a new version of model `name` (created when new) and move every alias in `aliases`, and
    SERVING_ALIAS, to it; returns the version. Its source is the LoggedModel `model_id` (an MLflow model,
    `log_drafter_model`) or, without one, the run's `artifact_path` directory. `tags` go on the version.
    Transient errors are retried; a final failure raises TrackingError."""
    aliases = [a for a in dict.fromkeys([*aliases, SERVING_ALIAS]) if a.lower() != RESERVED_ALIAS]

    def register() -> str:
        client = _client()
        try:
            client.create_registered_model(name)
        except Exception as err:  # noqa: BLE001 - an existing model is fine
            if getattr(err, "error_code", None) not in ("RESOURCE_ALREADY_EXISTS", "ALREADY_EXISTS"):
                raise
        source = (f"models:/{model_id}" if model_id else
                  f"{client.get_run(run_id).info.artifact_uri.rstrip('/')}/{artifact_path}")
        version = str(client.create_model_version(name, source, run_id=run_id, description=description,
                                                  tags={k: str(v) for k, v in (tags or {}).items()},
                                                  model_id=model_id).version)
        for alias in aliases:
            client.set_registered_model_alias(name, alias, version)
        return version

    return _retry(f"registering {artifact_path} of run {run_id} as {name!r}", register, raise_on_failure=True)


def publish_drafter(run_id: str, name: str, checkpoint_dir: str, aliases: list[str], description: str = "",
                    tags: dict | None = None) -> str:
    """log_drafter_model + register_model_version: the checkpoint becomes an MLflow model, registered as
    a new version of `name` with `tags` (on the version and the LoggedModel) and `aliases` + champion."""
    model_id = log_drafter_model(run_id, checkpoint_dir, tags=tags)
    return register_model_version(run_id, name, "drafter", aliases, description=description, model_id=model_id,
                                  tags=tags)


def registry_client():
    """The MlflowClient of the current tracking URI, for registry lookups (model versions, aliases)."""
    return _client()


def download_artifacts(artifact_uri: str, dst_path: str) -> str:
    """Download a runs:/, models:/ or artifact URI into `dst_path`; returns the local path."""
    mlflow = _configure()
    return mlflow.artifacts.download_artifacts(artifact_uri=artifact_uri, dst_path=dst_path)



def model_version_exists(name: str, version: str) -> bool:
    """Whether registered model `name` still has `version` (False when the registry is wiped or
    unreachable: callers treat that as "must be produced again")."""
    try:
        _client().get_model_version(name, str(version))
    except Exception:  # noqa: BLE001 — any registry failure means "not there"
        return False
    return True
