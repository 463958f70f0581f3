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

Which order is faster depends on the CPU and its BLAS: on a 2-core Xeon with AMX (2026-12-08) the other
order was 3-5x *slower* at 2-4 rows (LM head 8.9 ms against F.linear's 3.1 ms; the MLP 0.18 against
0.035 ms), so a verify of 2 tokens cost two decoding steps and the dynamic scheduler stopped drafting at
batch 1. So each weight shape is routed only where the other order measured faster on this machine
(`small_batch_wins`: both orders timed side by side on the layer's own weight, once per shape and process).

Invariant: `small_batch_linear(x, W, b) == F.linear(x, W, b)` up to float summation order (it is the
same matrix product); only inference calls (no autograd graph) with rows in [2, max_rows] on CPU take
the other path.
"""
from __future__ import annotations

import logging
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

MAX_ROWS = 64  # above this the two agree within noise (measured up to 256 rows)
MIN_WEIGHT_NUMEL = 300_000  # smaller layers (192x576, the tiny test models) gain nothing: left as they are
TIMED_ROWS = (2, 4, 8)  # the rows of batch-1 verify passes (γ + 1 tokens) the routing is measured at
MIN_GAIN = 1.1  # route a shape only where the other order took at most 1/1.1 of F.linear's time
log = logging.getLogger(__name__)
_WINS: dict[tuple, bool] = {}  # (out, in, threads) -> the other order measured faster (this process)


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


def small_batch_wins(weight: torch.Tensor, reps: int = 5) -> bool:
    """(W · xᵀ)ᵀ at least MIN_GAIN times faster than F.linear on this weight, summed over TIMED_ROWS: the two
    timed in turns (a load that comes and goes hits both), the median of `reps` per rows. Measured once per
    (shape, threads) in a process: ~0.2 s for SmolLM2's LM head, a few ms for the rest."""
    key = (*weight.shape, torch.get_num_threads())
    if key not in _WINS:
        times = {"linear": [], "small": []}
        with torch.no_grad():
            for rows in TIMED_ROWS:
                x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
                per_rows = {"linear": [], "small": []}
                for _ in range(reps + 1):  # the first round warms both up
                    for name, fn in (("linear", F.linear), ("small", small_batch_linear)):
                        t0 = time.perf_counter()
                        fn(x, weight)
                        per_rows[name].append(time.perf_counter() - t0)
                for name, ts in per_rows.items():
                    times[name].append(statistics.median(ts[1:]))
        linear_s, small_s = sum(times["linear"]), sum(times["small"])
        _WINS[key] = small_s * MIN_GAIN <= linear_s
        log.info("small_batch_linear %s: F.linear %.3f ms, other order %.3f ms over rows %s -> %s", tuple(weight.shape),
                 1e3 * linear_s, 1e3 * small_s, TIMED_ROWS, "routed" if _WINS[key] else "F.linear")
    return _WINS[key]


def routable(module: nn.Module) -> bool:
    """A linear the other order may serve: plain (or already routed), on CPU, fp32, at least MIN_WEIGHT_NUMEL
    weights. Whether it does is `small_batch_wins`'s measurement."""
    if type(module) not in (nn.Linear, SmallBatchLinear):
        return False
    weight = module.weight
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.numel() >= MIN_WEIGHT_NUMEL


def use_small_batch_linear(model: nn.Module) -> int:
    """Route every `routable` plain nn.Linear of a model through small_batch_linear where it measured faster on
    this machine (`small_batch_wins`); returns how many. Calls that build a graph for training (grad enabled and a
    parameter or input requiring it) keep F.linear."""
    n = 0
    for module in model.modules():
        if type(module) is nn.Linear and routable(module) and small_batch_wins(module.weight):
            module.__class__ = SmallBatchLinear
            n += 1
    return n
