"""The training job's typed config (`python -m jobs.train --config configs/train/<target>-<algo>.yaml`):
data, optimiser, DeepSpeed, scaling, checkpoints and tracking sections around the drafter's own config."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from dspark.config import RayConfig, StrictModel, TrackingConfig
from dspark.drafters import DrafterConfig

# drafter fields that may change between a run and its resume
TRAINING_ONLY_FIELDS = {"loss_ce", "loss_tv", "loss_conf", "anchors_per_seq", "position_weight", "init_std",
                        "ttt_steps", "position_decay", "ce_target", "loss_norm", "dense_ttt"}


# ----------------------------------------------------------------------------- config
class DataSection(StrictModel):
    rollouts: str  # Parquet file or directory (local or s3://) written by jobs.generate
    split: str = "train"  # rows with this `split` value are trained on
    max_seq_len: int = Field(1024, ge=8)  # sequences are cut to this many tokens (prompt + response)
    shuffle_buffer: int = Field(0, ge=0)  # rows in each worker's local shuffle buffer (0 = file order)
    bucket_window: int = Field(8, ge=0, description="length bucketing (dspark/training/batching.py): each worker sorts "
                               "this many micro batches' rows by length and re-cuts them into batches of the "
                               "same size, in a shuffled order, so padding stays a few percent (0/1 = off)")


class OptimSection(StrictModel):
    lr: float = Field(6e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup_ratio: float = Field(0.04, ge=0, lt=1)
    schedule: Literal["cosine", "constant"] = "cosine"
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    grad_clip: float = Field(1.0, ge=0)  # 0 = no clipping
    micro_batch_size: int = Field(4, ge=1)  # sequences per worker per forward/backward
    global_batch_size: int = Field(16, ge=1)  # sequences per optimizer step over all workers
    epochs: int = Field(1, ge=1)
    max_steps: int | None = Field(None, ge=1)  # optimizer steps; overrides epochs (data repeats as needed)
    seed: int = 0


class DeepSpeedSection(StrictModel):
    zero_stage: Literal[0, 1, 2, 3] = 2
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 on GPU workers, fp32 on CPU
    extra: dict = {}  # deep-merged into the generated DeepSpeed JSON (advanced; e.g. bucket sizes)


class ScalingSection(StrictModel):
    num_workers: int = Field(2, ge=1)
    use_gpu: bool = False
    cpus_per_worker: float = Field(1.0, gt=0)
    gpus_per_worker: float = Field(1.0, ge=0)  # used when use_gpu
    resources_per_worker: dict[str, float] = {}  # extra custom Ray resources per worker
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"


class CheckpointSection(StrictModel):
    storage_path: str = "s3://dspark/checkpoints"  # local dir or s3://bucket/prefix; run dir = <this>/<run_name>
    every_steps: int = Field(50, ge=1)  # a checkpoint every N optimizer steps, and always at the end
    num_to_keep: int = Field(2, ge=1)
    max_failures: int = Field(1, ge=-1)  # worker-group restarts allowed (-1 = unlimited)


class TrainTracking(TrackingConfig):
    experiment: str = "dspark-train"
    registered_model: str | None = None  # model registry name; None -> "drafter-<run_name>"
    # alias moved to each newly registered version. MLflow reserves "latest"; `models:/<name>@latest`
    # still works in dspark (dspark.io.drafter_source resolves it to the newest version).
    alias: str = "trained"
    log_every_steps: int = Field(1, ge=1)


class FaultSection(StrictModel):
    """Test hook: worker `rank` calls os._exit(1) when it reaches optimizer step `at_step`, once —
    the marker file is created first, and the fault does not fire again while it exists."""

    rank: int = 1
    at_step: int = Field(ge=1)
    marker: str


class TrainJobConfig(StrictModel):
    run_name: str
    target: str = "tiny"  # load_target spec
    drafter: DrafterConfig = DrafterConfig()
    data: DataSection
    optim: OptimSection = OptimSection()
    deepspeed: DeepSpeedSection = DeepSpeedSection()
    scaling: ScalingSection = ScalingSection()
    checkpoint: CheckpointSection = CheckpointSection()
    tracking: TrainTracking = TrainTracking()
    ray: RayConfig = RayConfig()
    fault: FaultSection | None = None

    @model_validator(mode="after")
    def _batch_divides(self) -> "TrainJobConfig":
        per_step = self.optim.micro_batch_size * self.scaling.num_workers
        if self.optim.global_batch_size % per_step:
            raise ValueError(f"optim.global_batch_size={self.optim.global_batch_size} must be a multiple of "
                             f"optim.micro_batch_size x scaling.num_workers = {per_step}")
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
