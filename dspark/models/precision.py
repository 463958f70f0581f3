"""Precision chosen by the hardware: whether a device computes bf16 natively, and the one resolver that turns a
dtype setting ("auto" | "float32" | "bfloat16" | "float16") into the weights dtype on the device that loads them.

bf16 is native on CUDA GPUs with bf16 and on CPUs with avx512_bf16 or AMX (on a 2-core avx512_bf16 CPU,
smollm2-135m target-only decoding ran 1.7-2.3x the fp32 tok/s, benchmarks/results/decode_speed/); on AVX2-only
CPUs it is emulated and far slower than float32 (~6x for batched decoding). So "auto" is bfloat16 where native,
else float32, and every shipped config says "auto" (tests/unit/test_shipped_precision.py). Resolve where the
device is known: on the worker, actor or replica, not on the driver.
"""
from __future__ import annotations

from typing import Literal

import torch

DTYPES = ("float32", "bfloat16", "float16")
DtypeSetting = Literal["auto", "float32", "bfloat16", "float16"]
AUTO_DESCRIPTION = ("auto: bfloat16 where the device computes it natively (a CUDA GPU with bf16, a CPU with "
                    "avx512_bf16 or AMX), else float32 (dspark.models.precision)")


def device_type(device: str | torch.device) -> str:
    """"cuda:1" / torch.device("cuda", 1) -> "cuda"."""
    return torch.device(device).type


def bf16_is_native(device: str | torch.device) -> bool:
    """Whether `device` computes bf16 in hardware (a CUDA GPU with bf16; a CPU with avx512_bf16 or AMX).
    Elsewhere bf16 is emulated and slower than float32."""
    kind = device_type(device)
    if kind == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)  # False where CUDA is unavailable
    if kind == "cpu":
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    return False


def resolve_dtype(setting: str | None, device: str | torch.device) -> str:
    """A dtype setting -> the weights dtype name on `device`: "auto" (or None) is bfloat16 where the device
    computes bf16 natively, else float32; an explicit dtype is kept as it is."""
    if setting is None or setting == "auto":
        return "bfloat16" if bf16_is_native(device) else "float32"
    if setting not in DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {', '.join(DTYPES)}; got {setting!r}")
    return setting


def torch_dtype(setting: str | None, device: str | torch.device) -> torch.dtype:
    """`resolve_dtype` as a torch.dtype (what load_target takes)."""
    return getattr(torch, resolve_dtype(setting, device))
