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
import pickle

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

from dspark.io.storage.rollout_store import check_rollouts

from jobs.train import prepare_run

from dspark.training.batching import collate
from tests.mlflow_store import new_sqlite_store



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



def test_lr_schedule_warmup_then_cosine():
    total, warm = 100, warmup_steps(100, 0.04)
    factors = [lr_factor(s, total, warm) for s in range(total)]
    assert warm == 4 and factors[:4] == [0.25, 0.5, 0.75, 1.0]
    after = factors[warm:]
    assert all(a >= b for a, b in zip(after, after[1:])), "cosine decay never increases"
    assert factors[-1] < 0.01 and all(0 < f <= 1 for f in factors)
    assert lr_factor(50, total, warm, "constant") == 1.0
    assert lr_factor(total, total, warm, min_ratio=0.1) == pytest.approx(0.1)


def test_schedule_resized_in_flight_continues_at_the_steps_taken():
    """A wall-clock budget re-plans its step count from the measured step time; the new cosine schedule
    picks up at the steps already taken, from the optimiser's original peak lr."""
    from dspark.training.config import OptimSection
    from dspark.training.step import TorchUpdate

    module = torch.nn.Linear(1, 1)
    backend = TorchUpdate(module, OptimSection(lr=1.0, warmup_ratio=0.04))
    backend.set_schedule(100)
    for _ in range(10):
        module.weight.grad = torch.ones_like(module.weight)
        backend.opt.step(), backend.sched.step()
    backend.set_schedule(200, done=10)
    assert backend.lr() == pytest.approx(lr_factor(10, 200, warmup_steps(200, 0.04)))



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

    monkeypatch.setenv("MLFLOW_TRACKING_URI", new_sqlite_store(tmp_path))
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



@pytest.fixture(scope="module")
def gloo_world_of_one():
    """One gloo process group for the module's session tests (DeepSpeed keeps the first group it sees, so
    a group destroyed and made again between tests would not be the one it uses)."""
    import torch.distributed as dist

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DS_ACCELERATOR", "cpu")
        for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_closed_port())}.items():
            mp.setenv(key, value)
        dist.init_process_group("gloo", rank=0, world_size=1)
        yield
        dist.destroy_process_group()



def pair_batches(vocab: int, rows: int, length: int, prompt: int, seed: int):
    """epoch -> micro batches of 2 raw rows (random ids, the first `prompt` tokens unsupervised), the same rows
    every epoch: what a session's `run` takes."""
    rng = np.random.default_rng(seed)
    data = [{"input_ids": rng.integers(0, vocab, length), "loss_mask": np.r_[[0] * prompt, [1] * (length - prompt)]}
            for _ in range(rows)]

    def batches(epoch):
        for i in range(0, len(data), 2):
            yield {k: [r[k] for r in data[i:i + 2]] for k in ("input_ids", "loss_mask")}
    return batches


def test_session_zero3_checkpoint_resumes_exactly_and_exports(tmp_path, gloo_world_of_one):
    """The worker's DeepSpeed session without Ray: ZeRO-3, a checkpoint at step 2 of 4, and a fresh
    session restored from it reproduces steps 3-4 exactly; the export loads with load_drafter. The
    drafter has a draft vocabulary (the driver's plan.draft_vocab; full-vocabulary training runs in the
    Ray Train tests below), so its d2t/t2d maps go through ZeRO-3 checkpoints and the export too."""
    from dspark.drafters import load_drafter
    from dspark.drafters.draft_vocab import DraftVocabPlan
    from dspark.training.plan import TrainPlan
    from dspark.training.session import TrainSession

    cfg = job_config("x", **{"deepspeed.zero_stage": 3, "scaling.num_workers": 1, "optim.max_steps": 4,
                             "optim.global_batch_size": 4, "drafter.draft_vocab_size": 24})
    draft_ids = list(range(0, 48, 2))
    plan = TrainPlan(total_steps=4, steps_per_epoch=3, grad_accum=2, precision="fp32",
                     ds_config=deepspeed_config(cfg), draft_vocab=DraftVocabPlan(tuple(draft_ids)))
    plan = pickle.loads(pickle.dumps(plan))  # as it crosses into a Ray Train worker
    session = TrainSession(cfg, plan, 0, 1, torch.device("cpu")).setup()
    batches = pair_batches(session.target.vocab_size, rows=12, length=30, prompt=6, seed=0)

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


