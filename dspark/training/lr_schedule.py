"""Learning-rate schedule: linear warmup, then cosine (or constant) decay, as a multiplier of the peak lr.

`lr_factor(step, ...)` is the factor applied to the optimizer step with index `step` (0-based):
  warmup  (step < W):  (step + 1) / W                      -> reaches 1.0 at the last warmup step
  cosine  (step >= W): min + (1 - min) * ½(1 + cos(π·p)),   p = (step - W) / max(1, total - W)
Invariants: 0 < factor <= 1; the factor never increases after warmup; it ends near `min_ratio`.
"""
from __future__ import annotations

import math
from typing import Literal

import torch

Schedule = Literal["cosine", "constant"]


def warmup_steps(total_steps: int, warmup_ratio: float) -> int:
    """Warmup length: `warmup_ratio` of the run, at least one step when the ratio is positive."""
    if warmup_ratio <= 0:
        return 0
    return max(1, round(total_steps * warmup_ratio))


def lr_factor(step: int, total_steps: int, warmup: int, schedule: Schedule = "cosine",
              min_ratio: float = 0.0) -> float:
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, warmup_ratio: float,
                    schedule: Schedule = "cosine", min_ratio: float = 0.0) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR stepping once per optimizer step (its state_dict round-trips through checkpoints)."""
    warmup = warmup_steps(total_steps, warmup_ratio)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps, warmup, schedule, min_ratio))
