"""Distributed drafter training (jobs/train.py, jobs/train_worker.py, dspark/lr_schedule.py).

Fast unit tests cover the config -> DeepSpeed mapping, the schedule, batching and every fail-fast
check. One slow test trains in a single process through the same DeepSpeed session the Ray workers
use (ZeRO-3, checkpoint, exact resume, export). The integration tests run real Ray Train jobs on the
local stack (S3 + MLflow + Ray): 2 workers ZeRO-2 with a worker killed mid-run, then a relaunch of
the same run name. Run them under `flock /tmp/dspark-heavy.lock`.
"""

from __future__ import annotations

import json


import os


import numpy as np

import pyarrow as pa

import pyarrow.parquet as pq

import pytest




from dspark.training.config import TrainJobConfig




from tests.unit.training.test_train import job_config  # noqa: F401 (shared helpers and fixtures)
from tests.paths import REPO



WORDS = ("the a of to and in is it that for on with as was he she they we you are be this have from or one "
         "had by word but not what all were when your can said there use an each which do how their").split()



def write_rollouts(path, rows: int = 48, seed: int = 0, target=None, new_tokens: int = 40) -> str:
    """A rollouts Parquet (the training columns of dspark/data/schema.py): chat prompts answered by the
    tiny target itself (sampled), so a drafter can learn the target's distribution."""
    from dspark.models.target import load_target

    target = target or load_target("tiny")
    rng = np.random.default_rng(seed)
    prompts = [target.chat_ids([{"role": "user", "content": " ".join(rng.choice(WORDS, 8))}]) for _ in range(rows)]
    answers = []
    for start in range(0, rows, 16):
        answers += target.generate(prompts[start:start + 16], max_new_tokens=new_tokens, temperature=0.7,
                                   seed=seed * 1000 + start)
    table = pa.table({
        "prompt_id": [f"p{i:05d}" for i in range(rows)],
        "split": ["holdout" if i % 8 == 7 else "train" for i in range(rows)],
        "input_ids": pa.array([p + a for p, a in zip(prompts, answers)], pa.list_(pa.int32())),
        "loss_mask": pa.array([[0] * len(p) + [1] * len(a) for p, a in zip(prompts, answers)], pa.list_(pa.int8())),
    })
    pq.write_table(table, str(path))
    return str(path)



@pytest.fixture(scope="module")
def tiny_rollouts(local_stack, tmp_path_factory):
    """160 target-generated rollouts uploaded to the stack's bucket (as jobs.generate would write them)."""
    from dspark.io import storage

    local = write_rollouts(tmp_path_factory.mktemp("rollouts") / "part-00000.parquet", rows=160, seed=1)
    uri = "s3://dspark/tests/train-rollouts/part-00000.parquet"
    storage.write_bytes(uri, open(local, "rb").read())
    return uri



def stack_job(rollouts: str, tmp_path, **over) -> TrainJobConfig:
    base = {"run_name": "test-train-zero2", "checkpoint.storage_path": "s3://dspark/tests/checkpoints",
            "checkpoint.every_steps": 4, "checkpoint.max_failures": 2, "optim.max_steps": 16,
            "optim.micro_batch_size": 4, "optim.global_batch_size": 16, "deepspeed.zero_stage": 2,
            "scaling.cpus_per_worker": 0.5, "tracking.enabled": True, "tracking.experiment": "test-train",
            "tracking.registered_model": "test-tiny-dspark", "fault": {"rank": 1, "at_step": 7,
                                                                        "marker": str(tmp_path / "fault-marker")}}
    return job_config(rollouts, **{**base, **over})



