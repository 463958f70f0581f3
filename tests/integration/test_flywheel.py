"""The drafter flywheel end to end on the local stack (S3 + MLflow + Ray) with the `tiny` target:

serve (Ray Serve, drafter models:/flywheel-tiny@serving) -> traffic in two domains, the code domain
shifted away from what the drafter was trained on -> capture into S3 -> drift flagged for code only
-> retrain (jobs.train init_from the serving version, on captured traffic mixed with the original
rollouts) -> paired evaluation + promotion -> Serve rolls to the new version while requests keep
flowing. Checks: every captured request stored exactly once, no request failed during the rollout,
the API key appears nowhere in S3 or MLflow.

The tiny target is a random network: a drafter learns it only by memorising its answers, so the
traffic repeats a few prompts per domain (the held-out rows are repeats of trained prompts). Greedy
decoding keeps the acceptance figures deterministic. `make test` runs it in the group that shares one
local stack (tests/conftest.py `local_stack`), after the storage, rollout and learning-curve tests.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

pytestmark = [pytest.mark.integration]  # in `make test`, on the session stack of tests/conftest.py

MODEL = "flywheel-tiny"
EXPERIMENT = "flywheel-test"
SECRET = "sk-flywheel-e2e-0d4c1f9a"
KEY_ENV = "DSPARK_FLYWHEEL_E2E_KEY"
ROOT = "s3://dspark/tests/flywheel"
MATH = ["what is the sum of 12 and 30", "solve 7 + 5 and add the total", "how many is 3 times 4"]
OLD_CODE = ["def f(x): return x * 2", "import list class value", "print the value of x"]
NEW_CODE = ["water oil day people", "long down find call come", "made part look like him"]  # shifted "code"
REPEATS = 3  # per prompt: the first two captured as training rows, the last held out
HOLDOUT = 0.5
MAX_TOKENS = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rollout_rows(target, texts: list[str], domain: str) -> list[dict]:
    """Greedy target answers as rollout-schema rows (what jobs.generate writes)."""
    prompts = [target.chat_ids([{"role": "user", "content": t}]) for t in texts]
    answers = target.generate(prompts, max_new_tokens=MAX_TOKENS, temperature=0.0)
    return [{"prompt_id": hashlib.sha256(t.encode()).hexdigest()[:32], "source": "seed", "domain": domain,
             "split": "train", "messages": [{"role": "user", "content": t},
                                            {"role": "assistant", "content": target.tokenizer.decode(a)}],
             "input_ids": p + a, "loss_mask": [0] * len(p) + [1] * len(a), "num_prompt_tokens": len(p),
             "num_generated_tokens": len(a), "num_turns": 1, "finish_reason": "length",
             "turn_finish_reasons": ["length"], "target": "tiny", "target_revision": target.revision,
             "sampling": "{}", "chunk": 0} for t, p, a in zip(texts, prompts, answers)]


def overfit(target, rows: list[dict], steps: int):
    """The first drafter: memorise the original rollouts (math + the old code style)."""
    from dspark.drafters import DrafterConfig, build_drafter
    from dspark.training.batching import collate
    from dspark.training.loss import drafter_loss

    torch.manual_seed(0)
    drafter = build_drafter(DrafterConfig(algo="dspark", block_size=4, num_layers=1, rank=32, anchors_per_seq=32,
                                          mask_token_id=None), target)  # a learned MASK: this scenario's drafter
    batch = collate({k: [r[k] for r in rows] for k in ("input_ids", "loss_mask")}, 128, target.pad_token_id)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    drafter.train()
    for _ in range(steps):
        out = drafter_loss(drafter, target, batch["input_ids"], batch["loss_mask"], batch["attention_mask"], gen)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    return drafter.eval()


def register_first_version(drafter, tmp: Path) -> str:
    from dspark.drafters import save_drafter
    from dspark.io import tracking
    from dspark.io.tracking import registry

    run_id = tracking.start_run(EXPERIMENT, "first-drafter")
    save_drafter(drafter, str(tmp / "drafter"))
    tracking.log_artifact(str(tmp / "drafter"), "drafter")
    version = registry.register_model_version(run_id, MODEL, "drafter", ["serving"])
    tracking.end_run()
    return version


def write_jsonl(path: Path, texts: list[str]) -> str:
    path.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in texts))
    return str(path)


def chat(client: httpx.Client, text: str, domain: str, request_id: str | None = None) -> httpx.Response:
    return client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": text}], "max_tokens": MAX_TOKENS, "temperature": 0,
        "metadata": {"domain": domain}}, headers={"x-request-id": request_id} if request_id else None)


def wait_for(what: str, check, timeout_s: float = 90.0):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = check()
        if value:
            return value
        time.sleep(1.0)
    raise AssertionError(f"timed out waiting for {what}")


def run_train(cfg: dict, tmp: Path, gcs: str) -> dict:
    """`python -m jobs.train` against the stack's Ray (a separate driver, as a user runs it)."""
    import yaml

    path = tmp / "retrain.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "RAY_AUTH_MODE": "token", "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-m", "jobs.train", "--config", str(path), "--set", f"ray.address={gcs}"],
                          env=env, capture_output=True, text=True, timeout=1200,
                          cwd=Path(__file__).resolve().parents[2])
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, f"jobs.train failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1])


