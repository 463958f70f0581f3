"""Single-device training around the shared step (dspark.training.step) and the throughput accounting
shared with the DeepSpeed session (dspark.training.session.TrainSession).

`LocalTrainer` is what recipes/gpu_recipe.py and benchmarks/train_throughput.py train with: the one
step (DrafterStep: the library loss, AdamW with the training job's optimiser section and schedule,
gradient clipping, bf16 autocast on CUDA with fp32 master weights; fp32 on CPU) on one device.

FLOPs model (`train_flops`, for tokens/s -> MFU; attention scores are not counted, as in the usual
6·N·D estimate; N counts matmul weights only — embedding tables are lookups):
    target forward            2 · N_target · tokens (N_target: the parameters a token passes through; an
                              MoE target's routers and top_k of its experts, dspark.models.moe)
    target LM head            2 · d · V · supervised predictions (p_t at the supervised positions)
    drafter context           6 · N_context · tokens (the weights a context token passes through:
                              `Drafter.context_params_per_token`, e.g. DFlash's fc and K/V projections)
    drafter anchor blocks     6 · N_drafter · anchor-block slots
    drafter LM head (frozen)  4 · d · V_draft · supervised predictions (forward + gradient w.r.t. its
                              input; V_draft = the draft vocabulary where one is set)
MFU = achieved FLOPs/s / the device's dense peak at the training precision (`peak_flops`; unknown
devices, CPUs included, report FLOPs/s only). A CPU has no data-sheet peak here; benchmarks that want an
MFU on one pass `peak=measured_matmul_peak(...)`: what a large fp32 matmul reaches on this machine now,
with this process's threads — an upper bound a training step can approach, not a vendor figure.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from dspark.models.moe import active_param_count
from dspark.training.step import DrafterStep, LossModule, TorchUpdate, autocast, resolve_precision  # noqa: F401

# Dense (no sparsity) peak FLOPs/s by GPU name fragment: bf16 tensor-core and fp32 (TF32 off) figures
# from the vendors' data sheets. Matched case-insensitively, first hit wins.
PEAK_FLOPS = (("h200", 989e12, 67e12), ("h100", 989e12, 67e12), ("a100", 312e12, 19.5e12),
              ("l40s", 362e12, 91.6e12), ("a10", 125e12, 31.2e12), ("l4", 121e12, 30.3e12))


def peak_flops(device: str | torch.device, precision: str) -> float | None:
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    name = torch.cuda.get_device_name(dev).lower()
    for key, bf16, fp32 in PEAK_FLOPS:
        if key in name:
            return bf16 if precision == "bf16" else fp32
    return None


def measured_matmul_peak(device: str | torch.device = "cpu", size: int = 1024, seconds: float = 1.0,
                         dtype: torch.dtype = torch.float32) -> float:
    """FLOPs/s of repeated [size, size] @ [size, size] matmuls in `dtype` on `device` for ~`seconds` (after
    one warm-up), with the current torch thread count: the achievable dense peak MFU is measured against."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    (a @ b).sum().item()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        (a @ b).sum().item()  # .item(): the work is done (CUDA) before the clock is read
        n += 1
    return 2.0 * size ** 3 * n / (time.perf_counter() - start)


def flops_rates(flops: float, seconds: float, device: str | torch.device, precision: str,
                world: int = 1, peak: float | None = None) -> dict[str, float | None]:
    """model_tflops_per_s over `world` devices in `seconds`, and mfu against `peak` FLOPs/s per device
    (default: the data-sheet peak; None where it is unknown, e.g. on CPU)."""
    per_s = flops / max(seconds, 1e-9)
    peak = peak or peak_flops(device, precision)
    return {"model_tflops_per_s": per_s / 1e12, "mfu": per_s / (peak * world) if peak else None}


def param_count(module: torch.nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)


def matmul_param_count(module: torch.nn.Module) -> int:
    """Trainable parameters outside embedding tables (a lookup costs no multiply-adds)."""
    lookups = {id(p) for m in module.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    return sum(p.numel() for p in module.parameters() if p.requires_grad and id(p) not in lookups)


@dataclass(frozen=True)
class FlopsModel:
    """Sizes `train_flops` needs, read once from the target and the drafter."""
    target_params: int  # the target's parameters per token (active ones for an MoE target)
    drafter_params: int  # trainable drafter matmul weights (embedding tables excluded)
    context_params: int  # of those, the ones every context token passes through
    hidden: int
    vocab: int  # the target's (p_t is normalised over all of it)
    draft_vocab: int  # the drafter's output columns
    block_slots: int  # drafter positions per anchor: γ+1 (dflash / dspark), ttt_steps (eagle3)

    @classmethod
    def of(cls, target, drafter) -> "FlopsModel":
        model = getattr(drafter, "module", drafter)
        return cls(active_param_count(target.model), matmul_param_count(model), int(model.context_params_per_token),
                   int(target.hidden_size), int(target.vocab_size), int(model.draft_vocab_size),
                   int(model.slots_per_anchor))

    def train_flops(self, tokens: float, n_anchors: float, n_supervised: float) -> float:
        """FLOPs of one micro batch (see the module docstring); tokens = non-padding tokens."""
        target = 2.0 * self.target_params * tokens + 2.0 * self.hidden * self.vocab * n_supervised
        drafter = 6.0 * (self.context_params * tokens + self.drafter_params * n_anchors * self.block_slots)
        return target + drafter + 4.0 * self.hidden * self.draft_vocab * n_supervised


@dataclass
class LocalTrainer:
    """One drafter on one device through the shared step (dspark.training.step: DrafterStep over a plain
    torch AdamW backend). `step` = one optimizer step (forward, backward, clip, AdamW, schedule);
    `update=False` measures a step without changing the weights."""

    algo: str
    target: object
    drafter: torch.nn.Module
    optim: object  # dspark.training.config.OptimSection (lr, betas, eps, weight_decay, warmup_ratio, schedule, grad_clip)
    precision: str = "fp32"
    curve: list = field(default_factory=list)
    memo: object = None  # dspark.training.target_memo.TargetMemo shared by the trainers of one process, or None

    def __post_init__(self):
        self.drafter.train()
        self.backend = TorchUpdate(LossModule(self.drafter, self.target), self.optim)
        self.core = DrafterStep(self.backend, self.target.device, self.precision, self.memo)
        self.flops_model = FlopsModel.of(self.target, self.drafter)

    @property
    def params(self) -> list:
        return self.backend.params

    @property
    def opt(self):
        return self.backend.opt

    def set_schedule(self, total_steps: int, done: int = 0) -> None:
        self.backend.set_schedule(total_steps, done)

    def step(self, batch: dict[str, torch.Tensor], seed: int, update: bool = True, chunks: int = 1) -> dict[str, float]:
        """One optimiser step on `batch`. chunks > 1 splits its rows into that many micro batches whose
        gradients accumulate (each loss scaled by its share of the rows): the same update in less memory
        (exactly the same with loss_norm='block' and equal chunks; per-chunk means otherwise)."""
        n = batch["input_ids"].shape[0]
        chunks = max(1, min(chunks, n))
        bounds = [round(i * n / chunks) for i in range(chunks + 1)]
        self.backend.accum, self.backend.micro_done = chunks, 0
        sums: dict[str, float] = {}
        for c, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            share = (hi - lo) / n
            part = {k: v[lo:hi] for k, v in batch.items()}
            metrics = self.core.micro(part, torch.Generator().manual_seed(seed * 1009 + c), share, update)
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + (v if k in DrafterStep.COUNTS else v * share)
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
