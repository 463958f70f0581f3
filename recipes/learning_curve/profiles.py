"""Where the learning curve's settings live: the profiles (cpu, gpu, tiny), the data files, the log line."""
from __future__ import annotations

import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_DRAFTER = {"block_size": 7, "num_layers": 2, "num_context_layers": 3, "rank": 64, "anchors_per_seq": 512,
            "position_weight": "reference", "loss_norm": "token", "draft_vocab_size": 8192}
PROFILES = {
    # cpu: 2 shared cores, smollm2-135m. gpu: the same pipeline with bigger sizes (one accelerator).
    # anchors_per_seq 512 >= every eligible position of a 384-token row: dense anchors.
    # On the shared 2-core machine (load average 20-40 during this run) the sizes are fractions of
    # whatever the rollout phase committed: 4 points, each 3x the previous (27x span).
    # dtype: the target's, "auto" = bfloat16 where the profile's device computes it natively, else float32
    # (`target_dtype`, resolved where the target is loaded; measurements before 2026-12-05 ran the cpu profile's
    # reference target in float32: --dtype float32 reproduces them).
    "cpu": {"target": "smollm2-135m", "device": "cpu", "device_label": "2 CPU cores (shared)", "dtype": "auto",
            "threads": 1, "passes": 8, "chunk_prompts": 24, "max_new_tokens": 128, "max_batch": 24,
            "point_tokens": [], "point_fractions": [1 / 27, 1 / 9, 1 / 3, 1.0],
            "drafter": {**_DRAFTER, "anchors_per_seq": 32}, "epochs": 1, "batch_size": 8,
            "lr": 1e-3, "max_len": 384, "eval_max_len": 384, "eval_rows": 100, "anchor_stride": 4, "seed": 0,
            "log_every": 5,
            "cache_rows_per_shard": 32, "cache_batch": 4, "decode_prompts": 1, "decode_max_new_tokens": 40},
    "gpu": {"target": "smollm2-135m", "device": "cuda", "device_label": "1 GPU", "dtype": "auto", "threads": 8,
            "passes": 64, "chunk_prompts": 2048, "max_new_tokens": 512, "max_batch": 512,
            "point_tokens": [100_000, 400_000, 1_600_000, 6_400_000, 25_600_000],
            "drafter": {**_DRAFTER, "num_layers": 5, "anchors_per_seq": 1024}, "epochs": 4, "batch_size": 32,
            "lr": 6e-4, "max_len": 1024, "eval_max_len": 1024, "seed": 0, "log_every": 50,
            "cache_rows_per_shard": 1024, "cache_batch": 32, "decode_prompts": 20, "decode_max_new_tokens": 256},
    # tiny: the built-in tiny target, seconds per phase (tests/integration/test_learning_curve.py)
    "tiny": {"target": "tiny", "device": "cpu", "device_label": "cpu (test)", "dtype": "auto", "threads": 1,
             "passes": 2, "chunk_prompts": 4, "max_new_tokens": 12, "max_batch": 8,
             "point_tokens": [20, 60], "drafter": {**_DRAFTER, "block_size": 3, "num_layers": 1, "rank": 8,
                                                   "num_context_layers": 2, "draft_vocab_size": 64},
             "epochs": 1, "batch_size": 2, "lr": 1e-3, "max_len": 320, "eval_max_len": 320, "seed": 0,
             "log_every": 1, "cache_rows_per_shard": 3, "cache_batch": 2, "decode_prompts": 1,
             "decode_max_new_tokens": 8, "cost_reps": 3, "cost_threads": 1},
}
TRAIN_FILES = ["data/train/math.jsonl", "data/train/code.jsonl", "data/train/chat.jsonl"]
EVAL_DIR = "data/eval"


def target_dtype(prof: dict, setting: str | None = None) -> str:
    """The profile's target dtype (or `setting`, e.g. its data_dtype) resolved on the profile's device by the one
    resolver, dspark.models.precision.resolve_dtype: "auto" is bfloat16 where bf16 is native, else float32."""
    from dspark.models.precision import resolve_dtype

    return resolve_dtype(setting or prof["dtype"], prof["device"])


def log(msg: str) -> None:
    print(f"[learning_curve {time.strftime('%H:%M:%S')}] {msg}", flush=True)
