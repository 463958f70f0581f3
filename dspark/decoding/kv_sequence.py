"""One sequence's target KV cache for batch-1 decoding, behind one interface: `extend` (append tokens as a
chain or a tree, get logits and context features), `crop` (drop a rejected suffix) and `keep_path` (keep a
verified tree's accepted path). `open_sequence` gives the static decoding core's sequence
(dspark.decoding.static_core, compiled or eager) where the core walks the target, else `DynamicSequence`
over HF's DynamicCache. Invariant either way: after an operation, the first `length` cached positions hold
exactly the sequence's verified prefix.
Batched (the engine, and through it the rollout generator): `open_slots` gives the core's slots (`CoreSlots`) or the ragged store
(`RaggedSlots`), both with allocate / release / set_length / keep_columns / forward.
"""
from __future__ import annotations

import torch
from torch import Tensor

from dspark.decoding.static_core import CoreSequence, CoreSlots, StepOut, core_for, default_mode, missing_parts


def additive_layout_mask(seen: Tensor, cached: int, dtype: torch.dtype) -> Tensor:
    """[1, 1, N, cached + N] additive mask of N new tokens that see the whole cache and, among themselves,
    seen [N, N] (a chain: the lower triangle; a tree: ancestors and self)."""
    n = seen.shape[-1]
    visible = torch.cat([torch.ones(n, cached, dtype=torch.bool), seen.reshape(n, n).cpu()], dim=1)
    return torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)[None, None]


class DynamicSequence:
    """Batch-1 decoding over HF's DynamicCache (targets the static core does not walk)."""

    def __init__(self, target):
        self.target, self.cache, self.length = target, target.new_cache(), 0

    def extend(self, ids, layer_ids=(), logits: str = "all", depth: Tensor | None = None,
               seen: Tensor | None = None, eager: bool = True) -> StepOut:
        """As `CoreSequence.extend` (every step here is eager)."""
        t = self.target
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(1, -1).to(t.device)
        mask = positions = None
        if depth is not None:  # a tree: explicit mask and positions (length + depth)
            mask = additive_layout_mask(seen, self.length, t.dtype).to(t.device)
            positions = (self.length + depth.reshape(1, -1)).to(t.device)
        out = t.forward(ids, attention_mask=mask, position_ids=positions, cache=self.cache, use_cache=True,
                        layer_ids=list(layer_ids) or None, logits_at=logits)
        self.cache, self.length = out.cache, self.length + ids.shape[1]
        return StepOut(out.logits, out.features)

    def crop(self, length: int) -> None:
        self.target.crop_cache(self.cache, length)
        self.length = length

    def keep_path(self, base: int, path: Tensor) -> None:
        self.target.keep_cache_path(self.cache, base, path)
        self.length = base + len(path)


def core_mode_for(target, mode: str | None) -> str | None:
    """The core mode to decode this target with (mode default DSPARK_DECODE_CORE), or None for the path
    without the core (mode "dynamic", or a target the core does not walk)."""
    mode = mode or default_mode()
    return None if mode == "dynamic" or missing_parts(target) else mode


def open_sequence(target, mode: str | None = None) -> CoreSequence | DynamicSequence:
    """A new empty sequence on the target: the static core's (mode: auto | compiled | eager, default
    DSPARK_DECODE_CORE) where it walks this target, else (or with mode "dynamic") HF's dynamic cache."""
    core_mode = core_mode_for(target, mode)
    return DynamicSequence(target) if core_mode is None else CoreSequence(core_for(target, mode=core_mode))


def open_slots(target, max_batch: int, mode: str | None = None, max_len: int | None = None):
    """Batched sequences' KV store (CoreSlots' interface: allocate / release / set_length / keep_columns /
    forward): the core's slots (mode auto | compiled | eager, default DSPARK_DECODE_CORE; a compiled store
    starts at min(max_len, 1024) columns per slot), else (or with mode "dynamic") the ragged store of
    dspark.decoding.batched_cache."""
    from dspark.decoding.batched_cache import RaggedSlots

    core_mode = core_mode_for(target, mode)
    return RaggedSlots(target) if core_mode is None else CoreSlots(target, max_batch, core_mode, max_len)
