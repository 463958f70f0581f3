"""The engine's SPS table (verify steps per second by verify batch size, dspark.decoding.scheduler):
the configured one, or one profiled at start with ragged verify forwards shaped like real verify steps."""
from __future__ import annotations

import logging
import math
import time
from typing import Callable

import torch

from dspark.decoding.batched_cache import KVSlots, ragged_forward
from dspark.decoding.engine_config import EngineConfig
from dspark.decoding.scheduler import SPSTable, profile_sps

log = logging.getLogger("dspark.decoding.engine")  # part of the engine's start-up


def engine_sps_table(cfg: EngineConfig, target, gamma: int, layer_ids: list[int] | None) -> SPSTable:
    """cfg.sps_table when given, else one profiled on `target` over cfg.sps_batch_sizes."""
    if cfg.sps_table:
        table = SPSTable(dict(cfg.sps_table))
        log.info("SPS table (given): %s", format_table(table))
        return table
    t0 = time.perf_counter()
    forward = verify_forward(target, gamma, cfg.sps_context, layer_ids)
    table = profile_sps(forward, cfg.sps_batch_sizes, repeats=cfg.sps_repeats, sync=device_sync(target.device))
    log.info("SPS table profiled in %.1f s (B: verify steps/s): %s", time.perf_counter() - t0, format_table(table))
    return table


def verify_forward(target, gamma: int, context: int, layer_ids: list[int] | None) -> Callable[[int], None]:
    """B -> one ragged verify forward of B tokens split evenly over ceil(B/(γ+1)) rows, each row
    with `context` cached positions (the shape of a real verify step)."""
    device = target.device
    scratch = KVSlots(device, target.dtype)
    gen = torch.Generator(device=device).manual_seed(0)

    def forward(batch: int) -> None:
        rows = max(1, math.ceil(batch / (gamma + 1)))
        counts = [batch // rows + (1 if r < batch % rows else 0) for r in range(rows)]
        while scratch.used < rows:
            scratch.set_length(scratch.allocate(), context)
        ids = torch.randint(0, target.vocab_size, (1, batch), generator=gen, device=device)
        ragged_forward(target, scratch, 0, ids, counts, "all", layer_ids)

    return forward


def device_sync(device: torch.device) -> Callable[[], None] | None:
    """CUDA runs asynchronously: SPS timings must wait for the kernels (None on cpu)."""
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None


def format_table(table: SPSTable) -> str:
    return ", ".join(f"{b}: {v:.1f}" for b, v in table.points.items())
