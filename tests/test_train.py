"""Distributed drafter training (jobs/train.py, jobs/train_worker.py, dspark/lr_schedule.py).

Fast unit tests cover the config -> DeepSpeed mapping, the schedule, batching and every fail-fast
check. One slow test trains in a single process through the same DeepSpeed session the Ray workers
use (ZeRO-3, checkpoint, exact resume, export). The integration tests run real Ray Train jobs on the
local stack (S3 + MLflow + Ray): 2 workers ZeRO-2 with a worker killed mid-run, then a relaunch of
the same run name. Run them under `flock /tmp/dspark-heavy.lock`.
"""
from __future__ import annotations

import json
import math
import os
import socket

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dspark.config import ConfigError
from dspark.training.lr_schedule import lr_factor, warmup_steps
from dspark.training.config import TrainJobConfig
from dspark.training.plan import check_resume_matches, deepspeed_config, training_steps
from pipelines.rollout_store import check_rollouts
from jobs.train import prepare_run
from dspark.training.batching import collate

WORDS = ("the a of to and in is it that for on with as was he she they we you are be this have from or one "
         "had by word but not what all were when your can said there use an each which do how their").split()


def job_config(rollouts: str, **over) -> TrainJobConfig:
    data = {"run_name": "t", "target": "tiny", "data": {"rollouts": rollouts, "max_seq_len": 128},
            "drafter": {"algo": "dspark", "block_size": 4, "num_layers": 1, "rank": 16, "anchors_per_seq": 8},
            "optim": {"lr": 3e-3, "micro_batch_size": 2, "global_batch_size": 8, "max_steps": 6, "warmup_ratio": 0.1},
            "scaling": {"num_workers": 2}, "tracking": {"enabled": False}}
    for key, value in over.items():
        node = data
        *path, last = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return TrainJobConfig.model_validate(data)


def write_rollouts(path, rows: int = 48, seed: int = 0, target=None, new_tokens: int = 40) -> str:
    """A rollouts Parquet (the training columns of pipelines/schema.py): chat prompts answered by the
    tiny target itself (sampled), so a drafter can learn the target's distribution."""
    from dspark.target import load_target

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


# ----------------------------------------------------------------------------- unit
def test_lr_schedule_warmup_then_cosine():
    total, warm = 100, warmup_steps(100, 0.04)
    factors = [lr_factor(s, total, warm) for s in range(total)]
    assert warm == 4 and factors[:4] == [0.25, 0.5, 0.75, 1.0]
    after = factors[warm:]
    assert all(a >= b for a, b in zip(after, after[1:])), "cosine decay never increases"
    assert factors[-1] < 0.01 and all(0 < f <= 1 for f in factors)
    assert lr_factor(50, total, warm, "constant") == 1.0
    assert lr_factor(total, total, warm, min_ratio=0.1) == pytest.approx(0.1)


def test_deepspeed_config_from_job_config():
    cfg = job_config("x", **{"deepspeed.zero_stage": 3, "optim.global_batch_size": 16, "optim.grad_clip": 0.5})
    ds = deepspeed_config(cfg)
    assert ds["zero_optimization"]["stage"] == 3 and ds["gradient_clipping"] == 0.5
    assert ds["train_batch_size"] == 16 == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * 2
    assert ds["bf16"]["enabled"] is False, "fp32 on CPU workers"
    gpu = job_config("x", **{"scaling.use_gpu": True, "deepspeed.extra": {"zero_optimization": {"overlap_comm": True}}})
    ds_gpu = deepspeed_config(gpu)
    assert ds_gpu["bf16"]["enabled"] is True and ds_gpu["zero_optimization"] == {**ds_gpu["zero_optimization"],
                                                                               "overlap_comm": True, "stage": 2}
    with pytest.raises(ValueError, match="global_batch_size=10 must be a multiple"):
        job_config("x", **{"optim.global_batch_size": 10})