def start_train_job(cfg: TrainJobConfig, local_stack, tmp_path, **env_vars: str):
    """`python -m jobs.train --config ...` against the stack's Ray, started (a fresh driver process, as a user
    runs it): the Popen, its stdout and stderr piped as text. `env_vars` go into its environment."""
    import subprocess
    import sys

    from dspark.config import dump_config

    path = tmp_path / "train.yaml"
    path.write_text(dump_config(cfg))
    env = {**os.environ, "RAY_AUTH_MODE": "token", "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false",
           **env_vars}
    return subprocess.Popen([sys.executable, "-m", "jobs.train", "--config", str(path),
                             "--set", f"ray.address={local_stack.ray_gcs_address}"],
                            env=env, cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_train_job(job, timeout_s: float) -> tuple[dict, str, str]:
    """Wait for a started job (killed past `timeout_s`); (the summary JSON of its last stdout line, stdout,
    stderr), asserting it succeeded."""
    import subprocess

    try:
        out, err = job.communicate(timeout=timeout_s)
    finally:
        if job.poll() is None:
            job.kill()
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert job.returncode == 0 and lines, f"jobs.train failed ({job.returncode}):\n{err[-5000:]}"
    return json.loads(lines[-1]), out, err


def run_train_job(cfg: TrainJobConfig, local_stack, tmp_path) -> dict:
    """`python -m jobs.train --config ...` against the stack's Ray, to its end; its summary JSON."""
    job = start_train_job(cfg, local_stack, tmp_path,  # (default 10 s) a system-metrics sample within this short run
                          MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL="1")
    return finish_train_job(job, 540)[0]



def mlflow_runs(experiment: str, run_name: str):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])  # not a URI cached by an earlier test
    exp = client.get_experiment_by_name(experiment)
    return [] if exp is None else client.search_runs([exp.experiment_id], f"tags.mlflow.runName = '{run_name}'")



def open_checkpoint_state(checkpoint_uri: str) -> str:
    from dspark.io import storage

    return storage.read_text(storage.join(checkpoint_uri, "train_state.json"))



@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(600)
def test_ray_train_zero2_survives_a_killed_worker(local_stack, tiny_rollouts, tmp_path_factory):
    """2 workers, ZeRO-2, rank 1 killed after step 7: the run resumes from the step-4 checkpoint,
    finishes, lowers the loss, checkpoints to S3, logs one MLflow run and registers the drafter."""
    from mlflow import MlflowClient

    from dspark.io import storage

    tmp_path = tmp_path_factory.mktemp("fault")
    summary = run_train_job(stack_job(tiny_rollouts, tmp_path), local_stack, tmp_path)

    assert (tmp_path / "fault-marker").exists(), "the fault fired"
    assert summary["metrics"]["step"] == 16
    state = json.loads(storage.read_text(storage.join(summary["checkpoint"], "train_state.json")))
    assert state["restored_from"] == 4 and state["restarts"] == 1, "resumed from the last checkpoint once"
    files = storage.list_files("s3://dspark/tests/checkpoints/test-train-zero2/")
    assert any(f.endswith("drafter/model.safetensors") for f in files)
    assert any("deepspeed/zero_pp_rank_1_mp_rank_00_optim_states.pt" in f for f in files), "rank 1's ZeRO shard"

    runs = mlflow_runs("test-train", "test-train-zero2")
    assert len(runs) == 1 and runs[0].info.run_id == summary["mlflow_run_id"], "one MLflow run despite the restart"
    client = MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])
    run_id = summary["mlflow_run_id"]
    for key in ("loss", "loss_ce", "loss_tv", "loss_conf", "acc_pos_1", "expected_accept_len", "lr", "grad_norm",
                "tokens_per_s"):
        assert client.get_metric_history(run_id, key), f"metric {key} logged"
    history = client.get_metric_history(run_id, "loss")
    assert sorted(m.step for m in history) == list(range(1, 17)), "one point per step: redone steps not re-logged"
    loss = {m.step: m.value for m in history}
    assert np.mean([loss[s] for s in (14, 15, 16)]) < 0.9 * np.mean([loss[s] for s in (1, 2, 3)]), loss
    tv = {m.step: m.value for m in client.get_metric_history(run_id, "loss_tv")}
    assert np.mean([tv[s] for s in (14, 15, 16)]) < np.mean([tv[s] for s in (1, 2, 3)]), tv
    resumed = client.get_metric_history(run_id, "resumed_from_step")
    assert [m.value for m in resumed] == [4.0]
    params = runs[0].data.params
    assert params["world_size"] == "2" and params["deepspeed.zero_stage"] == "2" and "version.deepspeed" in params
    logged = client.get_run(run_id)
    assert any(k.startswith("system/cpu_utilization") for k in logged.data.metrics), "rank 0 samples system metrics"
    inputs = {d.dataset.name: {t.key: t.value for t in d.tags} for d in logged.inputs.dataset_inputs}
    assert inputs["rollouts"]["mlflow.data.context"] == "training", inputs
    assert logged.data.tags["mlflow.source.git.commit"] == params["git_sha"]

    version = client.get_model_version_by_alias("test-tiny-dspark", "trained")
    assert version.run_id == run_id and version.version == summary["registered_model"]["version"]
    assert version.tags["dspark.export.vllm"] == f"runs:/{run_id}/exports/vllm", "the vLLM export is attached"
    assert "champion" not in client.get_registered_model("test-tiny-dspark").aliases, "training never serves itself"



