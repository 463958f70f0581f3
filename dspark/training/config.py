"""The training job's typed config (`python -m jobs.train --config configs/train/<target>-<algo>.yaml`):
data, optimiser, DeepSpeed, scaling, checkpoints and tracking sections around the drafter's own config."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from dspark.config import ModelAlias, ModelRef, RayConfig, StrictModel, TrackingConfig
from dspark.drafters import DrafterConfig


# ----------------------------------------------------------------------------- config
class DataSection(StrictModel):
    rollouts: ModelRef = Field(description="Parquet file or directory (local or s3://) written by jobs.generate")
    split: str = Field("train", description="rows with this `split` value are trained on")
    max_seq_len: int = Field(1024, ge=8, description="sequences are cut to this many tokens (prompt + response)")
    shuffle_buffer: int = Field(0, ge=0, description="rows in each worker's local shuffle buffer (0 = file order)")
    bucket_window: int = Field(8, ge=0, description="length bucketing (dspark/training/batching.py): each worker sorts "
                               "this many micro batches' rows by length and re-cuts them into batches of the "
                               "same size, in a shuffled order, so padding stays a few percent (0/1 = off)")
    replay_in_memory_mb: int = Field(
        512, ge=0, description="when the training rows take at most this many MB (rows x max_seq_len x 16 bytes, "
        "an upper bound) and the run has more than one epoch, each worker reads its shard once, keeps it in memory "
        "and trains every epoch on a seeded reshuffle of it, instead of re-reading the rollouts (Ray Data re-runs "
        "the read and split every epoch: seconds each, most of a small run). A worker then keeps the same rows "
        "every epoch. 0 = always re-read")


class OptimSection(StrictModel):
    lr: float = Field(6e-4, gt=0, description="peak learning rate (AdamW)")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas")
    eps: float = Field(1e-8, description="AdamW epsilon")
    warmup_ratio: float = Field(0.04, ge=0, lt=1, description="share of the steps spent warming the learning rate up linearly")
    schedule: Literal["cosine", "constant"] = Field("cosine", description="after warmup: cosine decay to min_lr_ratio x lr, or constant")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="final learning rate of the cosine schedule, as a share of lr")
    grad_clip: float = Field(1.0, ge=0, description="0 = no clipping")
    micro_batch_size: int = Field(4, ge=1, description="sequences per worker per forward/backward")
    global_batch_size: int = Field(16, ge=1, description="sequences per optimizer step over all workers")
    epochs: int = Field(1, ge=1, description="passes over the training rows (unless max_steps is set)")
    max_steps: int | None = Field(None, ge=1, description="optimizer steps; overrides epochs (data repeats as needed)")
    seed: int = Field(0, description="drafter init and anchor sampling seed (same on every rank and rerun)")


class DeepSpeedSection(StrictModel):
    zero_stage: Literal[0, 1, 2, 3] = Field(2, description="DeepSpeed ZeRO stage (0 = plain data parallel)")
    precision: Literal["auto", "fp32", "bf16"] = Field("auto", description="the drafter's training precision; auto: bf16 on GPU workers with native bf16, fp32 elsewhere (CPU)")
    extra: dict = Field(default_factory=dict, description="deep-merged into the generated DeepSpeed JSON (advanced; e.g. bucket sizes)")


class ScalingSection(StrictModel):
    num_workers: int = Field(2, ge=1, description="Ray Train workers (data-parallel ranks)")
    use_gpu: bool = Field(False, description="one GPU per worker (NCCL); false: CPU workers (gloo)")
    cpus_per_worker: float = Field(1.0, gt=0, description="CPUs reserved per worker; leave some free for Ray Data reading the rollouts")
    torch_threads: int | None = Field(None, ge=1, description="torch intra-op threads per worker; null: Ray's default "
                                      "(OMP_NUM_THREADS = the worker's whole CPUs, at least 1). Measure layouts with "
                                      "benchmarks/train_throughput.py --workers/--torch-threads: on 2 cores two one-thread "
                                      "workers ran 105 tok/s, one two-thread worker 96")
    gpus_per_worker: float = Field(1.0, ge=0, description="used when use_gpu")
    target_shards: int = Field(1, ge=1, description="split the frozen target's decoder layers across this many "
                               "workers of a node (FSDP2, gathered layer by layer: dspark/models/sharded_target.py), so "
                               "each holds ~1/N of them; for targets that do not fit one device beside the drafter. "
                               "Must divide num_workers and be at most the workers per node; the target memo is off. "
                               "1 = a whole copy per worker")
    resources_per_worker: dict[str, float] = Field(default_factory=dict, description="extra custom Ray resources per worker")
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field("PACK", description="Ray placement of the worker group")


class CheckpointSection(StrictModel):
    storage_path: str = Field("s3://dspark/checkpoints", description="local dir or s3://bucket/prefix; run dir = <this>/<run_name>")
    every_steps: int = Field(50, ge=1, description="a checkpoint every N optimizer steps, and always at the end")
    num_to_keep: int = Field(2, ge=1, description="checkpoints kept (older ones are deleted)")
    max_failures: int = Field(1, ge=-1, description="worker-group restarts allowed (-1 = unlimited)")


class TrainTracking(TrackingConfig):
    experiment: str = Field("dspark-train", description="MLflow experiment")
    registered_model: str | None = Field(None, description='model registry name; None -> "drafter-<run_name>"')
    # Training never changes what is served: it moves its own alias only. The serving alias `champion`
    # (serve/eval/calibrate configs read it) moves through jobs.promote, or here only when a user sets
    # promote_to. MLflow reserves "latest" and v<N>; both are refused when the config loads.
    alias: ModelAlias = Field("trained", description="alias moved to each newly registered version (never the serving "
                              "alias unless promote_to names it)")
    promote_to: ModelAlias | None = Field(None, description="also point this alias (e.g. champion) at the new version: an "
                                          "explicit promotion without evaluation, recorded on the version as tag "
                                          "dspark.promoted.<alias>; None (default): serving stays on its version "
                                          "until jobs.promote moves it")
    log_every_steps: int = Field(1, ge=1, description="log step metrics every N optimizer steps")


class FaultSection(StrictModel):
    """Test hook: worker `rank` calls os._exit(1) when it reaches optimizer step `at_step`, once —
    the marker file is created first, and the fault does not fire again while it exists."""

    rank: int = Field(1, description="worker rank that exits")
    at_step: int = Field(ge=1, description="optimizer step at which it exits")
    marker: str = Field(description="file created before exiting; the fault does not fire again while it exists")


class TrainJobConfig(StrictModel):
    run_name: str = Field(description="the run's name: its checkpoints live in <checkpoint.storage_path>/<run_name>; relaunching it resumes")
    target: str = Field("tiny", description="load_target spec")
    drafter: DrafterConfig = Field(default_factory=DrafterConfig, description="the drafter's architecture and losses")
    init_from: ModelRef | None = Field(None, description="start from this drafter's weights (models:/<name>@<alias>, models:/<name>/<version>, runs:/, s3:// or a dir): its architecture, draft vocabulary and draft temperature are kept (not its calibration: calibrate again), drafter fields set here must agree (the flywheel's retraining)")
    data: DataSection = Field(description="the rollouts trained on")
    optim: OptimSection = Field(default_factory=OptimSection, description="optimiser, schedule and batch geometry")
    deepspeed: DeepSpeedSection = Field(default_factory=DeepSpeedSection, description="ZeRO stage and precision")
    target_forward_dtype: Literal["auto", "same", "bfloat16"] = Field(
        "auto", description="dtype of the frozen target's forward that makes the drafter's inputs: same = the "
        "training precision's; bfloat16 = a bf16 copy of the target (its features and final states are cast "
        "back; the target distribution comes from the training-precision LM head) — on a CPU with avx512_bf16 "
        "or AMX ~8x the fp32 feature tok/s, distributions within TV 0.02; auto = bfloat16 where the worker's "
        "device computes it natively, else same")
    target_memo_gb: float = Field(
        2.0, ge=0, description="keep each worker's frozen-target outputs (features, final states) of the rows it has "
        "trained on, up to this many GiB on its device, and reuse them in later epochs instead of running the target "
        "again (dspark/training/target_memo.py); used only when the run has more than one epoch; 0 = off")
    scaling: ScalingSection = Field(default_factory=ScalingSection, description="the Ray Train worker group")
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection, description="where and how often checkpoints are written")
    tracking: TrainTracking = Field(default_factory=TrainTracking, description="MLflow run and model registration")
    ray: RayConfig = Field(default_factory=RayConfig, description="Ray cluster to use")
    fault: FaultSection | None = Field(None, description="test hook: kill one worker once (fault-injection tests)")

    @model_validator(mode="after")
    def _batch_divides(self) -> "TrainJobConfig":
        per_step = self.optim.micro_batch_size * self.scaling.num_workers
        if self.optim.global_batch_size % per_step:
            raise ValueError(f"optim.global_batch_size={self.optim.global_batch_size} must be a multiple of "
                             f"optim.micro_batch_size x scaling.num_workers = {per_step}")
        if self.scaling.num_workers % self.scaling.target_shards:
            raise ValueError(f"scaling.target_shards={self.scaling.target_shards} must divide "
                             f"scaling.num_workers={self.scaling.num_workers}")
        if "/" in self.run_name or not self.run_name.strip():
            raise ValueError(f"run_name {self.run_name!r} must be a non-empty name without '/'")
        return self

    @property
    def grad_accum(self) -> int:
        return self.optim.global_batch_size // (self.optim.micro_batch_size * self.scaling.num_workers)

    @property
    def mlflow_run_name(self) -> str:
        return self.tracking.run_name or self.run_name

    @property
    def registered_model_name(self) -> str:
        return self.tracking.registered_model or f"drafter-{self.run_name}"

    def resolved_precision(self) -> str:
        if self.deepspeed.precision != "auto":
            return self.deepspeed.precision
        return "bf16" if self.scaling.use_gpu else "fp32"
