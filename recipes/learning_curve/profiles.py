"""Where the learning curve's settings live: CurveProfile (their typed model) and the profiles (cpu, gpu, tiny),
the data files, the log line."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from dspark.config import StrictModel, validate_config

REPO = Path(__file__).resolve().parents[2]


class CurveProfile(StrictModel):
    """One machine's settings for every phase of the learning curve (unknown keys are errors)."""

    # the target and the machine
    target: str = Field(description="the target model: a dspark.models name (smollm2-135m) or a built-in one (tiny)")
    device: str = Field(description="the torch device every phase loads the target on (cpu, cuda); the report's "
                                    "device_kind, which `dspark plan` matches")
    device_label: str = Field(description="the machine in words, for the report and sweep JSONs and the plot title")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        description="the target's weights dtype (--dtype); auto: resolved on `device` by target_dtype (bfloat16 "
                    "where native, else float32)")
    data_dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = Field(
        None, description="the target's dtype for the training data only (train rollouts, training feature cache; "
                          "--data-dtype); None: `dtype`")
    threads: int = Field(ge=1, description="torch threads of the target and training (--threads)")
    # rollouts
    passes: int = Field(description="rollouts: samples per train prompt, one seeded pass each (--passes overrides)")
    chunk_prompts: int = Field(ge=1, description="rollouts: prompts per committed chunk (--chunk-prompts)")
    max_new_tokens: int = Field(description="rollouts: the most tokens generated per answer")
    max_batch: int = Field(ge=1, description="rollouts: the generation engine's batch (--chunk-prompts sets it too)")
    rollout_tokens_per_s_note: str | None = Field(
        None, description="a note on the rollout throughput, copied into the report's `rollout_log`")
    # the curve's points
    point_tokens: list[int] = Field(description="point sizes in rollout tokens (used when point_fractions is empty)")
    point_fractions: list[float] = Field(
        [], description="point sizes as fractions of the committed rollout tokens; non-empty: used instead of "
                        "point_tokens")
    # the drafter and its training
    drafter: dict[str, Any] = Field(
        description="the DSpark drafter's dspark.drafters.DrafterConfig fields (block_size, num_layers, "
                    "anchors_per_seq, ...), a plain dict: training.drafter_config merges each algorithm's settings "
                    "into it; --layers/--anchors replace num_layers/anchors_per_seq")
    epochs: int = Field(ge=1, description="passes over its rows per trained drafter (--point-epochs; the epochs "
                                          "phase sets it per run)")
    batch_size: int = Field(description="training rows per step (at most the point's rows)")
    lr: float = Field(gt=0, description="the peak learning rate of the cosine schedule (--lr)")
    precision: Literal["fp32", "bf16"] = Field(
        "fp32", description="the drafter's training precision (--precision; bf16 = autocast, folders get -bf16)")
    refresh_vocab: bool = Field(
        False, description="epochs --init-from: recount the draft vocabulary on this run's rows and move the "
                           "continued drafter to it (--refresh-vocab; folder -vocab)")
    max_len: int = Field(description="tokens per training row kept in the training feature cache")
    seed: int = Field(description="seeds the drafter's initialisation, the batch shuffles and the training steps")
    log_every: int = Field(ge=1, description="training: a log line (and a loss-curve row) every this many steps")
    cache_rows_per_shard: int = Field(description="frozen-target feature cache: rows per shard")
    cache_batch: int = Field(description="frozen-target feature cache: rows per target forward")
    # expected τ (held-out)
    eval_max_len: int = Field(description="tokens per held-out row kept in the evaluation feature cache")
    eval_rows: int | None = Field(None, description="held-out rows the expected τ is measured on (a "
                                                    "domain-balanced prefix); None: every row")
    anchor_stride: int = Field(1, ge=1, description="expected τ: every this-many-th anchor of a held-out row (1: "
                                                    "every anchor, which the renewal estimate needs)")
    # real decoding and the draft-trees cost
    decode_prompts: int = Field(description="decode: the first this many prompts of each data/eval benchmark")
    decode_max_new_tokens: int = Field(description="decode: the most tokens generated per prompt")
    cost_reps: int = Field(30, ge=1, description="draft-trees: timed repetitions of each round-cost measurement")
    cost_threads: int = Field(2, ge=1, description="draft-trees: torch threads while the round costs are measured")

    def with_overrides(self, changes: dict[str, Any]) -> CurveProfile:
        """A copy with `changes` (command-line values) validated like the profile's own (model_copy(update=...)
        checks nothing): a bad one stops with a ConfigError naming the key."""
        return validate_config(CurveProfile, {**self.model_dump(), **changes}, "learning-curve profile (command line)")


