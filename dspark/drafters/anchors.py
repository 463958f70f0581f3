"""Anchor sampling and index-based attention masks for packed anchor blocks (paper §3.3, DESIGN §4).

Training packs every anchor block of a sequence into one dense query batch: the keys are the T
context positions followed by all blocks' own positions, and who-sees-whom is decided from indices:

  query in block a (anchor t_a) sees context key p   iff p < t_a and p is a real (non-pad) token
                                                     (and p >= t_a - W with a context window W)
  query in block a sees block key (a', j)            iff a' == a  (and j <= its own slot if causal)

so blocks never see each other and never see the anchor's own target state (position t_a), exactly
as at decode time, with no per-block copy of the context.
"""
from __future__ import annotations

import torch
from torch import Tensor


def eligible_anchors(loss_mask: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """bool [B, T]: t may anchor a block iff tokens t and t+1 are both supervised (and not padding)."""
    ok = loss_mask.bool()
    if attention_mask is not None:
        ok = ok & attention_mask.bool()
    out = torch.zeros_like(ok)
    out[:, :-1] = ok[:, :-1] & ok[:, 1:]
    return out


def sample_anchors(loss_mask: Tensor, attention_mask: Tensor | None, max_per_seq: int,
                   generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """Up to `max_per_seq` distinct eligible anchors per row, drawn without replacement with `generator`.

    Returns (anchors LongTensor [B, N], valid bool [B, N]) with anchors sorted per row; N is the largest
    count drawn in any row, and rows with fewer anchors are padded with position 0 and valid=False.
    """
    eligible = eligible_anchors(loss_mask, attention_mask).cpu()
    rows = []
    for row in eligible:
        idx = row.nonzero().flatten()
        if idx.numel() > max_per_seq:
            pick = torch.randperm(idx.numel(), generator=_cpu(generator))[:max_per_seq]
            idx = idx[pick].sort().values
        rows.append(idx)
    n = max((r.numel() for r in rows), default=0)
    anchors = torch.zeros(len(rows), n, dtype=torch.long)
    valid = torch.zeros(len(rows), n, dtype=torch.bool)
    for b, idx in enumerate(rows):
        anchors[b, :idx.numel()] = idx
        valid[b, :idx.numel()] = True
    return anchors.to(loss_mask.device), valid.to(loss_mask.device)


def all_anchors(loss_mask: Tensor, attention_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Dense training-time test: every position is an anchor slot. Returns (anchors [B, T] = 0..T-1 in
    every row, valid = eligible_anchors [B, T]); anchor index n is position n (drafters rely on this)."""
    valid = eligible_anchors(loss_mask, attention_mask)
    anchors = torch.arange(valid.shape[1], device=valid.device).expand_as(valid)
    return anchors, valid


def is_dense(anchors: Tensor) -> bool:
    """True iff `anchors` is the all_anchors layout (row b, slot n holds position n, N = T)."""
    return bool((anchors == torch.arange(anchors.shape[1], device=anchors.device)).all())


def _cpu(generator: torch.Generator | None) -> torch.Generator | None:
    if generator is None or generator.device.type == "cpu":
        return generator
    raise ValueError("sample_anchors needs a CPU torch.Generator (anchors are drawn on the CPU)")


def block_layout(num_blocks: int, block_len: int, device=None) -> tuple[Tensor, Tensor]:
    """Block id and slot of each packed position: ([N*L], [N*L]) for blocks laid out one after another."""
    ids = torch.arange(num_blocks * block_len, device=device)
    return ids // block_len, ids % block_len


def block_positions(anchors: Tensor, block_len: int, offset: int = 0) -> Tensor:
    """RoPE positions [B, N*L] of the packed blocks: slot j of the block anchored at t sits at t + offset + j."""
    slots = torch.arange(block_len, device=anchors.device) + offset
    return (anchors.unsqueeze(-1) + slots).flatten(1)


def packed_mask(anchors: Tensor, ctx_valid: Tensor, q_block: Tensor, q_slot: Tensor,
                k_block: Tensor, k_slot: Tensor, causal: bool = False, window: int | None = None,
                ctx_start: int = 0) -> Tensor:
    """bool [B, 1, Sq, T + Sk] (True = may attend) for queries (q_block, q_slot) over the T context keys
    (positions ctx_start .. ctx_start+T-1) followed by block keys (k_block, k_slot); see the module docstring
    for the rule. `window`: a block anchored at t sees only the context t-window .. t-1."""
    T = ctx_valid.shape[1]
    q_anchor = anchors[:, q_block].unsqueeze(-1)  # [B, Sq, 1]
    pos = torch.arange(ctx_start, ctx_start + T, device=anchors.device)
    ctx = pos < q_anchor  # strictly before the anchor
    if window is not None:
        ctx = ctx & (pos >= q_anchor - window)
    ctx = ctx & ctx_valid.bool().unsqueeze(1)
    own = q_block.unsqueeze(-1) == k_block.unsqueeze(0)  # [Sq, Sk]: same block only
    if causal:
        own = own & (k_slot.unsqueeze(0) <= q_slot.unsqueeze(-1))
    own = own.unsqueeze(0).expand(anchors.shape[0], -1, -1)
    return torch.cat([ctx, own], dim=-1).unsqueeze(1)


def block_mask(anchors: Tensor, ctx_valid: Tensor, block_len: int, causal: bool = False) -> Tensor:
    """Mask for N blocks of `block_len` packed queries each: bool [B, 1, N*L, T + N*L]."""
    blk, slot = block_layout(anchors.shape[1], block_len, anchors.device)
    return packed_mask(anchors, ctx_valid, blk, slot, blk, slot, causal)
