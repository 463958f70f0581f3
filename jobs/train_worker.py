"""The Ray Train glue of `jobs.train`: `train_loop_per_worker` builds a `dspark.training.session.
TrainSession` on each worker, feeds it this worker's shard of the rollouts (length-bucketed), logs
rank 0's step metrics into the driver's MLflow run, and reports checkpoints to Ray Train (which
uploads and merges every rank's part). A test hook (`fault`) kills one worker once at a given step.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from dspark.training.batching import regroup_by_length, reshuffled_epoch
from dspark.training.plan import TrainPlan
from dspark.training.session import StepResult, TrainSession, micro_seed


# ----------------------------------------------------------------------------- Ray glue
class RankZeroLogger:
    """Logs into the driver's MLflow run from rank 0 (also after a restart: same run id, no new run),
    with system metrics (CPU, memory, GPU, ...) sampled on this node. The driver owns and ends the run;
    `close` flushes the queued metrics (bounded wait) before the worker returns.

    After a restart, training redoes the steps between the restored checkpoint and the crash. Those
    steps were already logged, and the redo recomputes them from the same checkpoint state with the
    same data order and seeds (`micro_seed`), so the logged points stand for them: steps up to the
    last one in the run's `loss` history are not logged again (one point per step, no duplicates),
    and logging continues live from there. `force` (restart markers) always logs."""

    HISTORY_KEY = "loss"  # in every step's metrics

    def __init__(self, cfg, run_id: str | None):
        self.every = cfg.tracking.log_every_steps
        self.run_id = run_id
        self.logged_until = 0
        if run_id:
            from dspark.io import tracking

            tracking.attach_run(run_id, system_metrics=True)
            self.logged_until = tracking.last_logged_step(run_id, self.HISTORY_KEY) or 0

    def close(self) -> None:
        if self.run_id:
            from dspark.io import tracking

            tracking.end_run()  # attached: flush and stop the system metrics; the run stays RUNNING

    def log(self, step: int, metrics: dict[str, float], force: bool = False) -> None:
        if not force and step <= self.logged_until:
            return  # a step redone after a restart, logged before the crash
        if self.run_id and (force or step % self.every == 0):
            from dspark.io import tracking

            tracking.log_metrics(metrics, step=step)


def say(message: str) -> None:
    """One line to the worker's stderr (streamed to the driver). Not print(): Ray Train patches it to log
    through the root logger and also tee to a wrapped stderr, so every line reached the driver twice."""
    sys.stderr.write(message + "\n")
    sys.stderr.flush()


def print_progress(result: StepResult, total: int, every: int) -> None:
    if result.step % every and result.step != total:
        return
    m = result.metrics
    say(f"[train] step {result.step}/{total} loss {m.get('loss', float('nan')):.4f} "
        f"accept_len {m.get('expected_accept_len', float('nan')):.3f} lr {m.get('lr', 0.0):.2e} "
        f"{m.get('tokens_per_s', 0.0):.0f} tok/s")


def maybe_inject_fault(cfg, rank: int, step: int) -> None:
    """Test hook (config `fault`): kill this worker process once, at the configured step."""
    fault = cfg.fault
    if fault is None or fault.rank != rank or fault.at_step != step or os.path.exists(fault.marker):
        return
    import ray.train
    from ray.train import CheckpointConsistencyMode

    # Let Ray Train register the reports already made (it polls the workers): a crash that follows a
    # checkpoint by more than a poll interval, as in a real run, resumes from that checkpoint.
    ray.train.get_all_reported_checkpoints(consistency_mode=CheckpointConsistencyMode.COMMITTED, timeout_s=120)
    Path(fault.marker).parent.mkdir(parents=True, exist_ok=True)
    Path(fault.marker).write_text(f"rank {rank} killed at step {step}\n")
    say(f"[train] fault injection: rank {rank} exits at step {step}")
    os._exit(1)


def train_loop_per_worker(loop_config: dict) -> None:
    """Ray Train entry point. loop_config = {"job": TrainJobConfig dict, "plan": the driver's TrainPlan, "env": {...}}."""
    os.environ.update(loop_config.get("env", {}))
    if not loop_config["job"].get("scaling", {}).get("use_gpu", False):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import ray.train
    import ray.train.torch

    from dspark.training.config import TrainJobConfig

    cfg = TrainJobConfig.model_validate(loop_config["job"])
    if cfg.scaling.torch_threads:
        import torch

        torch.set_num_threads(cfg.scaling.torch_threads)
    plan: TrainPlan = loop_config["plan"]
    if plan.init_from:  # the driver pinned it; each worker reads it from its local cache
        from dspark.io.drafter_source import local_dir

        plan = replace(plan, init_dir=local_dir(plan.init_from))
    from dspark.io import storage

    ctx = ray.train.get_context()
    if ctx.get_local_world_size() % cfg.scaling.target_shards:  # a shard group never spans nodes
        raise ValueError(f"scaling.target_shards={cfg.scaling.target_shards} must divide the "
                         f"{ctx.get_local_world_size()} workers on this node")
    session = TrainSession(cfg, plan, ctx.get_world_rank(), ctx.get_world_size(), ray.train.torch.get_device(),
                           local_copy=storage.local_copy)
    session.setup()
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as ckpt_dir:
            session.restore(ckpt_dir)
        say(f"[train] rank {session.rank}: resumed from step {session.step}")
    logger = RankZeroLogger(cfg, plan.mlflow_run_id) if session.rank == 0 else None
    if logger and session.restored_from is not None:
        logger.log(session.step, {"resumed_from_step": float(session.step),
                                  "restarts": float(session.restarts)}, force=True)
    shard = ray.train.get_dataset_shard("train")

    replay, kept = replays_in_memory(cfg, plan), []  # kept: this worker's shard, read once when replaying

    def epoch_batches(epoch: int):
        seed = micro_seed(cfg.optim.seed, session.rank, epoch, 0)
        if replay:  # every epoch, the first included, is a reshuffle of the kept rows
            if not kept:
                kept.extend(shard.iter_batches(batch_size=cfg.optim.micro_batch_size, batch_format="numpy",
                                               drop_last=True))
            batches = reshuffled_epoch(kept, seed + 1)
        else:
            buffer = cfg.data.shuffle_buffer or None
            batches = shard.iter_batches(batch_size=cfg.optim.micro_batch_size, batch_format="numpy",
                                         drop_last=True, local_shuffle_buffer_size=buffer,
                                         local_shuffle_seed=(cfg.optim.seed + epoch) if buffer else None)
        # same rows, same batch count and size, grouped by length: deterministic per (seed, rank, epoch)
        return regroup_by_length(batches, cfg.data.bucket_window, seed)

    def on_step(result: StepResult) -> None:
        if logger and result.metrics is not None:  # a step that reports (TrainSession.reports)
            logger.log(result.step, result.metrics)
            print_progress(result, plan.total_steps, cfg.tracking.log_every_steps)
        final = result.step >= plan.total_steps
        if result.step % cfg.checkpoint.every_steps == 0 or final:  # always a reporting step
            report_checkpoint(session, {"step": result.step, **result.metrics})
        maybe_inject_fault(cfg, session.rank, result.step)

    try:
        session.run(epoch_batches, on_step)
    finally:
        if logger:
            logger.close()


def replays_in_memory(cfg, plan: TrainPlan) -> bool:
    """Every rank decides alike, from the driver's row count: keep the first epoch and replay it?"""
    upper_bound_mb = plan.train_rows * cfg.data.max_seq_len * 16 / 2**20
    return plan.total_steps > plan.steps_per_epoch and upper_bound_mb <= cfg.data.replay_in_memory_mb


def report_checkpoint(session: TrainSession, metrics: dict) -> None:
    """Every rank saves its part into a local temp dir; Ray Train uploads and merges them."""
    import ray.train

    tmp = tempfile.mkdtemp(prefix="dspark-ckpt-")
    try:
        session.save(tmp)
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
