"""What a training run will do, decided before it starts: the DeepSpeed JSON, the step count and the
checks that a relaunch resumes the same run (same drafter architecture, ranks and ZeRO stage)."""
from __future__ import annotations

from dataclasses import dataclass, field

from dspark.config import ConfigError, config_to_dict, deep_merge
from dspark.drafters.draft_vocab import DraftVocabPlan
from dspark.drafters.config import TRAINING_ONLY_FIELDS
from dspark.training.config import TrainJobConfig


# ----------------------------------------------------------------------------- plan
@dataclass(frozen=True)
class TrainPlan:
    """What the driver (jobs.train.prepare_run) decided for a run, handed to every Ray Train worker
    (pickled inside train_loop_config) and read there as attributes. Change it with dataclasses.replace."""

    total_steps: int  # optimizer steps of the whole run (training_steps)
    steps_per_epoch: int
    grad_accum: int  # micro batches per optimizer step on each worker
    precision: str  # "bf16" or "fp32" (TrainJobConfig.resolved_precision)
    ds_config: dict  # the DeepSpeed JSON (deepspeed_config)
    draft_vocab: DraftVocabPlan = field(default_factory=DraftVocabPlan)  # default: the full vocabulary
    train_rows: int = 0
    mlflow_run_id: str | None = None  # the driver's run, which rank 0 logs into
    launch: int = 1  # 1 + the number of earlier launches of this run_name
    files: tuple[str, ...] = ()  # the rollout Parquet files read
    init_from: str | None = None  # a registered drafter to start from (jobs.train resolves and pins it)
    init_dir: str | None = None  # init_from copied onto this worker (jobs.train_worker fills it in)

    @property
    def zero_stage(self) -> int:
        return self.ds_config["zero_optimization"]["stage"]


def deepspeed_config(cfg: TrainJobConfig) -> dict:
    """The DeepSpeed JSON for this run: batch geometry, clipping, ZeRO stage, precision.
    Invariant: train_batch_size = micro x grad_accum x world = optim.global_batch_size."""
    stage = cfg.deepspeed.zero_stage
    zero: dict = {"stage": stage}
    if stage >= 2:
        zero.update(contiguous_gradients=True, overlap_comm=False,
                    reduce_bucket_size=int(5e7), allgather_bucket_size=int(5e7))
    if stage == 3:
        zero.update(stage3_gather_16bit_weights_on_model_save=False, stage3_param_persistence_threshold=0)
    ds = {
        "train_batch_size": cfg.optim.global_batch_size,
        "train_micro_batch_size_per_gpu": cfg.optim.micro_batch_size,
        "gradient_accumulation_steps": cfg.grad_accum,
        "gradient_clipping": cfg.optim.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": cfg.resolved_precision() == "bf16"},
        "fp16": {"enabled": False},
        "zero_allow_untested_optimizer": True,  # plain torch AdamW: no JIT-compiled FusedAdam on CPU
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    return deep_merge(ds, cfg.deepspeed.extra)


def training_steps(cfg: TrainJobConfig, num_rows: int) -> tuple[int, int]:
    """(total optimizer steps, steps per epoch). Each worker gets num_rows // world rows (equal split)
    and uses whole micro batches and whole accumulation groups only."""
    world = cfg.scaling.num_workers
    micro_per_epoch = (num_rows // world) // cfg.optim.micro_batch_size
    steps_per_epoch = micro_per_epoch // cfg.grad_accum
    if steps_per_epoch < 1:
        raise ConfigError(f"rollouts {cfg.data.rollouts!r} have {num_rows} '{cfg.data.split}' rows, fewer than one "
                          f"global batch ({cfg.optim.global_batch_size}); lower optim.global_batch_size or add data")
    total = cfg.optim.max_steps or cfg.optim.epochs * steps_per_epoch
    return total, steps_per_epoch


def check_resume_matches(record: dict, cfg: TrainJobConfig) -> None:
    """A relaunch must train the same drafter on the same target as the run it resumes."""
    if record.get("target") != cfg.target:
        raise ConfigError(f"run {cfg.run_name!r} was trained on target {record.get('target')!r}, not {cfg.target!r}; "
                          f"use the original target or a new run_name")
    old = {k: v for k, v in record.get("drafter", {}).items() if k not in TRAINING_ONLY_FIELDS}
    new = {k: v for k, v in config_to_dict(cfg.drafter).items() if k not in TRAINING_ONLY_FIELDS}
    changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    if changed:
        raise ConfigError(f"run {cfg.run_name!r} has a drafter checkpoint with a different architecture "
                          f"(changed: {changed}); restore those settings or use a new run_name")
    # DeepSpeed's optimizer shards are per data-parallel rank and stage: both must stay the same.
    layout = {"scaling.num_workers": (record.get("num_workers"), cfg.scaling.num_workers),
              "deepspeed.zero_stage": (record.get("zero_stage"), cfg.deepspeed.zero_stage)}
    moved = {k: old_new for k, old_new in layout.items() if old_new[0] is not None and old_new[0] != old_new[1]}
    if moved:
        raise ConfigError(f"run {cfg.run_name!r} was checkpointed with " + ", ".join(
            f"{k}={o}" for k, (o, _) in moved.items()) + "; resuming needs the same values (or use a new run_name)")


def init_from_checkpoint(cfg: TrainJobConfig, saved: dict, pinned: str) -> TrainJobConfig:
    """`cfg` retraining the drafter saved with config `saved` (from `pinned`): its architecture is the
    checkpoint's (its draft vocabulary included: jobs.train keeps the checkpoint's ids); drafter fields set
    explicitly in the config must agree with it, except a larger `num_layers` for a layer-stack drafter (the
    checkpoint is deepened: dspark.drafters.deepen); training-only fields (losses, anchors, ...) stay the config's."""
    from dspark.drafters import DrafterConfig
    from dspark.drafters.deepen import DEEPENABLE

    mine = config_to_dict(cfg.drafter)
    deeper = ("num_layers" in cfg.drafter.model_fields_set and saved.get("algo") in DEEPENABLE
              and mine["num_layers"] > saved.get("num_layers", mine["num_layers"]))
    config_wins = TRAINING_ONLY_FIELDS | ({"num_layers"} if deeper else set())  # fields taken from cfg, not saved
    clash = sorted(k for k in cfg.drafter.model_fields_set - config_wins
                   if saved.get(k) is not None and mine.get(k) is not None and saved[k] != mine[k])
    if clash:
        raise ConfigError(f"init_from {pinned}: drafter fields {clash} differ from the checkpoint's "
                          f"({ {k: saved[k] for k in clash} }); drop them from the config or match them")
    merged = {**saved, **{k: v for k, v in mine.items() if k in config_wins}}
    return cfg.model_copy(update={"drafter": DrafterConfig.model_validate(merged)})
