"""The one drafter training step, shared by the Ray Train workers (dspark.training.session, through a
DeepSpeed engine) and every single-process caller (the GPU recipe, benchmarks, LocalTrainer).

`DrafterStep.micro(batch, generator)` runs the library loss (dspark.training.loss.drafter_loss) on one
micro batch through an *update backend* and returns its metrics; the backend owns the weights' update:
- `TorchUpdate`: plain torch AdamW, gradient accumulation over `accum` micro batches (each loss scaled
  by `scale`), clipping at the boundary, the learning-rate schedule stepped per optimizer step;
- `dspark.training.session.DeepSpeedUpdate`: the same calls on a DeepSpeed engine (ZeRO, data
  parallel), which scales, accumulates, clips and steps by itself. DeepSpeed is optional: nothing
  here imports it.
Precision: `resolve_precision` decides bf16 / fp32 once for both; with bf16 the forward runs under
autocast (fp32 master weights; the frozen target is loaded in bf16 by the caller).
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn


def resolve_precision(device: str | torch.device, requested: str = "auto") -> str:
    """'auto' -> bf16 on CUDA devices that compute it natively (dspark.models.precision.bf16_is_native), fp32
    elsewhere (CPU training stays fp32; the frozen target's forward follows TrainJobConfig.target_forward_dtype);
    an explicit 'bf16' on a CUDA device without bf16 fails; 'bf16' on CPU is allowed (autocast), 'fp32' always."""
    from dspark.models import precision as hardware

    if requested not in ("auto", "bf16", "fp32"):
        raise ValueError(f"precision must be 'auto', 'bf16' or 'fp32', got {requested!r}")
    dev = torch.device(device)
    if requested == "auto":
        return "bf16" if dev.type == "cuda" and hardware.bf16_is_native(dev) else "fp32"
    if requested == "bf16" and dev.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise RuntimeError(f"bf16 is not supported on {torch.cuda.get_device_name(dev)}; use precision fp32 or auto")
    return requested


def precision_dtype(precision: str) -> torch.dtype:
    return torch.bfloat16 if precision == "bf16" else torch.float32


def autocast(device: str | torch.device, precision: str):
    """bf16 autocast context for `precision` == 'bf16' (CUDA or CPU), a no-op for fp32."""
    if precision != "bf16":
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)


class LossModule(nn.Module):
    """drafter + loss as one module whose forward returns (loss tensor, metrics): what an engine such as
    DeepSpeed must see (its hooks and ZeRO-3 gathering need the forward to go through it). The target
    is held by reference, outside the module tree: no optimizer or engine ever sees its weights.
    `forward_target`: a lower-precision copy of the target (TrainJobConfig.target_forward_dtype) that runs
    the frozen forward instead; its features and final states are cast to the target's dtype, and the
    target distribution still comes from `target`'s LM head."""

    def __init__(self, drafter: nn.Module, target, forward_target=None, read_metrics: bool = True):
        super().__init__()
        self.drafter = drafter
        self.read_metrics = read_metrics  # False: metrics stay device tensors (the session reads them per log)
        object.__setattr__(self, "target", target)
        object.__setattr__(self, "forward_target", forward_target)

    def forward(self, input_ids, loss_mask, attention_mask, generator, target_out=None):
        """target_out: the frozen target's outputs for this batch when the caller has them (TargetMemo)."""
        from dspark.training.loss import drafter_loss

        # a sharded target runs here, before drafter_loss can return early: its ranks gather layers together
        if target_out is None and (self.forward_target is not None or self.target.shards > 1):
            target_out = self.frozen_forward(input_ids, attention_mask)
        out = drafter_loss(self.drafter, self.target, input_ids, loss_mask, attention_mask, generator,
                           target_out=target_out, read_metrics=self.read_metrics)
        return out.loss, out.metrics

    @property
    def layer_ids(self) -> list[int]:
        return getattr(self.drafter, "module", self.drafter).layer_ids

    @torch.no_grad()
    def frozen_forward(self, input_ids, attention_mask):
        from dspark.models.target import TargetOutput

        dev, dtype = self.target.device, self.target.dtype
        runner = self.forward_target if self.forward_target is not None else self.target
        out = runner.forward(input_ids.to(dev), attention_mask=attention_mask.to(dev),
                             layer_ids=self.layer_ids, logits_at=None)
        if runner is self.target:
            return out
        return TargetOutput(features=out.features.to(dtype), final_hidden=out.final_hidden.to(dtype),
                            logits=None, cache=None)


class TorchUpdate:
    """AdamW + clipping + schedule on one device, gradients accumulated over `accum` micro batches."""

    def __init__(self, module: LossModule, optim, accum: int = 1):
        self.module, self.optim, self.accum = module, optim, accum
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps,
                                     weight_decay=optim.weight_decay)
        self.sched = None
        self.micro_done = 0
        self.last_grad_norm: float | None = None

    def set_schedule(self, total_steps: int, done: int = 0) -> None:
        """A schedule of `total_steps` optimiser steps, `done` of them already taken (a run re-sized in
        flight continues at step `done` of the new schedule; the peak lr is the optimiser's initial one)."""
        from dspark.training.lr_schedule import build_scheduler

        o = self.optim
        self.sched = build_scheduler(self.opt, total_steps, o.warmup_ratio, o.schedule, o.min_lr_ratio)
        for _ in range(done):
            self.sched.step()

    def forward(self, *args):
        return self.module(*args)

    def backward(self, loss: torch.Tensor, scale: float) -> None:
        (loss * scale).backward()

    def boundary(self) -> bool:
        return (self.micro_done + 1) % self.accum == 0

    def lr(self) -> float:
        return float(self.opt.param_groups[0]["lr"])

    def step(self, update: bool = True) -> None:
        """After each micro batch: at an accumulation boundary clip, step AdamW and the schedule (or, with
        update=False, drop the gradients: a measured step that leaves the weights unchanged)."""
        if self.boundary():
            if update:
                norm = torch.nn.utils.clip_grad_norm_(self.params, self.optim.grad_clip if self.optim.grad_clip > 0
                                                      else float("inf"))
                self.last_grad_norm = float(norm)
                self.opt.step()
                if self.sched is not None:
                    self.sched.step()
            self.opt.zero_grad(set_to_none=True)
        self.micro_done += 1


