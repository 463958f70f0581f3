"""The demo driver (jobs/demo/driver.py, `python -m jobs.demo`): its checks and stage table (fast), and the
smoke profile end to end on the `tiny` target (slow, integration: starts the local stack and submits every
stage as a Ray job).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.unit.jobs.demo.test_driver import ROOT  # noqa: F401 (shared helpers and fixtures)


def stage_of(run) -> str:
    return run.data.tags.get("dspark.stage") or run.data.tags.get("mlflow.runName", "").split("-")[0]


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(3600)
def test_smoke_demo_end_to_end(monkeypatch):
    from dspark.devstack import stack
    from dspark.io import storage

    cfg = stack.StackConfig.from_env()
    was_up = all(info["running"] for info in stack.status(cfg).values())
    log_path = cfg.state_dir / "demo" / "test_smoke.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    try:
        with open(log_path, "w") as log:
            proc = subprocess.run([sys.executable, "-m", "jobs.demo", "--profile", "smoke"], cwd=ROOT,
                                  stdout=log, stderr=subprocess.STDOUT, timeout=3000)
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-60:])
        assert proc.returncode == 0, f"demo failed (log {log_path}):\n{tail}"
        summary = json.loads((cfg.state_dir / "demo" / "summary.json").read_text())
        assert summary["profile"] == "smoke" and summary["target"] == "tiny"
        print(f"smoke demo: {time.monotonic() - start:.0f} s; stages:",
              {k: (v["status"], round(v["wall_s"], 1)) for k, v in summary["stages"].items()})

        for key, value in stack.load_env(cfg.state_dir).items():
            monkeypatch.setenv(key, value)
        # rollouts in the bucket
        rollouts = storage.list_files(summary["rollouts"])
        assert summary["rollouts"].startswith("s3://dspark/demo/smoke/")
        assert any(f.endswith(".parquet") for f in rollouts), f"no Parquet under {summary['rollouts']}"
        # an MLflow run per stage, all finished
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])  # not one cached by an earlier test
        experiment = client.get_experiment_by_name(summary["mlflow_experiment"])
        assert experiment is not None, f"no MLflow experiment {summary['mlflow_experiment']}"
        runs = client.search_runs([experiment.experiment_id], max_results=500)
        finished = {stage_of(r) for r in runs if r.info.status == "FINISHED"}
        assert {"generate", "train", "calibrate", "evaluate"} <= finished, f"finished runs by stage: {finished}"
        # a registered drafter
        name, ver = summary["drafters"]["dspark"].removeprefix("models:/").split("/")
        assert client.get_model_version(name, ver).status == "READY"
        # results.json with tau for the served drafter on every benchmark
        results = json.loads(storage.read_text(summary["results"]))
        assert results and summary["tau"], "results.json / tau table empty"
        for per_bench in summary["tau"].values():
            assert all(1.0 <= tau for tau in per_bench.values() if tau is not None)
        # an endpoint answer (the demo's chats, and one more request now)
        assert summary["chat"] and all(c["answer"].strip() for c in summary["chat"])
        from openai import OpenAI

        api = OpenAI(base_url=summary["endpoint"], api_key=os.environ.get("DSPARK_API_KEY", "not-needed"))
        model = api.models.list().data[0].id
        reply = api.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi!"}], max_tokens=8)
        assert reply.choices[0].message.content and reply.usage.completion_tokens >= 1
    finally:
        if not was_up:
            stack.down(cfg)