def test_training_steps_from_rows():
    cfg = job_config("x")  # micro 2 x 2 workers x accum 2 = 8 rows per step
    assert cfg.grad_accum == 2
    assert training_steps(cfg, 42) == (6, 5)  # 21 rows per worker -> 10 micro batches -> 5 steps; max_steps 6
    assert training_steps(job_config("x", **{"optim.max_steps": None, "optim.epochs": 3}), 42) == (15, 5)
    with pytest.raises(ConfigError, match="fewer than one global batch"):
        training_steps(cfg, 7)


def test_collate_pads_truncates_and_masks():
    rows = {"input_ids": [np.array([5, 6, 7]), np.array([1, 2, 3, 4, 5, 6])],
            "loss_mask": [np.array([0, 1, 1]), np.array([0, 0, 1, 1, 1, 1])]}
    batch = collate(rows, max_len=5, pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0, 0], [1, 2, 3, 4, 5]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1, 0, 0], [0, 0, 1, 1, 1]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    with pytest.raises(ValueError, match="corrupt"):
        collate({"input_ids": [np.array([1, 2])], "loss_mask": [np.array([1])]}, 8, 0)


def test_bad_rollouts_fail_fast(tmp_path):
    good = pa.table({"split": ["train", "holdout"], "input_ids": pa.array([[1, 2], [3]], pa.list_(pa.int32())),
                     "loss_mask": pa.array([[0, 1], [1]], pa.list_(pa.int8()))})
    pq.write_table(good, tmp_path / "good.parquet")
    assert check_rollouts(str(tmp_path / "good.parquet"), "train")[1] == 1
    with pytest.raises(ConfigError, match="no rows with split == 'train'"):
        pq.write_table(good.filter(pa.compute.equal(good["split"], "holdout")), tmp_path / "holdout.parquet")
        check_rollouts(str(tmp_path / "holdout.parquet"), "train")
    with pytest.raises(ConfigError, match=r"lack column\(s\) \['loss_mask'\]"):
        pq.write_table(good.drop(["loss_mask"]), tmp_path / "nomask.parquet")
        check_rollouts(str(tmp_path / "nomask.parquet"), "train")
    with pytest.raises(ConfigError, match="expected a list of integers"):
        pq.write_table(good.set_column(1, "input_ids", pa.array(["a b", "c"])), tmp_path / "text.parquet")
        check_rollouts(str(tmp_path / "text.parquet"), "train")
    with pytest.raises(ConfigError, match="does not exist"):
        check_rollouts(str(tmp_path / "missing.parquet"), "train")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no rollouts found"):
        check_rollouts(str(tmp_path / "empty"), "train")


def test_missing_target_fails_in_the_driver(tmp_path):
    from jobs.train import check_target_spec

    check_target_spec("tiny")
    with pytest.raises(ConfigError, match="cannot load target"):
        check_target_spec(str(tmp_path / "no-such-model"))


def test_resume_must_match_target_and_architecture():
    cfg = job_config("x")
    record = {"target": "tiny", "drafter": json.loads(cfg.drafter.model_dump_json())}
    check_resume_matches(record, job_config("x", **{"drafter.loss_tv": 0.5}))  # training-only change is fine
    with pytest.raises(ConfigError, match="trained on target 'tiny', not 'smollm2-135m'"):
        check_resume_matches(record, job_config("x", target="smollm2-135m"))
    with pytest.raises(ConfigError, match=r"different architecture \(changed: \['num_layers'\]\)"):
        check_resume_matches(record, job_config("x", **{"drafter.num_layers": 2}))
    with pytest.raises(ConfigError, match="scaling.num_workers"):
        check_resume_matches({**record, "num_workers": 4, "zero_stage": 2}, cfg)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_mlflow_and_storage_fail_before_training(tmp_path, monkeypatch):
    from dspark.io.storage import StorageError
    from dspark.io.tracking import TrackingError

    rollouts = tmp_path / "r.parquet"
    pq.write_table(pa.table({"split": ["train"] * 8, "input_ids": pa.array([[1, 2, 3]] * 8, pa.list_(pa.int32())),
                             "loss_mask": pa.array([[0, 1, 1]] * 8, pa.list_(pa.int8()))}), rollouts)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{_closed_port()}")
    cfg = job_config(str(rollouts), **{"tracking.enabled": True, "checkpoint.storage_path": str(tmp_path / "ck")})
    with pytest.raises(TrackingError, match="unreachable"):
        prepare_run(cfg)
    assert not (tmp_path / "ck" / "t" / "dspark_run.json").exists(), "nothing is recorded before the checks pass"
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    with pytest.raises(StorageError):
        prepare_run(job_config(str(rollouts), **{"checkpoint.storage_path": "s3://dspark/checkpoints"}))