def everything_stored() -> bytes:
    """Every object of the stack's buckets (rollouts, captures, windows, checkpoints, MLflow artifacts)
    and MLflow's own records (runs' params, tags, metric names; model versions' tags)."""
    from mlflow import MlflowClient

    from dspark.io import storage

    blobs = [storage.read_bytes(uri) for bucket in ("s3://dspark/", "s3://mlflow/") for uri in storage.list_files(bucket)]
    client = MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])
    for exp in client.search_experiments():
        for run in client.search_runs([exp.experiment_id]):
            blobs.append(json.dumps([run.data.params, run.data.tags, sorted(run.data.metrics)]).encode())
    for version in client.search_model_versions(f"name='{MODEL}'"):
        blobs.append(json.dumps([version.tags, version.description, version.source]).encode())
    return b"\n".join(blobs)


@pytest.mark.timeout(2700)
def test_flywheel_end_to_end(local_stack, tmp_path, caplog, monkeypatch):
    import pyarrow as pa
    from ray import serve

    from dspark.config import RayConfig, dump_config
    from dspark.flywheel import drift as drift_lib
    from dspark.flywheel.capture import read_captures, row_id_in
    from dspark.io import storage
    from dspark.io.tracking import registry
    from dspark.models.target import load_target
    from jobs import drift, promote, retrain_data
    from jobs.serve import ServeJobConfig, deploy
    from pipelines.ray_cluster import init_ray
    from dspark.io.storage.rollout_store import write_parquet
    from dspark.data.schema import ROLLOUT_SCHEMA

    t0 = time.time()
    stage = {}

    def mark(name: str) -> None:
        stage[name] = time.time() - t0
        print(f"\n[flywheel] {name}: {stage[name]:.0f} s", flush=True)
    target = load_target("tiny")
    monkeypatch.setenv(KEY_ENV, SECRET)
    ray_cfg = RayConfig(address=local_stack.ray_gcs_address)

    # ---- the first drafter: original rollouts (math + old-style code), memorised, registered @serving
    original = rollout_rows(target, MATH, "math") + rollout_rows(target, OLD_CODE, "code")
    write_parquet(f"{ROOT}/original/part-00000.parquet", original, ROLLOUT_SCHEMA)
    v1 = register_first_version(overfit(target, original, steps=60), tmp_path)
    bench = {"math": write_jsonl(tmp_path / "math.jsonl", MATH), "code": write_jsonl(tmp_path / "code.jsonl", OLD_CODE)}
    tracking_cfg = {"experiment": EXPERIMENT}
    # float32 throughout (evaluation, serving, retraining's frozen forward), the dtype the memorised rows were
    # answered in: greedy acceptance of a memorised drafter is what this test reads, not what `auto` picks here
    eval_base = {"target": "tiny", "benchmark_dir": None, "decode": {"greedy": True, "max_new_tokens": MAX_TOKENS},
                 "workers": {"num_workers": 0, "dtype": "float32"}}
    promote.run(promote.PromoteConfig.model_validate({  # the evaluation baseline of v1, per domain
        "model": MODEL, "tracking": tracking_cfg, "eval": {**eval_base, "output": f"{ROOT}/eval-v1",
        "benchmarks": [{"path": p, "name": f"bench-{d}", "domain": d} for d, p in bench.items()]}}))
    baseline = registry.baseline(MODEL, v1)
    assert set(baseline) == {"math", "code"} and min(baseline.values()) > 2.0, baseline
    mark("first drafter + baseline")

    # ---- serve it with capture on
    port = free_port()
    serve_cfg = ServeJobConfig.model_validate({
        "model": {"target": "tiny", "drafter": f"models:/{MODEL}@serving", "served_name": "dspark-tiny",
                  "dtype": "float32"},
        "engine": {"scheduler": {"mode": "fixed"}, "max_model_len": 256, "max_batch": 16},
        "api": {"api_key_env": KEY_ENV, "max_tokens_limit": 64},
        "deployment": {"name": "flywheel", "num_cpus": 0.5, "health_check_period_s": 2},
        "http": {"port": port},
        "flywheel": {"output": f"{ROOT}/live", "summary_every_s": 1, "capture": {
            "enabled": True, "sample_rate": 1.0, "max_per_s": 100, "domains": ["math", "code"],
            "holdout_fraction": HOLDOUT, "shard_rows": 8, "flush_every_s": 1}},
        "ray": {"address": local_stack.ray_gcs_address}, "ready_timeout_s": 300})
    serve_path = tmp_path / "serve.yaml"
    serve_path.write_text(dump_config(serve_cfg))
    init_ray(ray_cfg)
    url, _ = deploy(serve_cfg)
    auth = {"authorization": f"Bearer {SECRET}"}
    try:
        with httpx.Client(base_url=url, headers=auth, timeout=120) as client:
            assert client.get("/v1/models").json()["data"][0]["drafter"] == f"models:/{MODEL}/{v1}"
            sent = [(t, d, row_id_in("train" if r < REPEATS - 1 else "holdout", f"{d}{i}r{r}", HOLDOUT))
                    for r in range(REPEATS) for d, texts in (("math", MATH), ("code", NEW_CODE))
                    for i, t in enumerate(texts)]
            for text, domain, request_id in sent:
                assert chat(client, text, domain, request_id).status_code == 200
        mark("serve + traffic")

        # ---- capture: every request exactly once; drift: code flagged, math not
        captured = wait_for("all captures committed",
                            lambda: (t := read_captures(f"{ROOT}/live")).num_rows >= len(sent) and t)
        rows = captured.to_pylist()
        assert len(rows) == len(sent) and len({r["prompt_id"] for r in rows}) == len(sent)
        assert sorted((r["messages"][0]["content"], r["domain"], r["prompt_id"]) for r in rows) == sorted(sent)
        assert sum(r["split"] == "holdout" for r in rows) == len(sent) // REPEATS
        assert {r["drafter_version"] for r in rows} == {v1}
        wait_for("acceptance windows", lambda: sum(a.requests for a in drift_lib.read_windows(
            f"{ROOT}/live", 0, v1).values()) >= len(sent))
        with caplog.at_level(logging.WARNING, logger="dspark.drift"):
            found = drift.run(drift.DriftConfig(model=f"models:/{MODEL}@serving", flywheel_output=f"{ROOT}/live",
                                                window_s=3600, margin=0.3, min_draft_tokens=20,
                                                tracking=tracking_cfg))
        assert found["drifted"] == ["code"], found
        assert any("domain 'code'" in r.getMessage() for r in caplog.records)
        assert registry.version_tags(MODEL, v1)["dspark.drift"] == "code"
        mark("capture + drift")

        # ---- retrain from the serving version on captured traffic + original rollouts
        data = retrain_data.run(retrain_data.RetrainDataConfig(
            flywheel_output=f"{ROOT}/live", original_rollouts=f"{ROOT}/original", capture_fraction=0.5,
            output=f"{ROOT}/retrain", tracking=tracking_cfg))
        assert data["captured_rows"] == sum(r["split"] == "train" for r in rows) and data["original_rows"] > 0
        summary = run_train({
            "run_name": "flywheel-retrain", "target": "tiny", "init_from": f"models:/{MODEL}@serving",
            "target_forward_dtype": "same",
            "drafter": {"algo": "dspark", "anchors_per_seq": 32},
            "data": {"rollouts": f"{ROOT}/retrain", "max_seq_len": 128},
            "optim": {"lr": 1e-2, "warmup_ratio": 0.0, "schedule": "constant", "micro_batch_size": 8,
                      "global_batch_size": 8, "max_steps": 30},
            "deepspeed": {"zero_stage": 2}, "scaling": {"num_workers": 1, "cpus_per_worker": 0.5},
            "checkpoint": {"storage_path": f"{ROOT}/checkpoints", "every_steps": 1000},
            "tracking": {"experiment": EXPERIMENT, "registered_model": MODEL, "alias": "candidate"}},
            tmp_path, local_stack.ray_gcs_address)
        v2 = summary["registered_model"]["version"]
        print(f"\n[flywheel] retraining set {json.dumps({k: data[k] for k in ('captured_rows', 'original_rows', 'captured_by_domain')})}"
              f"\n[flywheel] retrained: {json.dumps({k: summary['metrics'].get(k) for k in ('loss', 'token_acc', 'expected_accept_len', 'step')})}")
        mark("retrain")

        # ---- evaluate, promote, roll the endpoint while requests keep coming
        failures, done = [], threading.Event()

        def keep_asking() -> None:
            with httpx.Client(base_url=url, headers=auth, timeout=300) as c:
                while not done.is_set():
                    r = chat(c, MATH[0], "math")
                    if r.status_code != 200:
                        failures.append(r.status_code)

        background = threading.Thread(target=keep_asking, daemon=True)
        background.start()
        decision = promote.run(promote.PromoteConfig.model_validate({
            "model": MODEL, "candidate": f"models:/{MODEL}/{v2}", "tolerance": 0.3, "tracking": tracking_cfg,
            "eval": {**eval_base, "output": f"{ROOT}/eval-v{v2}", "heldout": f"{ROOT}/retrain/heldout",
                     "benchmarks": [{"path": bench["math"], "name": "bench-math", "domain": "math"}]},
            "rollout": {"serve_config": str(serve_path), "timeout_s": 300}, "ray": ray_cfg.model_dump()}))
        done.set()
        background.join(300)
        mark("evaluate + promote + rollout")
        print(f"\n[flywheel] decision {json.dumps(decision['decision'])}\n[flywheel] τ {decision['tau']}\n"
              f"[flywheel] stages (cumulative s): {json.dumps({k: round(v) for k, v in stage.items()})}")
        assert decision["decision"]["promote"], decision
        assert registry.version_of(MODEL, "serving") == v2
        assert not failures, f"requests failed during the rollout: {failures}"
        with httpx.Client(base_url=url, headers=auth, timeout=120) as client:
            assert client.get("/v1/models").json()["data"][0]["drafter"] == f"models:/{MODEL}/{v2}"
            assert chat(client, NEW_CODE[0], "code").status_code == 200
    finally:
        serve.delete("flywheel")
        serve.shutdown()

    tags = registry.version_tags(MODEL, v2)
    assert tags["dspark.promotion"].startswith(f"promoted over v{v1}") and "dspark.baseline.code.tau" in tags
    stored = everything_stored()
    assert SECRET.encode() not in stored, "the API key must never be stored"
    assert pa is not None and storage is not None
