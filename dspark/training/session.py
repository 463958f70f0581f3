"""One worker's training session, usable without Ray (a single process in tests): the frozen target, the
shared training step (dspark.training.step.DrafterStep, the same one the GPU recipe runs without
DeepSpeed) over a DeepSpeed engine as its update backend, checkpoints, and the step loop with exact resume.

Per micro batch `dspark.training.loss.drafter_loss` runs the target to get the context features and the
target distributions at the supervised positions only (online: nothing is cached on disk; in a run of
several epochs the outputs of rows already seen are kept in memory up to `target_memo_gb` and reused,
dspark/training/target_memo.py), then the drafter loss; DeepSpeed (`DeepSpeedUpdate`) accumulates gradients to the global batch, clips, steps AdamW
(a plain torch optimizer: no JIT-compiled ops on CPU) and the warmup+cosine schedule.

Why online features: a precomputed target cache (what the public reference does) stores the fused
hidden states of every training token, ~30 KB per token for a 4B target (5 layers x 2560 x bf16), i.e.
tens of TB for a 1-2 B-token dataset, written once and re-read every epoch. Here that storage and its
I/O are zero; the price is one no-grad target forward per sequence per epoch (~2·N FLOPs/token, N the
target size) and the LM head only at the supervised positions (d-dim states, never V-dim logits
over the whole sequence).

Step bookkeeping: `step` = optimizer steps done. With S steps per epoch and G micro batches per step,
step s lives in epoch s // S and starts after micro batch (s % S)·G of that epoch, so a checkpoint
only needs `step` to resume exactly where it left off.
"""
from __future__ import annotations

import json
import os
import resource
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch
from torch import nn

from dspark.training.batching import collate, sequence_limit
from dspark.training.loop import flops_rates
from dspark.training.plan import TrainPlan
from dspark.training.step import DrafterStep, LossModule, precision_dtype, resolve_precision


DS_TAG = "deepspeed"  # DeepSpeed checkpoint tag (sub-folder) inside each Ray checkpoint


DRAFTER_DIR = "drafter"  # HF-style drafter export inside each Ray checkpoint


STATE_FILE = "train_state.json"


# ----------------------------------------------------------------------------- engine
def plan_precision(plan: TrainPlan, requested: str, device: torch.device) -> TrainPlan:
    """The plan under the one precision rule (dspark.training.step.resolve_precision): a bf16 plan on a GPU
    without bf16 falls back to fp32 (and its DeepSpeed JSON with it) when "auto", and fails when "bf16"."""
    if plan.precision != "bf16" or device.type != "cuda" or resolve_precision(device, requested) == "bf16":
        return plan
    return replace(plan, precision="fp32", ds_config={**plan.ds_config, "bf16": {"enabled": False}})


class DeepSpeedUpdate:
    """The DeepSpeed engine as the shared step's update backend (dspark.training.step): the engine scales
    each loss by its accumulation steps, reduces gradients over ranks, clips and steps AdamW and the
    schedule at accumulation boundaries by itself."""

    def __init__(self, engine, plan: TrainPlan):
        self.engine, self.plan = engine, plan
        self.micro_done = 0
        self.grad_norm: float | None = None
        self.lr = 0.0  # lr of the last optimizer step (DeepSpeed steps the schedule right after it)

    @property
    def module(self) -> LossModule:
        return self.engine.module

    def forward(self, *args):
        return self.engine(*args)

    def backward(self, loss, scale: float) -> None:
        self.engine.backward(loss)  # scale is the engine's own (1 / gradient_accumulation_steps)

    def boundary(self) -> bool:
        return (self.micro_done + 1) % self.plan.grad_accum == 0

    def step(self, update: bool = True) -> None:
        if not update:
            raise ValueError("a DeepSpeed step always updates; measure steps with the torch backend")
        if self.boundary():
            self.grad_norm, self.lr = self._manual_grad_norm(), float(self.engine.get_lr()[0])
        self.engine.step()
        self.micro_done += 1

    def _manual_grad_norm(self) -> float | None:
        """ZeRO stage 0 in fp32 does not record the clipped norm: compute it (grads are reduced by now)."""
        if self.plan.zero_stage != 0:
            return None
        sq = [p.grad.detach().float().pow(2).sum() for p in self.engine.module.parameters() if p.grad is not None]
        return float(torch.stack(sq).sum().sqrt()) if sq else 0.0