def test_resumed_logger_continues_after_the_last_logged_step(tmp_path, monkeypatch):
    """Crash after step 7 with the last checkpoint at step 4: the relaunched rank-0 logger skips the
    redone steps 5-7 and logs 8-10, so the history holds exactly one point per step."""
    import mlflow

    from dspark.io import tracking
    from jobs.train_worker import RankZeroLogger

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    cfg = job_config("x", **{"tracking.enabled": True, "tracking.experiment": "resume-log"})
    run_id = tracking.start_run("resume-log", "r")
    first = RankZeroLogger(cfg, run_id)
    for step in range(1, 8):
        first.log(step, {"loss": 10.0 - step})
    tracking.end_run("FAILED")
    resumed = RankZeroLogger(cfg, run_id)  # the restarted worker, restored from step 4
    resumed.log(4, {"resumed_from_step": 4.0}, force=True)
    for step in range(5, 11):
        resumed.log(step, {"loss": 10.0 - step})
    tracking.end_run()
    steps = [m.step for m in mlflow.MlflowClient().get_metric_history(run_id, "loss")]
    assert sorted(steps) == list(range(1, 11)), steps
    assert [m.step for m in mlflow.MlflowClient().get_metric_history(run_id, "resumed_from_step")] == [4]


def test_local_ray_is_never_auto_detected(monkeypatch):
    """Without an address a job starts its own Ray (address="local"): with address=None, ray.init
    attaches to the newest Ray on the machine ("Found multiple active Ray instances")."""
    import ray

    from dspark.config import RayConfig
    from pipelines.ray_cluster import init_ray

    calls = []
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    assert init_ray(RayConfig(num_cpus=1)) == "local"
    assert calls[0]["address"] == "local" and calls[0]["num_cpus"] == 1
    assert init_ray(RayConfig(address="127.0.0.1:6390")) == "127.0.0.1:6390"
    assert calls[1]["address"] == "127.0.0.1:6390"


# ----------------------------------------------------------------------------- single process
@pytest.fixture
def gloo_world_of_one(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_closed_port())}.items():
        monkeypatch.setenv(key, value)
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.slow
def test_session_zero3_checkpoint_resumes_exactly_and_exports(tmp_path, gloo_world_of_one):
    """The worker's DeepSpeed session without Ray: ZeRO-3, a checkpoint at step 2 of 4, and a fresh
    session restored from it reproduces steps 3-4 exactly; the export loads with load_drafter. The
    drafter has a draft vocabulary (the driver's plan["draft_ids"]; full-vocabulary training runs in the
    Ray Train tests below), so its d2t/t2d maps go through ZeRO-3 checkpoints and the export too."""
    from dspark.drafters import load_drafter
    from dspark.training.session import TrainSession

    cfg = job_config("x", **{"deepspeed.zero_stage": 3, "scaling.num_workers": 1, "optim.max_steps": 4,
                             "optim.global_batch_size": 4, "drafter.draft_vocab_size": 24})
    draft_ids = list(range(0, 48, 2))
    plan = {"total_steps": 4, "steps_per_epoch": 3, "grad_accum": 2, "precision": "fp32",
            "ds_config": deepspeed_config(cfg), "draft_ids": draft_ids}
    session = TrainSession(cfg, plan, 0, 1, torch.device("cpu")).setup()
    rng = np.random.default_rng(0)
    rows = [{"input_ids": rng.integers(0, session.target.vocab_size, 30), "loss_mask": np.r_[[0] * 6, [1] * 24]}
            for _ in range(12)]

    def batches(epoch):
        for i in range(0, len(rows), 2):
            yield {k: [r[k] for r in rows[i:i + 2]] for k in ("input_ids", "loss_mask")}

    losses, ckpt = [], str(tmp_path / "ckpt")

    def on_step(result):
        losses.append(result.metrics["loss"])
        if result.step == 2:
            session.save(ckpt)

    session.run(batches, on_step)
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    assert {"deepspeed", "drafter", "train_state.json"} <= set(os.listdir(ckpt))

    resumed = TrainSession(cfg, plan, 0, 1, torch.device("cpu")).setup()
    resumed.restore(ckpt)
    assert resumed.step == 2 and resumed.restarts == 1
    again = []
    resumed.run(batches, lambda r: again.append(r.metrics["loss"]))
    assert again == pytest.approx(losses[2:], rel=1e-5)

    drafter = load_drafter(os.path.join(ckpt, "drafter"), target=session.target)
    assert all(p.numel() > 0 for p in drafter.parameters()), "ZeRO-3 export holds gathered (full) weights"
    assert drafter.draft_ids.tolist() == draft_ids and drafter.markov_head.markov_w2.weight.shape == (24, 16)