_DRAFTER = {"block_size": 7, "num_layers": 2, "num_context_layers": 3, "rank": 64, "anchors_per_seq": 512,
            "position_weight": "reference", "loss_norm": "token", "draft_vocab_size": 8192}
PROFILES: dict[str, CurveProfile] = {
    # cpu: 2 shared cores, smollm2-135m. gpu: the same pipeline with bigger sizes (one accelerator).
    # anchors_per_seq 512 >= every eligible position of a 384-token row: dense anchors.
    # On the shared 2-core machine (load average 20-40 during this run) the sizes are fractions of
    # whatever the rollout phase committed: 4 points, each 3x the previous (27x span).
    # dtype: the target's, "auto" = bfloat16 where the profile's device computes it natively, else float32
    # (`target_dtype`, resolved where the target is loaded; measurements before 2026-12-05 ran the cpu profile's
    # reference target in float32: --dtype float32 reproduces them).
    "cpu": CurveProfile(target="smollm2-135m", device="cpu", device_label="2 CPU cores (shared)", dtype="auto",
                        threads=1, passes=8, chunk_prompts=24, max_new_tokens=128, max_batch=24,
                        point_tokens=[], point_fractions=[1 / 27, 1 / 9, 1 / 3, 1.0],
                        drafter={**_DRAFTER, "anchors_per_seq": 32}, epochs=1, batch_size=8,
                        lr=1e-3, max_len=384, eval_max_len=384, eval_rows=100, anchor_stride=4, seed=0,
                        log_every=5,
                        cache_rows_per_shard=32, cache_batch=4, decode_prompts=1, decode_max_new_tokens=40),
    "gpu": CurveProfile(target="smollm2-135m", device="cuda", device_label="1 GPU", dtype="auto", threads=8,
                        passes=64, chunk_prompts=2048, max_new_tokens=512, max_batch=512,
                        point_tokens=[100_000, 400_000, 1_600_000, 6_400_000, 25_600_000],
                        drafter={**_DRAFTER, "num_layers": 5, "anchors_per_seq": 1024}, epochs=4, batch_size=32,
                        lr=6e-4, max_len=1024, eval_max_len=1024, seed=0, log_every=50,
                        cache_rows_per_shard=1024, cache_batch=32, decode_prompts=20, decode_max_new_tokens=256),
    # tiny: the built-in tiny target, seconds per phase (tests/integration/test_learning_curve.py)
    "tiny": CurveProfile(target="tiny", device="cpu", device_label="cpu (test)", dtype="auto", threads=1,
                         passes=2, chunk_prompts=4, max_new_tokens=12, max_batch=8,
                         point_tokens=[20, 60], drafter={**_DRAFTER, "block_size": 3, "num_layers": 1, "rank": 8,
                                                         "num_context_layers": 2, "draft_vocab_size": 64},
                         epochs=1, batch_size=2, lr=1e-3, max_len=320, eval_max_len=320, seed=0,
                         log_every=1, cache_rows_per_shard=3, cache_batch=2, decode_prompts=1,
                         decode_max_new_tokens=8, cost_reps=3, cost_threads=1),
}
TRAIN_FILES = ["data/train/math.jsonl", "data/train/code.jsonl", "data/train/chat.jsonl"]
EVAL_DIR = "data/eval"


def target_dtype(prof: CurveProfile, setting: str | None = None) -> str:
    """The profile's target dtype (or `setting`, e.g. its data_dtype) resolved on the profile's device by the one
    resolver, dspark.models.precision.resolve_dtype: "auto" is bfloat16 where bf16 is native, else float32."""
    from dspark.models.precision import resolve_dtype

    return resolve_dtype(setting or prof.dtype, prof.device)


def log(msg: str) -> None:
    print(f"[learning_curve {time.strftime('%H:%M:%S')}] {msg}", flush=True)