def test_step_budget_resizes_at_its_replan_points_and_stops_at_its_seconds(monkeypatch):
    """StepBudget (the loop of train_for and the learning-curve recipe): a probed plan of 100 steps in a
    200 s budget, real steps of 4 s -> re-sized at step 5 to 50 (schedule too), then no step starts at 200 s."""
    from dspark.training import budget as budget_mod

    clock = [0.0]
    monkeypatch.setattr(budget_mod.time, "perf_counter", lambda: clock[0])

    class Trainer:
        schedules = []

        def set_schedule(self, total, done=0):
            self.schedules.append((total, done))

    trainer, budget = Trainer(), budget_mod.StepBudget(100, seconds=200.0)
    while budget.more():
        clock[0] += 4.0
        budget.stepped(trainer)
    assert trainer.schedules == [(50, 5)]  # 5 steps in 20 s: 45 more fit in the 180 s left; 25 % / 50 % agree
    assert budget.done == 50 and budget.stopped_by == "steps"
    plan = budget_mod.StepBudget(10, seconds=30.0)  # re-planned at step 2 (1 s each): 30 steps fit; next at 7
    for seconds in [1.0] * 6 + [40.0]:  # ... then one step runs long: the budget, not the plan, stops the run
        assert plan.more()
        clock[0] += seconds
        plan.stepped(trainer)
    assert plan.total == 30 and not plan.more() and plan.done == 7 and plan.stopped_by == "deadline"
    assert budget_mod.StepBudget(10).fractions == []  # without seconds: exactly the planned steps


def test_step_budget_replans_from_the_steps_since_its_last_point_not_a_warm_up_heavy_mean(monkeypatch):
    """A GPU's first steps are slow (warm-up): 4 steps of 3 s, then 0.25 s steps, in a 60 s budget probed at
    1.2 s/step (plan 50). Re-planned from each window's own step time and at fractions of the current plan,
    the run uses its budget instead of stopping at a plan sized from the warm-up-heavy mean."""
    from dspark.training import budget as budget_mod

    clock = [0.0]
    monkeypatch.setattr(budget_mod.time, "perf_counter", lambda: clock[0])

    class Trainer:
        def set_schedule(self, total, done=0):
            pass

    budget = budget_mod.StepBudget(50, seconds=60.0)
    while budget.more():
        clock[0] += 3.0 if budget.done < 4 else 0.25
        budget.stepped(Trainer())
    assert budget.stopped_by == "steps" and clock[0] >= 55.0  # within 5 s of the 60 s share
    assert budget.done > 180  # 48 s of 0.25 s steps after the 12 s warm-up


def test_run_steps_is_the_one_loop_seeds_each_step_and_logs_window_means():
    """run_steps (train_for's loop and the learning curve's): step k gets seed seed*1_000_003 + k, the plan's
    steps and no more, a point every log_every steps (and the first and last) with the metrics averaged since
    the previous point, final_metrics over the last 20 steps, the drafter left in eval mode."""
    from dspark.training import budget as budget_mod

    class Trainer:
        target = type("T", (), {"device": torch.device("cpu")})()
        drafter = torch.nn.Linear(1, 1)

        def set_schedule(self, total, done=0):
            pass

    seeds, points = [], []

    def step(batch, seed):
        seeds.append(seed)
        return {"loss": float(len(seeds)), "tokens": 10.0, "flops": 1.0}

    batches = ({"epoch": 0 if k < 3 else 1} for k in range(40))
    rep = budget_mod.run_steps(Trainer(), budget_mod.StepBudget(25), batches, step, seed=2, log_every=10,
                               on_log=points.append)
    assert seeds == [2 * 1_000_003 + k for k in range(25)] and rep.steps == 25 and rep.epochs == 2
    assert [p["step"] for p in points] == [1, 10, 20, 25] and [p["loss"] for p in points] == [1.0, 6.0, 15.5, 23.0]
    assert rep.tokens == 250.0 and rep.curve == points and rep.final_metrics["loss"] == pytest.approx(15.5)
    assert not Trainer.drafter.training and rep.stopped_by == "steps"


def test_session_reports_on_log_checkpoint_and_last_steps_and_reuses_target_outputs(gloo_world_of_one):
    """Metrics are read back and gathered only on the steps that report them (log_every_steps, checkpoint
    steps, the last), averaged over the steps since the last report; from the second epoch on the frozen
    target's outputs come from the session's memo (every batch of epoch 2 is a hit)."""
    from dspark.training.plan import TrainPlan
    from dspark.training.session import TrainSession

    cfg = job_config("x", **{"deepspeed.zero_stage": 2, "scaling.num_workers": 1, "optim.max_steps": 6,
                             "optim.micro_batch_size": 2, "optim.global_batch_size": 2,
                             "tracking.log_every_steps": 4, "checkpoint.every_steps": 3})
    plan = TrainPlan(total_steps=6, steps_per_epoch=3, grad_accum=1, precision="fp32", ds_config=deepspeed_config(cfg))
    session = TrainSession(cfg, plan, 0, 1, torch.device("cpu")).setup()
    batches = pair_batches(session.target.vocab_size, rows=6, length=20, prompt=4, seed=1)

    results = []
    session.run(batches, results.append)
    reported = {r.step: r.metrics for r in results if r.metrics is not None}
    assert [r.step for r in results] == [1, 2, 3, 4, 5, 6] and sorted(reported) == [3, 4, 6]
    assert reported[4]["tokens"] == 40 and reported[6]["tokens"] == 80  # one step since 3, two since 4
    assert all(math.isfinite(m["loss"]) and m["n_supervised"] > 0 for m in reported.values())
    memo = session._step.memo
    assert (memo.stats.misses, memo.stats.hits, memo.stats.rows_held) == (3, 3, 6)
