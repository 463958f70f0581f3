"""Linear layers fed a few rows at a time on CPU (decoding steps, verify passes, small batches).

torch's `F.linear(x, W)` on CPU computes x @ Wᵀ through an sgemm that, for a handful of rows, runs far
below memory bandwidth: on 2 cores SmolLM2-135M's 49152×576 LM head takes ~35-55 ms for 4 rows against
~12 ms for 1, so verifying γ drafts costs several single-token steps and speculation cannot win. The
same product computed as (W · xᵀ)ᵀ reads W once in its stored order: ~9-14 ms for 4 rows. Measured on
SmolLM2 (benchmarks/small_batch_linear.py): LM head 2.2-3.4x faster at 2-16 rows, the MLP projections
1.1-2x, the 576×576 projections within noise; smaller layers gain nothing and are left alone.
Only fp32 gains: with bf16 weights (avx512_bf16) F.linear is already fast for a few rows and the other
order is slower (LM head, 4 rows: 3.8 ms F.linear, 5.7 ms (W · xᵀ)ᵀ; measured 2026-12-02), so bf16 and
other dtypes keep F.linear.

Invariant: `small_batch_linear(x, W, b) == F.linear(x, W, b)` up to float summation order (it is the
same matrix product); only inference calls (no autograd graph) with rows in [2, max_rows] on CPU take
the other path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MAX_ROWS = 64  # above this the two agree within noise (measured up to 256 rows)
MIN_WEIGHT_NUMEL = 300_000  # smaller layers (192x576, the tiny test models) gain nothing: left as they are


def small_batch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                       max_rows: int = MAX_ROWS) -> torch.Tensor:
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    if not 2 <= rows <= max_rows or x.device.type != "cpu" or weight.dtype != torch.float32:
        return F.linear(x, weight, bias)  # one row (a decoding step): F.linear's gemv; bf16: F.linear is faster
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):  # training builds a graph
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    out = torch.mm(weight, flat.t()).t().contiguous()  # [rows, out]: W read once, row by row; the usual layout
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


class SmallBatchLinear(nn.Linear):
    """nn.Linear whose forward is small_batch_linear (a class swap: pickles and deep-copies as usual)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return small_batch_linear(x, self.weight, self.bias)


def use_small_batch_linear(model: nn.Module) -> int:
    """Route every plain nn.Linear of a CPU model with at least MIN_WEIGHT_NUMEL weights through
    small_batch_linear; returns how many. Calls that build a graph for training (grad enabled and a
    parameter or input requiring it) keep F.linear."""
    n = 0
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.device.type == "cpu" and module.weight.numel() >= MIN_WEIGHT_NUMEL:
            module.__class__ = SmallBatchLinear
            n += 1
    return n