class DrafterStep:
    """The training step: loss on one micro batch through `update` (TorchUpdate or DeepSpeedUpdate).
    `memo` (dspark.training.target_memo.TargetMemo): the frozen target's outputs of rows already seen, shared
    across epochs (and across the drafters of one process); None runs the target on every micro batch."""

    COUNTS = ("n_anchors", "n_supervised", "n_blocks")  # summed over micro batches, never averaged

    def __init__(self, update, device: str | torch.device, precision: str, memo=None):
        self.update, self.device, self.precision, self.memo = update, torch.device(device), precision, memo

    @property
    def drafter(self) -> nn.Module:
        return self.update.module.drafter

    def micro(self, batch: dict[str, torch.Tensor], generator: torch.Generator, scale: float = 1.0,
              update: bool = True) -> dict[str, float]:
        """Forward + backward one micro batch (loss scaled by `scale` for a torch backend; DeepSpeed
        scales by its accumulation steps itself), then the backend's step; -> loss and loss metrics."""
        on_device = {k: v.to(self.device) for k, v in batch.items()}
        with autocast(self.device, self.precision):
            target_out = None
            if self.memo is not None:
                module = self.update.module
                target_out = self.memo.outputs(batch["input_ids"], batch["attention_mask"], module.layer_ids,
                                               lambda: module.frozen_forward(on_device["input_ids"],
                                                                             on_device["attention_mask"]))
            loss, metrics = self.update.forward(on_device["input_ids"], on_device["loss_mask"],
                                                on_device["attention_mask"], generator, target_out)
        self.update.backward(loss, scale)
        self.update.step(update)
        return dict(metrics)  # floats read back in one copy by drafter_loss, or device tensors (read_metrics=False)
