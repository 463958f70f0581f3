"""The frozen target's outputs per training row, kept in memory across epochs and drafters, up to a budget.

The target is frozen, so a row's context features and final hidden states depend only on its tokens: a
second epoch over the same rows, or a second drafter trained on them (the GPU recipe trains three), needs
no new target forward. `TargetMemo` keeps them, keyed by the row's real tokens and the feature layers.

Invariant: a batch is served from the memo only when every row of it is held; each row's outputs are
exactly what a forward over that row produced (causal target, right padding: padding never changes the
real positions), padded back with zeros to the batch's length (padded positions are masked in the loss).
Rows that do not fit the budget are simply recomputed next time (no eviction churn); `stats` counts it.
Memory: (m + 1)·d·bytes per token on the device the target runs on (smollm2-135m bf16, m = 3: 4.6 KB).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import Tensor

from dspark.models.target import TargetOutput


@dataclass
class MemoStats:
    hits: int = 0  # batches served from the memo
    misses: int = 0  # batches that ran the target
    rows_held: int = 0
    rows_over_budget: int = 0  # rows computed but not kept (the budget was full)
    bytes_held: int = 0


@dataclass
class TargetMemo:
    budget_bytes: int
    stats: MemoStats = field(default_factory=MemoStats)
    _rows: dict = field(default_factory=dict)  # key -> (features [n, m*d], final [n, d])

    @classmethod
    def of_gb(cls, gb: float) -> TargetMemo | None:
        """A memo of `gb` GiB, or None for 0 (no memo)."""
        return cls(int(gb * 2**30)) if gb > 0 else None

    def outputs(self, input_ids: Tensor, attention_mask: Tensor, layer_ids: Sequence[int],
                forward: Callable[[], TargetOutput]) -> TargetOutput:
        """The target's features and final states for this batch (CPU input_ids/attention_mask [B, T]):
        from the memo when every row is held, else from `forward()` (whose rows are then kept if they fit)."""
        lengths = attention_mask.sum(-1).tolist()
        keys = [row_key(ids[:n], layer_ids) for ids, n in zip(input_ids, lengths)]
        held = [self._rows.get(k) for k in keys]
        if all(h is not None for h in held):
            self.stats.hits += 1
            return _padded(held, input_ids.shape[1])
        self.stats.misses += 1
        out = forward()
        for b, (key, n) in enumerate(zip(keys, lengths)):
            if key not in self._rows:
                self._keep(key, out.features[b, :n], out.final_hidden[b, :n])
        return out

    def _keep(self, key: bytes, features: Tensor, final: Tensor) -> None:
        size = features.numel() * features.element_size() + final.numel() * final.element_size()
        if self.stats.bytes_held + size > self.budget_bytes:
            self.stats.rows_over_budget += 1
            return
        self._rows[key] = (features.clone(), final.clone())
        self.stats.rows_held += 1
        self.stats.bytes_held += size


def row_key(ids: Tensor, layer_ids: Sequence[int]) -> bytes:
    """A row's identity: its real tokens and the target layers whose states it needs."""
    digest = hashlib.blake2b(ids.to(torch.int64).numpy().tobytes(), digest_size=16)
    digest.update(repr(tuple(layer_ids)).encode())
    return digest.digest()


def _padded(held: list[tuple[Tensor, Tensor]], length: int) -> TargetOutput:
    """Rows (features [n_b, m*d], final [n_b, d]) -> a right-padded batch [B, length, ...] (zeros past n_b)."""
    feats, finals = zip(*held)
    features = feats[0].new_zeros(len(held), length, feats[0].shape[-1])
    final = finals[0].new_zeros(len(held), length, finals[0].shape[-1])
    for b, (f, h) in enumerate(held):
        features[b, :f.shape[0]] = f
        final[b, :h.shape[0]] = h
    return TargetOutput(features=features, final_hidden=final, logits=None, cache=None)
