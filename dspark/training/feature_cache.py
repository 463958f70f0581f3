"""Frozen-target features computed ONCE per rollout token, and drafter training from them.

Why. The target is frozen, so its context features (the m fused layer states) and its final hidden
states are a fixed function of each rollout sequence. Online training (dspark/training/session.py)
recomputes them for every epoch, every data-size point and every algorithm; on a small CPU budget that
target forward is most of a step (2·N_target FLOPs per token vs 6·N_drafter per drafter position). Here
it runs once per sequence; every drafter trained later (any algorithm, any nested subset, any epoch)
reads the same cache. The target distributions p_t are NOT stored (V-dim): `drafter_loss` recomputes
them from the cached final hidden state with the frozen LM head at the supervised positions only, so
the loss is the online loss exactly (up to the bf16 rounding of the cached states).

Storage: shards `<dir>/shard-<k>.pt`, each {input_ids, loss_mask: lists of rows, features [n_tok, m·d]
and final [n_tok, d] as bf16, offsets [rows+1]} for `rows_per_shard` consecutive rows, written
atomically (tmp + rename), so an interrupted build resumes at the first missing shard. `meta.json`
records the target and layer ids; a cache built for another target or other layers is refused.
Cost: (m+1)·d·2 bytes per token (smollm2-135m, m = 3: 4.6 KB/token, 0.46 GB per 100 k tokens).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import Tensor

from dspark.models.target import TargetOutput


@dataclass
class FeatureCache:
    """The cached rows (in build order) and their features, all in memory (bf16)."""

    input_ids: list[list[int]] = field(default_factory=list)
    loss_mask: list[list[int]] = field(default_factory=list)
    features: list[Tensor] = field(default_factory=list)  # per row [T, m*d] bf16 (views into shard tensors)
    final: list[Tensor] = field(default_factory=list)  # per row [T, d] bf16

    def __len__(self) -> int:
        return len(self.input_ids)

    def generated_tokens(self) -> list[int]:
        return [int(sum(m)) for m in self.loss_mask]


def _meta(target, layer_ids: Sequence[int], max_len: int) -> dict:
    return {"target": target.name, "revision": target.revision, "hidden_size": int(target.hidden_size),
            "layer_ids": list(layer_ids), "max_len": int(max_len), "dtype": str(target.dtype).removeprefix("torch.")}


@torch.no_grad()
def build_cache(target, rows: Sequence[dict], layer_ids: Sequence[int], out_dir: str, max_len: int,
                rows_per_shard: int = 64, batch_size: int = 4,
                progress: Callable[[str], None] | None = None) -> None:
    """Run the target once over every row (input_ids, loss_mask; cut to max_len) and store its features.
    Resumable: shards already on disk are skipped. Rows are batched by similar length inside a shard
    (right padding: causal attention keeps the real positions exactly as in an unpadded forward)."""
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    meta = _meta(target, layer_ids, max_len)
    meta_path = root / "meta.json"
    if meta_path.exists() and json.loads(meta_path.read_text()) != meta:
        raise ValueError(f"{out_dir} holds features of another target/layers/max_len "
                         f"({json.loads(meta_path.read_text())} != {meta}); use a new folder")
    meta_path.write_text(json.dumps(meta))
    shards = range(0, len(rows), rows_per_shard)
    t0, done_tokens = time.perf_counter(), 0
    for k, start in enumerate(shards):
        path = root / f"shard-{k:05d}.pt"
        if path.exists():
            continue
        part = rows[start:start + rows_per_shard]
        ids = [list(r["input_ids"])[:max_len] for r in part]
        masks = [list(r["loss_mask"])[:max_len] for r in part]
        feats, finals = _forward_rows(target, ids, layer_ids, batch_size)
        lengths = [len(x) for x in ids]
        offsets = torch.tensor([0] + lengths).cumsum(0)
        tmp = path.with_suffix(".tmp")
        torch.save({"input_ids": ids, "loss_mask": masks, "offsets": offsets,
                    "features": torch.cat(feats), "final": torch.cat(finals)}, tmp)
        os.replace(tmp, path)
        done_tokens += sum(lengths)
        if progress:
            dt = time.perf_counter() - t0
            progress(f"feature cache shard {k + 1}/{len(shards)}: {sum(lengths)} tokens, "
                     f"{done_tokens / dt:.0f} tok/s this run")


def _forward_rows(target, ids: list[list[int]], layer_ids: Sequence[int], batch_size: int):
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    feats: list[Tensor | None] = [None] * len(ids)
    finals: list[Tensor | None] = [None] * len(ids)
    pad = target.pad_token_id
    for b in range(0, len(order), batch_size):
        pick = order[b:b + batch_size]
        width = max(len(ids[i]) for i in pick)
        x = torch.full((len(pick), width), pad, dtype=torch.long)
        attn = torch.zeros_like(x)
        for r, i in enumerate(pick):
            x[r, :len(ids[i])] = torch.tensor(ids[i])
            attn[r, :len(ids[i])] = 1
        out = target.forward(x.to(target.device), attention_mask=attn.to(target.device), layer_ids=list(layer_ids),
                             logits_at=None)
        for r, i in enumerate(pick):
            n = len(ids[i])
            feats[i] = out.features[r, :n].to("cpu", torch.bfloat16)
            finals[i] = out.final_hidden[r, :n].to("cpu", torch.bfloat16)
    return feats, finals


def load_cache(out_dir: str, target, layer_ids: Sequence[int], max_len: int, limit_rows: int | None = None) -> FeatureCache:
    """The cached rows in build order (the first `limit_rows` if given); checks the cache's target."""
    root = Path(out_dir)
    meta = json.loads((root / "meta.json").read_text())
    want = _meta(target, layer_ids, max_len)
    if meta != want:
        raise ValueError(f"feature cache {out_dir} was built for {meta}, not {want}")
    cache = FeatureCache()
    for path in sorted(root.glob("shard-*.pt")):
        if limit_rows is not None and len(cache) >= limit_rows:
            break
        shard = torch.load(path, weights_only=True)
        off = shard["offsets"].tolist()
        for r in range(len(shard["input_ids"])):
            cache.input_ids.append(shard["input_ids"][r])
            cache.loss_mask.append(shard["loss_mask"][r])
            cache.features.append(shard["features"][off[r]:off[r + 1]])
            cache.final.append(shard["final"][off[r]:off[r + 1]])
    if limit_rows is not None:
        for name in ("input_ids", "loss_mask", "features", "final"):
            setattr(cache, name, getattr(cache, name)[:limit_rows])
    return cache