# ----------------------------------------------------------------------------- Ray Train on the stack
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


def run_train_job(cfg: TrainJobConfig, local_stack, tmp_path) -> dict:
    """`python -m jobs.train --config ...` against the stack's Ray (a fresh driver process, as a user
    runs it); returns the summary JSON of its last stdout line."""
    import subprocess
    import sys

    from dspark.config import dump_config

    path = tmp_path / "train.yaml"
    path.write_text(dump_config(cfg))
    env = {**os.environ, "RAY_AUTH_MODE": "token", "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false",
           "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "1"}  # (default 10 s) a sample within this short run
    cmd = [sys.executable, "-m", "jobs.train", "--config", str(path),
           "--set", f"ray.address={local_stack.ray_gcs_address}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=540,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, f"jobs.train failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1])


def mlflow_runs(experiment: str, run_name: str):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])  # not a URI cached by an earlier test
    exp = client.get_experiment_by_name(experiment)
    return [] if exp is None else client.search_runs([exp.experiment_id], f"tags.mlflow.runName = '{run_name}'")


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


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(600)
def test_relaunch_resumes_run_and_drafter_decodes_losslessly(local_stack, tiny_rollouts, tmp_path_factory):
    """Launching the same run name again continues from its last checkpoint in the same MLflow run;
    the registered drafter loads with load_drafter and greedy speculative decoding equals the target's."""
    import mlflow

    from dspark.io.drafter_source import load_drafter_ref
    from dspark.sampling import SamplingParams
    from dspark.specdec import speculative_generate, target_generate
    from dspark.target import load_target

    tmp_path = tmp_path_factory.mktemp("relaunch")
    first = mlflow_runs("test-train", "test-train-zero2")
    if not first:
        pytest.skip("needs the run of test_ray_train_zero2_survives_a_killed_worker")
    summary = run_train_job(stack_job(tiny_rollouts, tmp_path, **{"optim.max_steps": 20, "fault": None}),
                            local_stack, tmp_path)

    assert summary["mlflow_run_id"] == first[0].info.run_id
    assert len(mlflow_runs("test-train", "test-train-zero2")) == 1
    assert summary["metrics"]["step"] == 20
    state = json.loads(open_checkpoint_state(summary["checkpoint"]))
    assert state["restored_from"] == 16
    client = mlflow.MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])
    latest = client.get_model_version_by_alias("test-tiny-dspark", "trained")
    assert int(latest.version) == int(summary["registered_model"]["version"]) >= 2
    champion = client.get_model_version_by_alias("test-tiny-dspark", "champion")  # the serving alias moved too
    assert champion.version == latest.version and champion.source.startswith("models:/m-")  # an MLflow model
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


def open_checkpoint_state(checkpoint_uri: str) -> str:
    from dspark.io import storage

    return storage.read_text(storage.join(checkpoint_uri, "train_state.json"))
