"""The single-device training step (no Ray, no DeepSpeed) and the throughput accounting shared with the
DeepSpeed session (jobs/train_worker.TrainSession).

`LocalTrainer` is what benchmarks/gpu_drafter_compare.py (the GPU recipe) and
benchmarks/train_throughput.py train with: the library loss (dspark.training.loss.drafter_loss), AdamW with
the training job's optimiser section and schedule, gradient clipping, and bf16 autocast on CUDA
(fp32 master weights; the frozen target is loaded in bf16 by the caller). On CPU it runs in fp32.

FLOPs model (`train_flops`, for tokens/s -> MFU; attention scores are not counted, as in the usual
6·N·D estimate):
    target forward            2 · N_target · tokens
    target LM head            2 · d · V · supervised predictions (p_t at the supervised positions)
    drafter forward+backward  6 · N_drafter · drafter positions (context tokens + anchor-block slots)
    drafter LM head (frozen)  4 · d · V · supervised predictions (forward + gradient w.r.t. its input)
MFU = achieved FLOPs/s / the device's dense peak at the training precision (`peak_flops`; unknown
devices, CPUs included, report FLOPs/s only).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

# Dense (no sparsity) peak FLOPs/s by GPU name fragment: bf16 tensor-core and fp32 (TF32 off) figures
# from the vendors' data sheets. Matched case-insensitively, first hit wins.
PEAK_FLOPS = (("h200", 989e12, 67e12), ("h100", 989e12, 67e12), ("a100", 312e12, 19.5e12),
              ("l40s", 362e12, 91.6e12), ("a10", 125e12, 31.2e12), ("l4", 121e12, 30.3e12))


def resolve_precision(device: str | torch.device, precision: str = "auto") -> str:
    """'auto' -> bf16 on CUDA (when supported), fp32 elsewhere; 'bf16' / 'fp32' as asked."""
    if precision not in ("auto", "bf16", "fp32"):
        raise ValueError(f"precision must be 'auto', 'bf16' or 'fp32', got {precision!r}")
    if precision != "auto":
        return precision
    dev = torch.device(device)
    return "bf16" if dev.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"


def autocast(device: str | torch.device, precision: str):
    """bf16 autocast context for `precision` == 'bf16' (CUDA or CPU), a no-op for fp32."""
    if precision != "bf16":
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)


def peak_flops(device: str | torch.device, precision: str) -> float | None:
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    name = torch.cuda.get_device_name(dev).lower()
    for key, bf16, fp32 in PEAK_FLOPS:
        if key in name:
            return bf16 if precision == "bf16" else fp32
    return None


def flops_rates(flops: float, seconds: float, device: str | torch.device, precision: str,
                world: int = 1) -> dict[str, float | None]:
    """model_tflops_per_s over `world` devices in `seconds`, and mfu (None where the device's peak is
    unknown, e.g. on CPU)."""
    per_s = flops / max(seconds, 1e-9)
    peak = peak_flops(device, precision)
    return {"model_tflops_per_s": per_s / 1e12, "mfu": per_s / (peak * world) if peak else None}


def param_count(module: torch.nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)


@dataclass(frozen=True)
class FlopsModel:
    """Sizes `train_flops` needs, read once from the target and the drafter."""
    target_params: int
    drafter_params: int  # trainable drafter parameters
    hidden: int
    vocab: int
    block_slots: int  # drafter positions per anchor: γ+1 (dflash / dspark), ttt_steps (eagle3)

    @classmethod
    def of(cls, target, drafter) -> "FlopsModel":
        model = getattr(drafter, "module", drafter)
        slots = model.slots_per_anchor
        return cls(param_count(target.model), param_count(model, trainable_only=True), int(target.hidden_size),
                   int(target.vocab_size), int(slots))

    def train_flops(self, tokens: float, n_anchors: float, n_supervised: float) -> float:
        """FLOPs of one micro batch (see the module docstring); tokens = non-padding tokens."""
        head = self.hidden * self.vocab * n_supervised
        drafter_positions = tokens + n_anchors * self.block_slots
        return 2.0 * self.target_params * tokens + 2.0 * head + 6.0 * self.drafter_params * drafter_positions \
            + 4.0 * head


@dataclass
class LocalTrainer:
    """One drafter, its AdamW optimiser and schedule on one device. `step` = forward, backward, clip,
    optimiser and schedule step; `update=False` measures a step without changing the weights."""

    algo: str
    target: object
    drafter: torch.nn.Module
    optim: object  # jobs.train.OptimSection (lr, betas, eps, weight_decay, warmup_ratio, schedule, grad_clip)
    precision: str = "fp32"
    curve: list = field(default_factory=list)

    def __post_init__(self):
        self.drafter.train()
        self.params = [p for p in self.drafter.parameters() if p.requires_grad]
        o = self.optim
        self.opt = torch.optim.AdamW(self.params, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                     weight_decay=o.weight_decay)
        self.sched = None
        self.flops_model = FlopsModel.of(self.target, self.drafter)

    def set_schedule(self, total_steps: int) -> None:
        from dspark.training.lr_schedule import build_scheduler

        o = self.optim
        self.sched = build_scheduler(self.opt, total_steps, o.warmup_ratio, o.schedule, o.min_lr_ratio)

    def step(self, batch: dict[str, torch.Tensor], seed: int, update: bool = True, chunks: int = 1) -> dict[str, float]:
        """One optimiser step on `batch`. chunks > 1 splits its rows into that many micro batches whose
        gradients accumulate (each loss scaled by its share of the rows): the same update in less memory
        (exactly the same with loss_norm='block' and equal chunks; per-chunk token means otherwise)."""
        from dspark.training.loss import drafter_loss

        device, n = self.target.device, batch["input_ids"].shape[0]
        bounds = [round(i * n / chunks) for i in range(chunks + 1)]
        sums: dict[str, float] = {}
        for c, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            if hi <= lo:
                continue
            part = {k: v[lo:hi] for k, v in batch.items()}
            with autocast(device, self.precision):
                out = drafter_loss(self.drafter, self.target, part["input_ids"], part["loss_mask"],
                                   part["attention_mask"], torch.Generator().manual_seed(seed * 1009 + c))
            share = (hi - lo) / n
            (out.loss * share).backward()
            for k, v in out.metrics.items():
                add = v if k in ("n_anchors", "n_supervised", "n_blocks") else v * share
                sums[k] = sums.get(k, 0.0) + add
        if update:
            if self.optim.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.params, self.optim.grad_clip)
            self.opt.step()
            if self.sched is not None:
                self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        tokens = float(batch["attention_mask"].sum())
        return {**sums, "tokens": tokens,
                "flops": self.flops_model.train_flops(tokens, sums.get("n_anchors", 0.0), sums.get("n_supervised", 0.0))}


@dataclass
class Throughput:
    """Tokens/s and FLOPs/s (MFU where the peak is known) between `mark` calls."""

    device: str
    precision: str
    world: int = 1
    _t: float = field(default_factory=time.perf_counter)

    def mark(self, tokens: float, flops: float, sync: bool = True) -> dict[str, float]:
        if sync and torch.device(self.device).type == "cuda":
            torch.cuda.synchronize()
        now = time.perf_counter()
        dt, self._t = max(now - self._t, 1e-9), now
        rates = flops_rates(flops, dt, self.device, self.precision, self.world)
        return {"tokens_per_s": tokens / dt, **{k: v for k, v in rates.items() if v is not None}}
