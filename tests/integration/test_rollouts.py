"""Rollout generation: the engine (unit, tiny target) and the Ray Data job on the local stack
(end to end into S3, exactly-once resume after an injected failure, bad input, fail-fast)."""

from __future__ import annotations

import json

import os

import subprocess

import sys

import uuid

from pathlib import Path

import pyarrow.parquet as pq

import pytest

from dspark.io import storage

from dspark.config import load_config

from dspark.data import schema

from dspark.data.prompts import load_prompts, prompt_id_of


from dspark.data.rollout_engine import RolloutEngine

from dspark.io.storage.rollout_store import read_commits, read_rollouts
from tests.job_files import read_dropped, read_errors, write_jsonl
from tests.unit.data.test_rollouts import check_row, mask_runs, tiny  # noqa: F401 (shared helpers and fixtures)
from tests.paths import REPO



REPO = REPO



@pytest.fixture(scope="module")
def stack_ray(local_stack):
    import ray

    from pipelines.ray_cluster import init_ray
    from dspark.config import RayConfig

    init_ray(RayConfig(address=local_stack.ray_gcs_address))
    yield local_stack
    ray.shutdown()



def s3_prefix(name: str) -> str:
    return f"s3://dspark/tests/rollouts-{name}-{uuid.uuid4().hex[:8]}"



def job_config(output: str, sources: list[dict], *overrides: str):
    from jobs.generate import GenerateConfig

    base = [f"output={output}", f"sources={json.dumps(sources)}", "tracking.experiment=test-generate",
            "compute.batch_size=8", "compute.dtype=float32", "sampling.max_new_tokens=16"]
    return load_config(GenerateConfig, str(REPO / "configs" / "generate" / "tiny.yaml"), base + list(overrides))



def ray_job(stack, module: str, config: str, *overrides: str, timeout: int = 400) -> dict:
    """`ray job submit ... -- python -m <module>` as a user types it; returns the job's last JSON line."""
    sets = [arg for item in overrides for arg in ("--set", item)]
    cmd = [str(Path(sys.executable).parent / "ray"), "job", "submit", "--address", stack.env["RAY_ADDRESS"],
           "--runtime-env", "infra/runtime_env.yaml", "--working-dir", ".", "--",
           "python", "-m", module, "--config", config, *sets]
    proc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, RAY_ADDRESS=stack.env["RAY_ADDRESS"]),
                          capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, f"{module} failed ({proc.returncode}):\n{proc.stdout[-4000:]}"
    return json.loads(lines[-1])