def collate_cached(cache: FeatureCache, rows: Sequence[int], pad_id: int, device, dtype=torch.float32) -> dict:
    """Right-padded batch of cached rows: input_ids, loss_mask, attention_mask [B, T] and a TargetOutput
    with features [B, T, m·d] and final hidden [B, T, d] (padding positions zero: never attended to,
    never supervised)."""
    width = max(len(cache.input_ids[i]) for i in rows)
    B = len(rows)
    ids = torch.full((B, width), pad_id, dtype=torch.long)
    mask = torch.zeros((B, width), dtype=torch.long)
    attn = torch.zeros((B, width), dtype=torch.long)
    feats = torch.zeros((B, width, cache.features[rows[0]].shape[-1]), dtype=dtype)
    final = torch.zeros((B, width, cache.final[rows[0]].shape[-1]), dtype=dtype)
    for b, i in enumerate(rows):
        n = len(cache.input_ids[i])
        ids[b, :n] = torch.tensor(cache.input_ids[i])
        mask[b, :n] = torch.tensor(cache.loss_mask[i])
        attn[b, :n] = 1
        feats[b, :n] = cache.features[i].to(dtype)
        final[b, :n] = cache.final[i].to(dtype)
    out = TargetOutput(features=feats.to(device), final_hidden=final.to(device), logits=None, cache=None)
    return {"input_ids": ids.to(device), "loss_mask": mask.to(device), "attention_mask": attn.to(device),
            "target_out": out}


def cached_step(trainer, batch: dict, seed: int, update: bool = True) -> dict[str, float]:
    """One optimiser step of a `dspark.training.loop.LocalTrainer` on a cached batch (the same update as
    `LocalTrainer.step`, with the target's outputs read from the cache; update=False drops the gradients:
    a timed step that leaves the weights unchanged). `flops` counts the drafter work only (forward +
    backward and its frozen LM head); the target forward was paid at build time."""
    from dspark.training.loop import autocast
    from dspark.training.loss import drafter_loss

    with autocast(trainer.target.device, trainer.precision):
        out = drafter_loss(trainer.drafter, trainer.target, batch["input_ids"], batch["loss_mask"],
                           batch["attention_mask"], torch.Generator().manual_seed(seed), target_out=batch["target_out"])
    backend = trainer.backend  # the shared AdamW + clip + schedule update (dspark.training.step.TorchUpdate)
    backend.accum, backend.micro_done = 1, 0
    backend.backward(out.loss, 1.0)
    backend.step(update)
    tokens = float(batch["attention_mask"].sum())
    fm = trainer.flops_model
    n_anchor, n_sup = out.metrics.get("n_anchors", 0.0), out.metrics.get("n_supervised", 0.0)
    flops = fm.train_flops(tokens, n_anchor, n_sup) - 2.0 * fm.target_params * tokens  # no target forward
    return {**out.metrics, "tokens": tokens, "flops": flops}