def bf16_forward(setting: str, precision: str, device_type: str) -> bool:
    """Whether a bf16 copy of the target runs the frozen forward: asked for (bfloat16, or auto where the
    device computes bf16 natively) and the training precision is not bf16 already (then the target is)."""
    from dspark.models import precision as hardware

    if precision == "bf16" or setting == "same":
        return False
    return setting == "bfloat16" or hardware.bf16_is_native(device_type)


def init_engine(cfg, plan: TrainPlan, target, forward_target=None):
    """Build the drafter (same seed on every rank) and wrap it in a DeepSpeed engine."""
    import deepspeed

    from dspark.drafters import build_drafter
    from dspark.training.lr_schedule import build_scheduler

    if target.device.type == "cpu":
        # DeepSpeed's CPU shared-memory allreduce is JIT-compiled on first use (minutes): use gloo's.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    torch.manual_seed(cfg.optim.seed)
    # the driver's draft vocabulary (jobs.train.build_draft_vocab); None ids = the full vocabulary
    drafter = build_drafter(cfg.drafter, target, draft_ids=plan.draft_vocab.ids())
    if plan.init_dir:  # jobs.train's init_from, resolved to a local checkpoint by the worker
        load_initial_weights(drafter, plan.init_dir, target)
    drafter.train()
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), eps=cfg.optim.eps,
                                  weight_decay=cfg.optim.weight_decay)
    schedule = (plan.total_steps, cfg.optim.warmup_ratio, cfg.optim.schedule, cfg.optim.min_lr_ratio)
    engine, _, _, _ = deepspeed.initialize(
        model=LossModule(drafter, target, forward_target, read_metrics=False), optimizer=optimizer, config=plan.ds_config,
        lr_scheduler=lambda opt: build_scheduler(opt, *schedule))  # stepped by DeepSpeed per optimizer step
    return engine


def load_initial_weights(drafter: nn.Module, init_dir: str, target) -> None:
    """Copy a saved drafter's weights into the freshly built one (same architecture: strict; or the same
    but deeper: the added layers start as no-ops, dspark.drafters.deepen). Its draft temperature (a
    decoding setting chosen by measurement) carries over; its calibration (fitted to the old weights)
    does not: calibrate the continued drafter again."""
    from dspark.drafters import load_drafter
    from dspark.drafters.deepen import deepen_from

    source = load_drafter(init_dir, target, device=target.device)
    getattr(drafter, "module", drafter).draft_temperature = source.draft_temperature
    if len(getattr(source, "layers", ())) < len(getattr(drafter, "layers", ())):
        deepen_from(drafter, source)
        return
    try:
        drafter.load_state_dict(source.state_dict(), strict=True)
    except RuntimeError as err:
        raise RuntimeError(f"init_from checkpoint {init_dir} does not fit the drafter config: {err}") from None


def drafter_of(engine) -> nn.Module:
    return engine.module.drafter


# ----------------------------------------------------------------------------- session
@dataclass
class StepResult:
    step: int
    metrics: dict[str, float] | None  # rank-averaged over the steps since the last report: loss terms, lr,
    # grad_norm, tokens_per_s, ...; None on steps that do not report (TrainSession.reports)