@pytest.mark.integration
def test_end_to_end_jsonl_to_parquet_in_s3(stack_ray, tiny):
    import mlflow

    from jobs.common import RUN_ID_FILE
    from jobs.generate import run

    prefix = s3_prefix("e2e")
    single = [{"turns": [f"Question {i}: what is {i} + {i}?"]} for i in range(26)]
    multi = [{"messages": [{"role": "user", "content": f"Tell me about {w}"}, {"role": "assistant", "content": "old"},
                           {"role": "user", "content": "Shorter please"}]} for w in ("cats", "dogs", "code")]
    three = [{"conversations": [{"from": "human", "value": "one"}, {"from": "human", "value": "two"},
                                {"from": "human", "value": "three"}]}]
    write_jsonl(single + multi + three + single[:2], f"{prefix}/prompts.jsonl", storage)  # 2 duplicates
    cfg = job_config(f"{prefix}/out", [{"uri": f"{prefix}/prompts.jsonl", "domain": "math"}], "chunk_size=8")
    result = run(cfg)

    counts = result.manifest["counts"]
    assert counts["records_read"] == 32 and counts["duplicates"] == 2 and counts["rows_out"] == 30
    assert counts["errors"] == 0 and result.manifest["complete"] and len(result.manifest["shards"]) == 4
    shard = result.manifest["shards"][0]
    fs, path = storage.pyarrow_fs(storage.join(cfg.output, shard))
    assert pq.read_schema(path, filesystem=fs).remove_metadata() == schema.ROLLOUT_SCHEMA
    rows = read_rollouts(cfg.output).to_pylist()
    loaded = load_prompts(cfg.sources, files=storage).prompts
    assert sorted(r["prompt_id"] for r in rows) == sorted(p.prompt_id for p in loaded)
    for row in rows:
        check_row(row, tiny, 16)
        assert row["domain"] == "math" and row["target"] == "tiny" and row["split"] in ("train", "holdout")
        assert json.loads(row["sampling"])["max_new_tokens"] == 16
    assert sorted(r["num_turns"] for r in rows) == [1] * 26 + [2] * 3 + [3]
    assert result.manifest["tokens"]["generated"] == sum(r["num_generated_tokens"] for r in rows)
    # a prompt regenerated on its own, outside Ray, gets the same answer (seed + prompt_id)
    engine = RolloutEngine(tiny, cfg.sampling, cfg.max_context_tokens)
    again = engine.run([dict(p.as_row(), chunk=0) for p in loaded[:2]])
    by_id = {r["prompt_id"]: r for r in rows}
    assert all(a["input_ids"] == by_id[a["prompt_id"]]["input_ids"] for a in again)
    # MLflow: params, metrics, sample table, manifest, config
    run_id = json.loads(storage.read_text(storage.join(cfg.output, RUN_ID_FILE)))["run_id"]
    logged = mlflow.get_run(run_id)
    assert logged.info.status == "FINISHED" and logged.data.params["target"] == "tiny"
    assert logged.data.metrics["rows_out"] == 30 and logged.data.metrics["tokens_per_s"] > 0
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(run_id)}
    assert {"samples.json", "manifest.json", "config.yaml"} <= artifacts
    assert storage.exists(storage.join(cfg.output, "config.yaml"))
    # lineage: the prompt file (content digest) in, the rollouts (manifest digest) out
    from dspark.io.tracking import lineage

    inputs = {d.dataset.name: d for d in logged.inputs.dataset_inputs}
    context = {name: {t.key: t.value for t in d.tags}["mlflow.data.context"] for name, d in inputs.items()}
    assert context == {"prompts.jsonl": "prompts", "rollouts": "generated"}
    assert inputs["prompts.jsonl"].dataset.digest == storage.dataset_digest(f"{prefix}/prompts.jsonl")
    assert inputs["rollouts"].dataset.digest == lineage.rollouts_digest(cfg.output)
    assert f"{prefix}/out" in inputs["rollouts"].dataset.source and inputs["rollouts"].dataset.source_type == "s3"



@pytest.mark.integration
def test_exactly_once_after_an_injected_failure(stack_ray, monkeypatch):
    import mlflow

    from jobs.common import RUN_ID_FILE
    from jobs.generate import run

    prefix = s3_prefix("resume")
    write_jsonl([{"turns": [f"prompt {i}"]} for i in range(20)], f"{prefix}/prompts.jsonl", storage)
    cfg = job_config(f"{prefix}/out", [{"uri": f"{prefix}/prompts.jsonl"}], "chunk_size=4",
                     "compute.batch_size=2")
    monkeypatch.setenv("DSPARK_FAIL_AFTER_CHUNKS", "2")
    with pytest.raises(RuntimeError, match="injected failure"):
        run(cfg)
    monkeypatch.delenv("DSPARK_FAIL_AFTER_CHUNKS")
    first = read_commits(cfg.output)
    assert len(first) == 2 and not storage.exists(storage.join(cfg.output, "manifest.json"))
    run_id = json.loads(storage.read_text(storage.join(cfg.output, RUN_ID_FILE)))["run_id"]
    assert mlflow.get_run(run_id).info.status == "FAILED"
    pending = next(c for c in range(5) if c not in first)
    storage.write_bytes(storage.join(cfg.output, "data", f"{schema.shard_name(pending)}.parquet"), b"half-writ")

    result = run(cfg)
    assert result.stats.chunks_skipped == len(first) and result.stats.chunks_done == 5 - len(first)
    after = read_commits(cfg.output)
    assert all(after[c]["committed_at"] == first[c]["committed_at"] for c in first)  # not regenerated
    ids = [r["prompt_id"] for r in read_rollouts(cfg.output).to_pylist()]
    expected = {p.prompt_id for p in load_prompts(cfg.sources, files=storage).prompts}
    assert len(ids) == len(set(ids)) == 20 and set(ids) == expected
    assert result.manifest["counts"]["rows_out"] == 20 and result.manifest["complete"]
    assert json.loads(storage.read_text(storage.join(cfg.output, RUN_ID_FILE)))["run_id"] == run_id
    assert mlflow.get_run(run_id).info.status == "FINISHED"  # the same MLflow run, continued
    assert run(cfg).stats.chunks_done == 0  # a third run has nothing left to do



