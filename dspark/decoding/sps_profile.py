"""The engine's SPS table (verify steps per second by verify batch size, dspark.decoding.scheduler):
the configured one, or one profiled at start with verify steps shaped like real ones, on the engine's own KV
slots (the step it will run: the decoding core, compiled or eager, or the ragged store)."""
from __future__ import annotations

import logging
import math
import time
from typing import Callable

import torch

from dspark.decoding.engine_config import EngineConfig
from dspark.decoding.scheduler import SPSTable, profile_sps

log = logging.getLogger("dspark.decoding.engine")  # part of the engine's start-up


def engine_sps_table(cfg: EngineConfig, slots, target, gamma: int, layer_ids: list[int] | None) -> SPSTable:
    """cfg.sps_table when given, else one profiled on `target` over cfg.sps_batch_sizes, on the engine's empty
    KV `slots` (left empty again)."""
    if cfg.sps_table:
        table = SPSTable(dict(cfg.sps_table))
        log.info("SPS table (given): %s", format_sps(table))
        return table
    t0 = time.perf_counter()
    forward = verify_forward(slots, target, gamma, cfg.sps_context, layer_ids)
    try:
        table = profile_sps(forward, cfg.sps_batch_sizes, repeats=cfg.sps_repeats, sync=device_sync(target.device))
    finally:
        while slots.used:
            slots.release(slots.used - 1)
    log.info("SPS table profiled in %.1f s (B: verify steps/s): %s", time.perf_counter() - t0, format_sps(table))
    return table


def verify_forward(slots, target, gamma: int, context: int, layer_ids: list[int] | None) -> Callable[[int], None]:
    """B -> one verify step of B tokens split evenly over ceil(B/(γ+1)) rows (at most the slots' rows),
    each row with `context` cached positions (the shape of a real verify step)."""
    device = target.device
    gen = torch.Generator(device=device).manual_seed(0)
    core = getattr(slots, "core", None)  # the decoding core holds a fixed number of slots; the ragged store grows
    max_rows = core.slots if core is not None else None

    def forward(batch: int) -> None:
        rows = max(1, math.ceil(batch / (gamma + 1)))
        rows = min(rows, max_rows) if max_rows else rows  # sizes past the engine's rows: longer rows
        counts = [batch // rows + (1 if r < batch % rows else 0) for r in range(rows)]
        while slots.used < rows:
            slots.set_length(slots.allocate(), context)
        ids = torch.randint(0, target.vocab_size, (batch,), generator=gen, device=device)
        slots.forward(0, list(ids.split(counts)), "all", layer_ids)

    return forward


def device_sync(device: torch.device) -> Callable[[], None] | None:
    """CUDA runs asynchronously: SPS timings must wait for the kernels (None on cpu)."""
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None


def format_sps(table: SPSTable) -> str:
    return ", ".join(f"{b}: {v:.1f}" for b, v in table.points.items())
