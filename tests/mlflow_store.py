"""A fresh, empty MLflow SQLite store per test without paying for its schema each time: creating and
migrating the tables takes ~2-3 s, copying a migrated file ~0.05 s. The template is made once per
process and working directory (the Default experiment's artifact location is resolved from the cwd
when the store is created, so a copy equals a store created here)."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

_templates: dict[str, Path] = {}


def new_sqlite_store(folder: Path) -> str:
    """`sqlite:///<folder>/mlflow.db`, an empty store with MLflow's current schema, created now."""
    import mlflow

    cwd = os.getcwd()
    if cwd not in _templates:
        template = Path(tempfile.mkdtemp(prefix="mlflow-template-")) / "mlflow.db"
        mlflow.MlflowClient(f"sqlite:///{template}").search_experiments()  # creates and migrates the tables
        _templates[cwd] = template
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(_templates[cwd], folder / "mlflow.db")
    return f"sqlite:///{folder / 'mlflow.db'}"



def register_drafter_dir(drafter_dir: str, artifact_dir: Path, experiment: str, model: str,
                         tracking_uri: str | None = None) -> tuple[str, str]:
    """Log `drafter_dir` as the `drafter` artifact of a run in a new experiment (artifacts under
    `artifact_dir`) of `tracking_uri` (default $MLFLOW_TRACKING_URI) and register it as a new version of
    `model` (MLflow 3: a plain artifact dir registers via create_model_version). Returns (run id, version)."""
    import mlflow

    mlflow.set_tracking_uri(tracking_uri or os.environ["MLFLOW_TRACKING_URI"])
    client = mlflow.MlflowClient()
    experiment_id = client.create_experiment(experiment, artifact_location=artifact_dir.as_uri())
    with mlflow.start_run(experiment_id=experiment_id) as run:
        mlflow.log_artifacts(drafter_dir, "drafter")
    client.create_registered_model(model)
    version = client.create_model_version(model, f"runs:/{run.info.run_id}/drafter", run.info.run_id).version
    return run.info.run_id, str(version)