@pytest.mark.integration
@pytest.mark.slow  # `make test-slow`; `make test` keeps the generate job's end-to-end and resume tests
def test_bad_input_gives_good_rows_and_errors_with_reasons(stack_ray, tmp_path):
    """Through the CLI, with RAY_ADDRESS as `source .dspark/env.sh` sets it (the dashboard URL)."""
    src = tmp_path / "mixed.jsonl"
    good = [{"turns": [f"good prompt {i}"]} for i in range(6)]
    write_jsonl(good[:3] + ['{"turns": ["missing brace"', {"messages": [{"role": "assistant", "content": "hi"}]},
                            {"turns": ["  "]}, {"turns": ["the a of " * 200]}, "[1, 2]"] + good[3:], str(src))
    output = s3_prefix("bad") + "/out"
    env = dict(os.environ, RAY_ADDRESS=stack_ray.env["RAY_ADDRESS"])
    cmd = [sys.executable, "-m", "jobs.generate", "--config", "configs/generate/tiny.yaml", "--set", f"output={output}",
           "--set", f"sources=[{{uri: {src}}}]", "--set", "max_context_tokens=128", "--set", "tracking.enabled=false"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["rows_out"] == 6 and summary["errors"] == 5
    expected = {"malformed_json": 1, "no_user_turn": 1, "empty_prompt": 1, "prompt_too_long": 1, "bad_record": 1}
    assert summary["errors_by_reason"] == expected
    manifest = json.loads(storage.read_text(f"{output}/manifest.json"))
    assert manifest["errors_by_reason"] == expected and manifest["counts"]["rows_out"] == 6
    errors = read_errors(output).to_pylist()
    assert sorted(e["reason"] for e in errors) == sorted(expected)
    assert all(e["detail"] and e["raw"] and e["location"].startswith(str(src)) for e in errors)
    too_long = next(e for e in errors if e["reason"] == "prompt_too_long")
    assert too_long["prompt_id"] and "context limit is 128" in too_long["detail"]
    assert {r["prompt_id"] for r in read_rollouts(output).to_pylist()} == {
        prompt_id_of("", t["turns"]) for t in good}



@pytest.mark.integration
def test_unreachable_bucket_fails_fast_before_generation(local_stack, tmp_path, capsys):
    from jobs.generate import main

    src = tmp_path / "p.jsonl"
    write_jsonl([{"turns": ["q"]}], str(src))
    code = main(["--config", str(REPO / "configs" / "generate" / "tiny.yaml"),
                 "--set", "output=s3://no-such-bucket-dspark/out", "--set", f"sources=[{{uri: {src}}}]",
                 "--set", "tracking.enabled=false"])
    err = capsys.readouterr().err
    assert code == 2 and "no-such-bucket-dspark" in err and len(err.strip().splitlines()) == 1



@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(900)
def test_synthesize_then_generate_then_train_as_ray_jobs(stack_ray):
    import mlflow

    from pipelines.synthesize import read_prompts

    prefix = s3_prefix("synth")
    synth = ray_job(stack_ray, "jobs.synthesize", "configs/synthesize/tiny.yaml", f"output={prefix}/prompts",
                    "magpie.num_prompts=8", "magpie.sampling.max_new_tokens=24", "tracking.experiment=test-synthesize",
                    "sources=[{uri: data/train/math.jsonl, domain: math, limit: 6}, "
                    "{uri: data/train/chat.jsonl, domain: chat, limit: 4}]")
    # `tiny` writes gibberish: every Magpie turn is dropped (truncated or by a filter), never silently
    assert synth["candidates"] == 18 and synth["kept"] + sum(synth["dropped"].values()) == 18
    assert synth["kept"] > 0 and set(synth["kept_by_domain"]) <= {"math", "chat", "code", "instruction_following"}
    prompts = read_prompts(f"{prefix}/prompts").to_pylist()
    dropped = read_dropped(f"{prefix}/prompts").to_pylist()
    assert len(prompts) == synth["kept"] and len(dropped) == 18 - synth["kept"]
    assert len({p["prompt_id"] for p in prompts}) == len(prompts)
    manifest = json.loads(storage.read_text(f"{prefix}/prompts/manifest.json"))
    assert manifest["format"] == "dspark-prompts/1" and manifest["complete"] and manifest["eval_prompts"] > 0
    run_id = json.loads(storage.read_text(f"{prefix}/prompts/_state/mlflow_run.json"))["run_id"]
    logged = mlflow.get_run(run_id)
    assert logged.info.status == "FINISHED" and logged.data.metrics["kept"] == synth["kept"]
    contexts = {tag.value for d in logged.inputs.dataset_inputs for tag in d.tags if tag.key == "mlflow.data.context"}
    assert {"prompt_source", "decontamination", "synthesized_prompts"} <= contexts
    plots = {a.path for a in mlflow.MlflowClient().list_artifacts(run_id, "plots")}
    assert plots == {"plots/kept_lengths_by_domain.png", "plots/lengths_kept_vs_dropped.png"}

    gen = ray_job(stack_ray, "jobs.generate", "configs/generate/tiny.yaml", f"output={prefix}/rollouts",
                  f"sources=[{{uri: {prefix}/prompts}}]", "sampling.max_new_tokens=16", "tracking.enabled=false")
    assert gen["rows_out"] == synth["kept"] and gen["errors"] == 0 and gen["complete"]
    assert {r["prompt_id"] for r in read_rollouts(f"{prefix}/rollouts").to_pylist()} == {
        p["prompt_id"] for p in prompts}

    train = ray_job(stack_ray, "jobs.train", "configs/train/tiny-dspark.yaml", f"data.rollouts={prefix}/rollouts",
                    "optim.max_steps=2", "optim.global_batch_size=8", f"checkpoint.storage_path={prefix}/ckpt",
                    "tracking.experiment=test-synthesize-train", "tracking.registered_model=test-synthesize-drafter")
    assert train, "jobs.train printed no summary"



@pytest.mark.integration
@pytest.mark.slow  # `make test-slow`; `make test` keeps the generate job's end-to-end and resume tests
def test_synthesis_resumes_exactly_once_after_an_injected_failure(stack_ray, monkeypatch):
    from jobs.synthesize import SynthesizeJobConfig, run
    from pipelines.synthesize import read_raw

    prefix = s3_prefix("synth-resume")
    cfg = load_config(SynthesizeJobConfig, str(REPO / "configs" / "synthesize" / "tiny.yaml"),
                      [f"output={prefix}/prompts", "magpie.num_prompts=12", "chunk_size=4", "sources=[]",
                       "magpie.sampling.max_new_tokens=8", "compute.batch_size=2", "tracking.enabled=false"])
    monkeypatch.setenv("DSPARK_FAIL_AFTER_CHUNKS", "1")
    with pytest.raises(RuntimeError, match="injected failure"):
        run(cfg)
    monkeypatch.delenv("DSPARK_FAIL_AFTER_CHUNKS")
    first = read_commits(cfg.output)
    assert len(first) == 1 and not storage.exists(f"{prefix}/prompts/manifest.json")
    result = run(cfg)
    assert result.stats.chunks_skipped == 1 and result.stats.chunks_done == 2
    assert [r["slot"] for r in read_raw(cfg.output)] == list(range(12))  # every slot exactly once
    assert result.manifest["counts"]["candidates"] == 12 and result.manifest["complete"]
    again = run(cfg)
    assert again.stats.chunks_done == 0 and again.manifest["digest"] == result.manifest["digest"]
