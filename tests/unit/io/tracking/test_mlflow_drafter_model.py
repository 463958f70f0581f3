"""Drafters as MLflow models (dspark.io.tracking.registry.publish_drafter + dspark.io.tracking.drafter_model), the serving
alias, and system metrics through MLflow's public API; against a SQLite store in a temp dir.

- a registered version's source is a LoggedModel (pyfunc flavor), not a bare artifact folder; the run's
  metrics are linked to that model and the version carries algo/target/τ/draft-vocabulary tags;
- `mlflow.pyfunc.load_model("models:/<name>@champion")` proposes the drafter's own greedy block;
- every drafter reference still loads the checkpoint inside the MLflow model;
- `@latest` (MLflow-reserved) still resolves, with a DeprecationWarning; `champion` moves only by `promote`.
"""
from __future__ import annotations

import time

import pytest
import torch

from dspark.drafters import DrafterConfig, build_drafter, save_drafter
from dspark.io import tracking
from dspark.io.tracking import registry
from dspark.models.target import load_target
from tests.mlflow_store import new_sqlite_store


@pytest.fixture(scope="module")
def tiny():
    return load_target("tiny")


@pytest.fixture
def store(monkeypatch, tmp_path):
    import mlflow

    uri = new_sqlite_store(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("DSPARK_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))
    mlflow.set_tracking_uri(uri)
    yield mlflow.MlflowClient(uri)
    tracking.end_run()


def trained_run(tiny, tmp_path, tau: float):
    torch.manual_seed(0)
    drafter = build_drafter(DrafterConfig(algo="dspark", block_size=4, num_layers=1, rank=8,
                                          mask_token_id="reserved"), tiny)
    ckpt = save_drafter(drafter, str(tmp_path / f"ckpt-{tau}"))
    run_id = tracking.start_run("drafter-models", run_name="train")
    tracking.log_metrics({"loss": 2.5, "expected_accept_len": tau}, step=3)
    tracking.log_artifact(ckpt, "drafter")
    return drafter, ckpt, run_id


def test_a_registered_drafter_is_an_mlflow_model_with_linked_metrics_and_tags(store, tiny, tmp_path):
    from dspark.io.tracking.drafter_model import drafter_version_tags

    drafter, ckpt, run_id = trained_run(tiny, tmp_path, tau=2.75)
    tags = drafter_version_tags(ckpt, 2.75, "training expected_accept_len")
    version = registry.publish_drafter(run_id, "tiny-dspark-drafter", ckpt, ["trained"], tags=tags)
    tracking.end_run()
    mv = store.get_model_version("tiny-dspark-drafter", version)
    assert mv.source.startswith("models:/m-")  # a LoggedModel (an MLflow model), not a bare artifact folder
    model_id = mv.source.removeprefix("models:/")
    assert {"dspark.algo": "dspark", "dspark.target": "tiny", "dspark.tau": "2.7500", "dspark.block_size": "4",
            "dspark.draft_vocab_size": str(tiny.vocab_size), "dspark.mask_token_id": "0"}.items() <= mv.tags.items()
    model = store.get_logged_model(model_id)
    assert model.source_run_id == run_id and model.model_type == registry.DRAFTER_MODEL_TYPE
    assert {m.key: m.value for m in model.metrics} == {"loss": 2.5, "expected_accept_len": 2.75}  # linked
    assert model.params["algo"] == "dspark" and model.tags["dspark.tau"] == "2.7500"
    assert str(store.get_model_version_by_alias("tiny-dspark-drafter", "trained").version) == version
    assert "champion" not in store.get_registered_model("tiny-dspark-drafter").aliases  # registering never serves
    assert {"MLmodel", "artifacts"} <= {f.path for f in store.list_logged_model_artifacts(model_id)}


def test_pyfunc_load_model_proposes_the_drafters_own_block(store, tiny, tmp_path):
    import mlflow

    from dspark.io.drafter_source import load_drafter_ref
    from dspark.decoding.sampling import SamplingParams

    drafter, ckpt, run_id = trained_run(tiny, tmp_path, tau=2.0)
    version = registry.publish_drafter(run_id, "tiny-dspark-drafter", ckpt, [])
    tracking.end_run()
    registry.promote("tiny-dspark-drafter", version, registry.SERVING_ALIAS, "test: first version")
    model = mlflow.pyfunc.load_model("models:/tiny-dspark-drafter@champion")
    prompt = tiny.chat_ids([{"role": "user", "content": "count to five"}])
    (out,) = model.predict({"prompt_ids": [prompt]})
    assert len(out["draft_tokens"]) == 4 and len(out["confidences"]) == 4
    # the same block the drafter proposes after the target's greedy anchor
    loaded = load_drafter_ref("models:/tiny-dspark-drafter@champion", tiny)  # the checkpoint inside the model
    ids = torch.tensor([prompt])
    fwd = tiny.forward(ids, cache=tiny.new_cache(), use_cache=True, layer_ids=loaded.layer_ids, logits_at="last")
    assert out["anchor"] == int(fwd.logits[0, -1].argmax())
    state = loaded.new_state()
    loaded.extend_context(state, fwd.features[0], ids[0])
    expected = loaded.propose(state, out["anchor"], 4, SamplingParams(temperature=0.0))
    assert out["draft_tokens"] == expected.tokens.tolist()


def test_registering_never_moves_the_serving_alias_only_promote_does(store, tiny, tmp_path):
    from dspark.io.drafter_source import resolve_ref

    versions = []
    for tau in (1.5, 2.5):
        _, ckpt, run_id = trained_run(tiny, tmp_path, tau)
        versions.append(registry.publish_drafter(run_id, "d", ckpt, ["trained"]))
        tracking.end_run()
    assert versions == ["1", "2"] and set(store.get_registered_model("d").aliases) == {"trained"}
    registry.promote("d", "1", registry.SERVING_ALIAS, "test: the evaluated one")
    assert resolve_ref("models:/d@champion").model_version == "1"  # the newer, unevaluated v2 is not served
    assert store.get_model_version("d", "1").tags["dspark.promoted.champion"] == "test: the evaluated one"
    assert resolve_ref("models:/d/latest").model_version == "2"  # MLflow's own keyword
    with pytest.warns(DeprecationWarning, match="MLflow reserves 'latest'.*@champion"):
        assert resolve_ref("models:/d@latest").model_version == "2"
    _, ckpt, run_id = trained_run(tiny, tmp_path, 3.0)
    for bad in ("latest", "v3", "my alias"):  # refused before anything is uploaded or registered
        with pytest.raises(ValueError, match=repr(bad)):
            registry.publish_drafter(run_id, "d", ckpt, ["trained", bad])
    tracking.end_run()
    assert [v.version for v in store.search_model_versions("name='d'")] != [] and \
        max(int(v.version) for v in store.search_model_versions("name='d'")) == 2


def test_system_metrics_go_through_mlflows_public_log_system_metrics(store, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.2")
    from mlflow.tracking import fluent

    run_id = tracking.start_run("sysmetrics", run_name="owner", system_metrics=True)
    # MLflow's fluent start_run(run_id=..., log_system_metrics=True) registered its own sampler for the run
    assert run_id in fluent.run_id_to_system_metrics_monitor
    assert mlflow.active_run() is None  # on a helper thread: the caller's fluent state is untouched
    time.sleep(1.0)
    tracking.end_run()
    assert run_id not in fluent.run_id_to_system_metrics_monitor
    run = store.get_run(run_id)
    assert run.info.status == "FINISHED" and any(k.startswith("system/cpu_utilization") for k in run.data.metrics)


def test_an_attached_worker_samples_system_metrics_and_leaves_the_run_running(store, monkeypatch):
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.2")
    experiment = store.create_experiment("sysmetrics-worker")
    run_id = store.create_run(experiment).info.run_id  # the driver's run
    tracking.attach_run(run_id, system_metrics=True, node_id="worker-1")
    time.sleep(1.0)
    tracking.end_run()  # the worker detaches: the driver still owns the run
    run = store.get_run(run_id)
    assert run.info.status == "RUNNING"
    assert any(k.startswith("system/worker-1/cpu_utilization") for k in run.data.metrics), run.data.metrics


@pytest.mark.heavy
def test_the_mlflow_model_loads_where_dspark_is_not_installed(store, tiny, tmp_path):
    """The pyfunc model carries the dspark code (code_paths) and lists what that code imports, so
    `mlflow.pyfunc.load_model` works in a process that cannot import an installed dspark."""
    import json
    import subprocess
    import sys

    from tests.paths import REPO

    _, ckpt, run_id = trained_run(tiny, tmp_path, tau=2.0)
    version = registry.publish_drafter(run_id, "portable-drafter", ckpt, ["trained"])
    tracking.end_run()
    script = f"""
import json, sys
sys.meta_path = [f for f in sys.meta_path if "editable" not in repr(f)]  # hide the editable dspark install
sys.path = [p for p in sys.path if p and p.rstrip("/") != {str(REPO)!r}]  # nor the checkout itself
try:
    import dspark
    raise SystemExit("dspark is still importable: the test would prove nothing")
except ModuleNotFoundError:
    pass
import mlflow
model = mlflow.pyfunc.load_model("models:/portable-drafter/{version}")
(out,) = model.predict({{"prompt_ids": [[1, 2, 3, 4]]}})
import dspark
print(json.dumps({{"dspark": dspark.__file__, "drafts": len(out["draft_tokens"])}}))
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["drafts"] == 4 and not result["dspark"].startswith(str(REPO))  # the model's own copy
    import mlflow

    reqs = mlflow.pyfunc.get_model_dependencies(f"models:/portable-drafter/{version}")
    listed = {line.split("==")[0].lower() for line in open(reqs).read().split() if "==" in line}
    assert {"torch", "transformers", "pydantic", "pyyaml", "mlflow"} <= listed


def test_a_corrupt_reference_to_a_missing_alias_or_model_fails_naming_it(store, tiny, tmp_path):
    """models:/ references that do not resolve fail with the reference in the message, at deployment (the
    Serve app pins the alias before any replica starts), not deep inside a replica."""
    from dspark.io.drafter_source import resolve_ref
    from dspark.serve.config import ServeConfig

    _, ckpt, run_id = trained_run(tiny, tmp_path, tau=2.0)
    registry.publish_drafter(run_id, "d", ckpt, ["trained"])
    tracking.end_run()
    for ref in ("models:/d@champion", "models:/no-such-model@trained", "models:/d/7"):
        with pytest.raises(ValueError, match=ref.replace("/", ".")):
            resolve_ref(ref)
    pytest.importorskip("ray.serve")
    from dspark.serve.deployment import deployment_for

    with pytest.raises(ValueError, match="models:/d@champion"):
        deployment_for(ServeConfig.model_validate({"model": {"drafter": "models:/d@champion"}}))
