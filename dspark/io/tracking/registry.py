"""The MLflow model registry: drafters logged as MLflow models and registered (versions, tags, the
serving alias), lookups and downloads, and the flywheel's alias moves and decision records.
(dspark.io.tracking holds runs and logging, and the one `import mlflow`.)"""
from __future__ import annotations

import os

from dspark.config import check_alias, flatten
from dspark.io import tracking

BASELINE_PREFIX = "dspark.baseline."  # dspark.baseline.<domain>.tau = τ measured by jobs.evaluate


def version_of(name: str, alias: str) -> str:
    """The version an alias points to (raises when the alias does not exist)."""
    return str(registry_client().get_model_version_by_alias(name, alias).version)


def version_tags(name: str, version: str) -> dict[str, str]:
    return dict(registry_client().get_model_version(name, str(version)).tags or {})


def set_alias(name: str, alias: str, version: str) -> None:
    registry_client().set_registered_model_alias(name, alias, str(version))


def baseline(name: str, version: str) -> dict[str, float]:
    """{domain: τ} recorded on the version by `record_baseline`."""
    out = {}
    for key, value in version_tags(name, version).items():
        if key.startswith(BASELINE_PREFIX) and key.endswith(".tau"):
            out[key[len(BASELINE_PREFIX):-len(".tau")]] = float(value)
    return out


def record_baseline(name: str, version: str, tau_by_domain: dict[str, float], source: str) -> None:
    """Store the per-domain τ of an evaluation on the version (what the drift job compares with)."""
    tags = {f"{BASELINE_PREFIX}{d}.tau": f"{t:.6f}" for d, t in tau_by_domain.items()}
    set_model_version_tags(name, version, {**tags, "dspark.baseline.source": source})


def set_model_version_tags(name: str, version: str, tags: dict[str, str]) -> None:
    """Tag one registered model version (values cut to MLflow's 5000-character limit). Raises on failure."""
    client = tracking.client()
    for key, value in tags.items():
        client.set_model_version_tag(name, str(version), key, str(value)[:5000])


SERVING_ALIAS = "champion"  # the version serving, evaluation and calibration use by default (configs/*); it
# moves only by an explicit promotion (`promote`: jobs.promote, or a job's promote_to a user sets), never by
# registering a version
PROMOTED_TAG = "dspark.promoted."  # dspark.promoted.<alias> = who/why, on the version an alias was moved to
DRAFTER_MODEL_TYPE = "dspark-drafter"


def log_drafter_model(run_id: str, checkpoint_dir: str, name: str = "drafter", tags: dict | None = None) -> str:
    """Log a local drafter checkpoint as an MLflow model of the run: a LoggedModel (pyfunc flavor,
    dspark.io.tracking.drafter_model.DrafterModel; the checkpoint under artifacts/drafter/) with the run's metrics
    and the drafter config (as params) linked to it. Returns the model id. Raises TrackingError."""
    import tempfile

    def log() -> str:
        mlflow, client = tracking.mlflow_module(), tracking.client()
        from dspark.drafters.checkpoint import read_checkpoint_config
        from dspark.io.tracking.drafter_model import ARTIFACT_KEY, DrafterModel, code_paths, pip_requirements

        params = {k: str(v)[:6000] for k, v in flatten(read_checkpoint_config(checkpoint_dir)).items()}
        model = client.create_logged_model(client.get_run(run_id).info.experiment_id, name=name,
                                           source_run_id=run_id, params=params, model_type=DRAFTER_MODEL_TYPE,
                                           tags={k: str(v) for k, v in (tags or {}).items()})
        with tempfile.TemporaryDirectory(prefix="dspark-mlflow-model-") as tmp:
            mlflow.pyfunc.save_model(os.path.join(tmp, "model"), python_model=DrafterModel(),
                                     artifacts={ARTIFACT_KEY: checkpoint_dir}, pip_requirements=pip_requirements(),
                                     code_paths=code_paths())
            client.log_model_artifacts(model.model_id, os.path.join(tmp, "model"))
        client.finalize_logged_model(model.model_id, "READY")
        link_run_metrics(run_id, model.model_id)
        return model.model_id

    return tracking.retry(f"logging {checkpoint_dir} as an MLflow model of run {run_id}", log, raise_on_failure=True)


def link_run_metrics(run_id: str, model_id: str) -> None:
    """Attach the run's latest metric values (same step and timestamp) to the LoggedModel `model_id`,
    so the Models tab shows the metrics the drafter was trained/calibrated with."""
    Metric = tracking.mlflow_module().entities.Metric
    tracking.flush()
    client = tracking.client()
    keys = client.get_run(run_id).data.metrics  # key -> the latest value (MLflow's rule: largest step, then time)
    latest = [max(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp, m.value))
              for key in keys]
    points = [Metric(m.key, m.value, m.timestamp, m.step, model_id=model_id, run_id=run_id) for m in latest]
    for batch in tracking.batches(points, 1000):
        client.log_batch(run_id, metrics=batch)


def register_model_version(run_id: str, name: str, artifact_path: str, aliases: list[str],
                           description: str = "", model_id: str | None = None, tags: dict | None = None) -> str:
    """Register a new version of model `name` (created when new) and move the aliases in `aliases` (checked
    first: dspark.config.check_alias) to it, and no other (the serving alias moves only through `promote`);
    returns the version. Its source is the LoggedModel `model_id` (an MLflow model, `log_drafter_model`) or,
    without one, the run's `artifact_path` directory. `tags` go on the version.
    Transient errors are retried; a final failure raises TrackingError."""
    aliases = [check_alias(a) for a in dict.fromkeys(aliases)]

    def register() -> str:
        client = tracking.client()
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

    return tracking.retry(f"registering {artifact_path} of run {run_id} as {name!r}", register, raise_on_failure=True)


def promote(name: str, version: str, alias: str, reason: str) -> None:
    """Point `alias` (e.g. SERVING_ALIAS) of model `name` at `version`, and record on the version who moved
    it and why (tag dspark.promoted.<alias>). The one way the serving alias moves."""
    check_alias(alias)
    set_alias(name, alias, version)
    set_model_version_tags(name, version, {f"{PROMOTED_TAG}{alias}": reason})


def publish_drafter(run_id: str, name: str, checkpoint_dir: str, aliases: list[str], description: str = "",
                    tags: dict | None = None) -> str:
    """log_drafter_model + register_model_version: the checkpoint becomes an MLflow model, registered as
    a new version of `name` with `tags` (on the version and the LoggedModel) and `aliases` (only those)."""
    for alias in aliases:
        check_alias(alias)  # before any upload
    model_id = log_drafter_model(run_id, checkpoint_dir, tags=tags)
    return register_model_version(run_id, name, "drafter", aliases, description=description, model_id=model_id,
                                  tags=tags)


def registry_client():
    """The MlflowClient of the current tracking URI, for registry lookups (model versions, aliases)."""
    return tracking.client()


def download_artifacts(artifact_uri: str, dst_path: str) -> str:
    """Download a runs:/, models:/ or artifact URI into `dst_path`; returns the local path."""
    mlflow = tracking.mlflow_module()
    return mlflow.artifacts.download_artifacts(artifact_uri=artifact_uri, dst_path=dst_path)



def model_version_exists(name: str, version: str) -> bool:
    """Whether registered model `name` still has `version` (False when the registry is wiped or
    unreachable: callers treat that as "must be produced again")."""
    try:
        tracking.client().get_model_version(name, str(version))
    except Exception:  # noqa: BLE001 — any registry failure means "not there"
        return False
    return True