@dataclass
class TrainSession:
    """One worker's training state: target, DeepSpeed engine, step counter. Drive it with `run`."""

    cfg: object  # jobs.train.TrainJobConfig
    plan: TrainPlan  # the driver's (jobs.train.prepare_run)
    rank: int
    world: int
    device: torch.device
    engine: object = None
    target: object = None
    step: int = 0
    restored_from: int | None = None
    restarts: int = 0
    local_copy: Callable[[str], str] | None = None  # copies an s3:// target here (jobs.train_worker passes storage's)
    _tokens: int = 0
    _metric_sums: dict = field(default_factory=dict)
    _micro: int = 0
    _window_steps: int = 0  # optimizer steps since the last step_metrics
    _t_last: float = 0.0
    _step: object = None  # the shared DrafterStep over this session's DeepSpeedUpdate
    _steps_here: int = 0  # optimizer steps taken since this process started (or resumed)
    _timed: tuple = (0.0, 0)  # (time of this launch's first step, tokens since then)
    _flops_model: object = None
    _mesh: object = None  # the target's device mesh when cfg.scaling.target_shards > 1

    def setup(self) -> "TrainSession":
        self.plan = plan_precision(self.plan, self.cfg.deepspeed.precision, self.device)
        precision = self.plan.precision
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.target = self.load_frozen_target(precision_dtype(precision))
        forward_target = self.forward_target_of(precision)
        self.engine = init_engine(self.cfg, self.plan, self.target, forward_target)
        self._step = DrafterStep(DeepSpeedUpdate(self.engine, self.plan), self.device, precision, self.memo())
        from dspark.training.loop import FlopsModel

        self._flops_model = FlopsModel.of(self.target, drafter_of(self.engine))
        return self

    def load_frozen_target(self, dtype: torch.dtype):
        """The target in `dtype`: whole, or with its decoder layers split over cfg.scaling.target_shards
        workers of a node (dspark.models.sharded_target; collective: every rank loads its part)."""
        from dspark.models.target import load_target

        shards = self.cfg.scaling.target_shards
        if shards == 1:
            return load_target(self.cfg.target, dtype=dtype, device=str(self.device), local_copy=self.local_copy)
        from dspark.models.sharded_target import load_sharded_target, shard_mesh

        if self._mesh is None:
            self._mesh = shard_mesh(shards, self.device.type)
        return load_sharded_target(self.cfg.target, self._mesh, dtype=dtype, device=str(self.device),
                                   local_copy=self.local_copy)

    def memo(self):
        """The target memo (cfg.target_memo_gb) when a later epoch can reuse it, else None. Off for a sharded
        target: its ranks must run the target together on every micro batch, hit or miss."""
        from dspark.training.target_memo import TargetMemo

        if self.cfg.scaling.target_shards > 1:
            return None
        repeats = self.plan.total_steps > self.plan.steps_per_epoch
        return TargetMemo.of_gb(self.cfg.target_memo_gb) if repeats else None

    def forward_target_of(self, precision: str):
        """A bf16 copy of the target for the frozen forward (cfg.target_forward_dtype), or None."""
        if not bf16_forward(self.cfg.target_forward_dtype, precision, self.device.type):
            return None
        return self.load_frozen_target(torch.bfloat16)

    # ---- checkpoints ---------------------------------------------------------------------
    def save(self, out_dir: str) -> None:
        """Collective: every rank writes its DeepSpeed shards; rank 0 adds the drafter export and state."""
        self.engine.save_checkpoint(out_dir, tag=DS_TAG, client_state={"step": self.step})
        self.export_drafter(os.path.join(out_dir, DRAFTER_DIR))
        if self.rank == 0:
            state = {"step": self.step, "restored_from": self.restored_from, "restarts": self.restarts,
                     "target_meta": self.target.meta(), "world_size": self.world,
                     "zero_stage": self.plan.zero_stage}
            Path(out_dir, STATE_FILE).write_text(json.dumps(state, indent=2))

    def export_drafter(self, out_dir: str) -> None:
        """HF-style drafter directory (rank 0). Under ZeRO-3 the weights are gathered first (collective)."""
        from dspark.drafters import save_drafter

        drafter = drafter_of(self.engine)
        if self.plan.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(drafter.parameters()), modifier_rank=None):
                if self.rank == 0:
                    save_drafter(drafter, out_dir)
        elif self.rank == 0:
            save_drafter(drafter, out_dir)

    def restore(self, ckpt_dir: str) -> None:
        state_path = Path(ckpt_dir, STATE_FILE)
        state = json.loads(state_path.read_text()) if state_path.exists() else {}
        check_same_target(state.get("target_meta"), self.target, ckpt_dir)
        load_path, client = self.engine.load_checkpoint(ckpt_dir, tag=DS_TAG, load_optimizer_states=True,
                                                        load_lr_scheduler_states=True)
        if load_path is None:
            raise RuntimeError(f"checkpoint {ckpt_dir} holds no DeepSpeed state under '{DS_TAG}/'")
        self.step = int(client["step"])
        self.restored_from = self.step
        self.restarts = int(state.get("restarts", 0)) + 1

    # ---- training ------------------------------------------------------------------------
    def micro_step(self, batch: dict[str, torch.Tensor], generator: torch.Generator) -> None:
        """The shared step on one micro batch; DeepSpeed steps the optimizer at accumulation boundaries.
        Its metrics stay on the device, summed there; `step_metrics` reads them back (log steps only)."""
        metrics = self._step.micro(batch, generator)
        self._micro += 1
        self._tokens += int(batch["attention_mask"].sum())
        for key, value in metrics.items():
            self._metric_sums[key] = self._metric_sums[key] + value if key in self._metric_sums else value

    def step_metrics(self) -> dict[str, float]:
        """Metrics of the micro batches since the last call, averaged over micro batches and ranks
        (tokens summed, memory the maximum over ranks). `mean_tokens_per_s` covers this launch's
        steps after its first (start-up and warm-up excluded)."""
        import torch.distributed as dist

        from dspark.training.loss import read_back

        sums = read_back(self._metric_sums) if self._metric_sums else {}  # the one device-to-host copy
        flops = self._flops_model.train_flops(self._tokens, sums.get("n_anchors", 0.0), sums.get("n_supervised", 0.0))
        local = {k: v / max(1, self._micro) for k, v in sums.items()}
        payload = {"metrics": local, "tokens": self._tokens, "flops": flops, "mem": peak_memory_gb(self.device)}
        gathered = [None] * self.world
        if dist.is_available() and dist.is_initialized() and self.world > 1:
            dist.all_gather_object(gathered, payload)
        else:
            gathered = [payload]
        now = time.perf_counter()
        out = average_dicts([g["metrics"] for g in gathered])
        tokens = sum(g["tokens"] for g in gathered)
        norm = self.engine.get_global_grad_norm()
        norm = self._step.update.grad_norm if norm is None else norm
        out.update({"lr": self._step.update.lr, "tokens": float(tokens), "tokens_per_s": tokens / max(1e-9, now - self._t_last),
                    "step_time_s": (now - self._t_last) / max(1, self._window_steps),
                    "peak_mem_gb": max(g["mem"] for g in gathered)})
        if norm is not None:
            out["grad_norm"] = float(norm)
        rates = flops_rates(sum(g["flops"] for g in gathered), now - self._t_last, self.device,
                            self.plan.precision, len(gathered))
        out.update({k: v for k, v in rates.items() if v is not None})  # no mfu where the peak is unknown
        self._steps_here += 1
        if self._steps_here == 1:
            self._timed = (now, 0)
        else:
            self._timed = (self._timed[0], self._timed[1] + tokens)
            out["mean_tokens_per_s"] = self._timed[1] / max(1e-9, now - self._timed[0])
        self._metric_sums, self._micro, self._tokens, self._t_last, self._window_steps = {}, 0, 0, now, 0
        return out

    def run(self, epoch_batches: Callable[[int], Iterable[dict]],
            on_step: Callable[[StepResult], None]) -> None:
        """Train from `self.step` to plan.total_steps. `epoch_batches(epoch)` yields raw row batches
        (dict of columns); `on_step` is called after every optimizer step on every rank."""
        total, per_epoch, accum = self.plan.total_steps, self.plan.steps_per_epoch, self.plan.grad_accum
        pad_id, max_len = self.target.pad_token_id, sequence_limit(self.cfg.data.max_seq_len, self.target)
        self._t_last = time.perf_counter()
        while self.step < total:
            epoch, done_in_epoch = divmod(self.step, per_epoch)
            first, last = done_in_epoch * accum, per_epoch * accum  # micro batch range still to train on
            for index, rows in enumerate(epoch_batches(epoch)):
                if self.step >= total:
                    break
                if not first <= index < last:
                    continue  # already trained on (resume) or the tail that does not fill a global batch
                generator = torch.Generator().manual_seed(micro_seed(self.cfg.optim.seed, self.rank, epoch, index))
                self.micro_step(collate(rows, max_len, pad_id), generator)
                if (index + 1) % accum == 0:
                    self.step += 1
                    self._window_steps += 1
                    metrics = {**self.step_metrics(), "epoch": float(epoch)} if self.reports(self.step) else None
                    on_step(StepResult(self.step, metrics))

    def reports(self, step: int) -> bool:
        """Metrics are read back and gathered on log steps, checkpoint steps and the last step only."""
        return (step % self.cfg.tracking.log_every_steps == 0 or step % self.cfg.checkpoint.every_steps == 0
                or step >= self.plan.total_steps)


def micro_seed(seed: int, rank: int, epoch: int, index: int) -> int:
    """Anchor-sampling seed of one micro batch: distinct per rank/epoch/batch, identical on a rerun."""
    return (seed * 1_000_003 + rank * 7_919 + epoch * 104_729 + index) % (2**63 - 1)


def average_dicts(dicts: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for d in dicts for k in d})
    return {k: float(np.mean([d[k] for d in dicts if k in d])) for k in keys}


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def check_same_target(meta: dict | None, target, source: str) -> None:
    if not meta:
        return
    mine = target.meta()
    diff = [k for k in ("name", "hidden_size", "vocab_size", "num_layers") if meta.get(k) != mine.get(k)]
    if diff:
        raise ValueError(f"checkpoint {source} was trained with target {meta.get('name')!r} "
                         f"({ {k: meta.get(k) for k in diff} }), but this run loads {mine['name']!r} "
                         f"({ {k: mine.get(k) for k in diff} }); use the original target or a new run_name")
