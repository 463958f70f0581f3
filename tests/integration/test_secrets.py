"""Secrets stay secret (slow tier, the real local stack): after a `jobs.train` run with tracking on, neither the
S3 credentials nor an API key in the job's environment appear in the job's log (driver and Ray workers),
in the MLflow run's params, tags or metrics names, or in any text artifact the run logged."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.integration.test_train import finish_train_job, stack_job, start_train_job, tiny_rollouts  # noqa: F401

pytestmark = [pytest.mark.integration, pytest.mark.slow]
API_KEY = "sk-dspark-test-5e7c1d0b9a"


@pytest.mark.timeout(600)
def test_secret_credentials_never_reach_logs_params_tags_or_artifacts(local_stack, tiny_rollouts, tmp_path):
    from mlflow import MlflowClient

    cfg = stack_job(tiny_rollouts, tmp_path, **{"run_name": "test-secrets", "fault": None, "optim.max_steps": 4,
                                                "tracking.registered_model": "test-secrets"})
    _, out, err = finish_train_job(start_train_job(cfg, local_stack, tmp_path, DSPARK_API_KEY=API_KEY), 540)
    secrets = {name: os.environ[name] for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    secrets["DSPARK_API_KEY"] = API_KEY
    assert all(len(value) >= 8 for value in secrets.values()), "the stack's credentials are real strings"

    def leaks(text: str) -> list[str]:
        return [name for name, value in secrets.items() if value in text]

    assert not leaks(out + err), "a credential is in the job's log"
    client = MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name("test-train")
    (run,) = client.search_runs([exp.experiment_id], "tags.mlflow.runName = 'test-secrets'")
    assert run.data.params and run.data.tags
    assert not leaks(repr(run.data.params) + repr(run.data.tags) + repr(sorted(run.data.metrics)))
    artifacts = Path(client.download_artifacts(run.info.run_id, "", str(tmp_path / "artifacts")))
    texts = [p for p in artifacts.rglob("*") if p.is_file() and p.suffix in (".json", ".yaml", ".yml", ".txt", ".md")]
    assert texts, "the run logged text artifacts (its config, the drafter's config)"
    for text in texts:
        assert not leaks(text.read_text(errors="replace")), text