@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(600)
def test_relaunch_resumes_run_and_drafter_decodes_losslessly(local_stack, tiny_rollouts, tmp_path_factory):
    """Launching the same run name again continues from its last checkpoint in the same MLflow run;
    the registered drafter loads with load_drafter and greedy speculative decoding equals the target's."""
    import mlflow

    from dspark.io.drafter_source import load_drafter_ref
    from dspark.decoding.sampling import SamplingParams
    from dspark.decoding.specdec import speculative_generate, target_generate
    from dspark.models.target import load_target

    tmp_path = tmp_path_factory.mktemp("relaunch")
    first = mlflow_runs("test-train", "test-train-zero2")
    if not first:
        pytest.skip("needs the run of test_ray_train_zero2_survives_a_killed_worker")
    summary = run_train_job(stack_job(tiny_rollouts, tmp_path, **{"optim.max_steps": 20, "fault": None,
                                                                   "tracking.promote_to": "champion"}),
                            local_stack, tmp_path)  # promote_to: the explicit promotion a user types

    assert summary["mlflow_run_id"] == first[0].info.run_id
    assert len(mlflow_runs("test-train", "test-train-zero2")) == 1
    assert summary["metrics"]["step"] == 20
    state = json.loads(open_checkpoint_state(summary["checkpoint"]))
    assert state["restored_from"] == 16
    client = mlflow.MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])
    latest = client.get_model_version_by_alias("test-tiny-dspark", "trained")
    assert int(latest.version) == int(summary["registered_model"]["version"]) >= 2
    champion = client.get_model_version_by_alias("test-tiny-dspark", "champion")  # moved: promote_to asked for it
    assert champion.version == latest.version and champion.source.startswith("models:/m-")  # an MLflow model
    assert "tracking.promote_to" in champion.tags["dspark.promoted.champion"]
    assert summary["registered_model"]["promoted_to"] == "champion"
    assert champion.tags["dspark.algo"] == "dspark" and champion.tags["dspark.target"] == "tiny"
    logged = client.get_logged_model(champion.source.removeprefix("models:/"))
    assert "loss" in {m.key for m in logged.metrics}  # the training metrics are linked to the model

    target = load_target("tiny")
    drafter = load_drafter_ref("models:/test-tiny-dspark@champion", target=target)  # the newest version
    assert drafter.target_meta["name"] == "tiny"
    sp = SamplingParams(temperature=0.0)
    for words in (["the", "word", "is"], ["we", "can", "use", "this"]):
        prompt = target.chat_ids([{"role": "user", "content": " ".join(words)}])
        spec = speculative_generate(target, drafter, prompt, sp, max_new_tokens=24)
        plain = target_generate(target, prompt, sp, max_new_tokens=24)
        assert spec.token_ids == plain.token_ids


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(900)
def test_sharded_target_trains_like_a_whole_copy_through_ray_train(local_stack, tiny_rollouts, tmp_path_factory):
    """2 Ray Train workers that each hold half of the target's decoder layers (scaling.target_shards=2, FSDP2
    over gloo) take the same steps as 2 workers that each hold a whole copy: the same final loss."""
    summaries = {}
    for shards in (1, 2):
        tmp_path = tmp_path_factory.mktemp(f"shards{shards}")
        over = {"run_name": f"test-train-shards{shards}", "optim.max_steps": 4, "fault": None,
                "tracking.enabled": False, "scaling.target_shards": shards}
        summaries[shards] = run_train_job(stack_job(tiny_rollouts, tmp_path, **over), local_stack, tmp_path)
    assert summaries[2]["metrics"]["step"] == 4
    assert summaries[2]["metrics"]["loss"] == pytest.approx(summaries[1]["metrics"]["loss"], rel=1e-4)
