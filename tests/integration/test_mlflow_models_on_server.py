"""Drafters as MLflow models on the real stack (MLflow server with proxied S3 artifacts, `local_stack`):
logged as a LoggedModel, registered with tags and the serving alias, loaded back by pyfunc and by the
drafter reference resolver. Run under `flock /tmp/dspark-heavy.lock`."""
from __future__ import annotations

import time

import pytest
import torch

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_drafter_model_round_trip_through_the_tracking_server(local_stack, tmp_path, monkeypatch):
    import mlflow

    from dspark.drafters import DrafterConfig, build_drafter, save_drafter
    from dspark.io import tracking
    from dspark.io.tracking import registry
    from dspark.io.tracking.drafter_model import drafter_version_tags
    from dspark.io.drafter_source import load_drafter_ref
    from dspark.models.target import load_target

    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.2")  # sample within the short run
    tiny = load_target("tiny")
    torch.manual_seed(0)
    drafter = build_drafter(DrafterConfig(algo="dspark", block_size=3, num_layers=1, rank=8,
                                          mask_token_id="reserved"), tiny)
    ckpt = save_drafter(drafter, str(tmp_path / "ckpt"))
    run_id = tracking.start_run("drafter-models-server", run_name="train", system_metrics=True)
    tracking.log_metrics({"loss": 1.25, "expected_accept_len": 2.0}, step=1)
    time.sleep(1.0)  # a few system-metrics samples
    version = registry.publish_drafter(run_id, "server-tiny-drafter", ckpt, ["trained"],
                                       tags=drafter_version_tags(ckpt, 2.0, "test"))
    tracking.end_run()
    registry.promote("server-tiny-drafter", version, registry.SERVING_ALIAS, "test: first version")

    client = mlflow.MlflowClient()
    mv = client.get_model_version_by_alias("server-tiny-drafter", "champion")
    assert str(mv.version) == version and mv.source.startswith("models:/m-") and mv.tags["dspark.tau"] == "2.0000"
    model = client.get_logged_model(mv.source.removeprefix("models:/"))
    assert {m.key for m in model.metrics} >= {"loss", "expected_accept_len"}
    assert any(k.startswith("system/") for k in client.get_run(run_id).data.metrics)  # MLflow's sampler ran
    pyfunc = mlflow.pyfunc.load_model("models:/server-tiny-drafter@champion")
    (out,) = pyfunc.predict({"prompt_ids": [tiny.chat_ids([{"role": "user", "content": "hi"}])]})
    assert len(out["draft_tokens"]) == 3
    loaded = load_drafter_ref("models:/server-tiny-drafter@champion", tiny)
    assert all(torch.equal(v, drafter.state_dict()[k]) for k, v in loaded.state_dict().items())
