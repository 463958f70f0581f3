"""Packed anchor blocks attended chunk by chunk: no [N·Lq × (T + N·Lk)] mask, no scores for keys no query sees.

Training packs N anchor blocks of a sequence (dspark/drafters/anchors.py). The rule (`packed_mask`): a query
of block a sees the real context keys p < t_a and every key of its own block, nothing of another block.
The dense form scores each query against all T + N·Lk keys, of which at most t_a + Lk are visible, and
holds a bool mask of that size (recipe shapes: 2,040 queries × 2,296 keys per sequence).

Here the blocks are taken C at a time, in anchor order. A chunk's queries score only
  - the context keys 0 .. T_c - 1, T_c = the chunk's largest anchor (no query of the chunk sees later ones),
  - the chunk's own C·Lk block keys,
with the chunk's small mask built by the same rule (`packed_mask`). Invariant: equal to the dense form,
because the keys dropped from a chunk are masked for every one of its queries, and softmax over the
visible keys does not change when fully masked keys are removed. Memory per chunk: C·Lq·(T_c + C·Lk).
With a context window W the chunk's context starts at S_c = (its smallest anchor) - W: memory
C·Lq·(T_c - S_c + C·Lk), independent of the sequence length when the chunk's anchors are close.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from dspark.drafters.anchors import packed_mask

OWN_KEYS_PER_CHUNK = 128  # own-block keys scored per query: C·Lk (only Lk of them are the query's own block)
MAX_CHUNKS = 32  # fewer, larger chunks when N is large (kernel launches stay bounded)


@dataclass(frozen=True)
class BlockChunk:
    first: int  # blocks first .. end-1
    end: int
    context: int  # context keys start .. context-1 are scored
    mask: Tensor  # bool [B, 1, (end-first)·Lq, context - start + (end-first)·Lk]
    start: int = 0


@dataclass(frozen=True)
class BlockLayout:
    """Who-sees-whom for N packed blocks of Lq queries and Lk keys each, built once per forward (all layers)."""
    chunks: tuple[BlockChunk, ...]
    q_per_block: int
    k_per_block: int

    @classmethod
    def build(cls, anchors: Tensor, ctx_valid: Tensor, q_per_block: int, k_per_block: int,
              own_keys_per_chunk: int = OWN_KEYS_PER_CHUNK, max_chunks: int = MAX_CHUNKS,
              window: int | None = None) -> BlockLayout:
        """anchors [B, N] (sorted per row; padded slots anywhere), ctx_valid [B, T]; `window`: each block
        sees only the context window before its anchor. One host read of the chunks' anchor bounds."""
        B, N = anchors.shape
        size = max(1, own_keys_per_chunk // k_per_block, math.ceil(N / max_chunks))
        starts = list(range(0, N, size))
        padded = torch.nn.functional.pad(anchors, (0, len(starts) * size - N)).view(B, len(starts), size)
        contexts = padded.amax(dim=(0, 2)).tolist() if N else []
        lows = [0] * len(starts)
        if N and window is not None:  # the tail's filler must not lower the last chunk's smallest anchor
            filler = torch.nn.functional.pad(anchors, (0, len(starts) * size - N), value=int(anchors.max()))
            lows = filler.view(B, len(starts), size).amin(dim=(0, 2)).tolist()
        chunks = []
        for first, context, low in zip(starts, contexts, lows):
            end = min(first + size, N)
            start = min(max(0, int(low) - window), int(context)) if window is not None else 0
            chunks.append(BlockChunk(first, end, int(context), _chunk_mask(
                anchors[:, first:end], ctx_valid[:, start:context], q_per_block, k_per_block, window, start), start))
        return cls(tuple(chunks), q_per_block, k_per_block)


def _chunk_mask(anchors: Tensor, ctx_valid: Tensor, q_per_block: int, k_per_block: int,
                window: int | None = None, ctx_start: int = 0) -> Tensor:
    """The packed rule for one chunk: queries and keys laid out block-major (block c: slots 0..L-1)."""
    blocks = torch.arange(anchors.shape[1], device=anchors.device)
    q_block, k_block = blocks.repeat_interleave(q_per_block), blocks.repeat_interleave(k_per_block)
    return packed_mask(anchors, ctx_valid, q_block, torch.zeros_like(q_block), k_block, torch.zeros_like(k_block),
                       window=window, ctx_start=ctx_start)


def attend_chunks(q: Tensor, ctx_k: Tensor, ctx_v: Tensor, blk_k: Tensor, blk_v: Tensor, layout: BlockLayout,
                  enable_gqa: bool) -> Tensor:
    """q [B, H, N·Lq, hd]; ctx_k/v [B, KV, T, hd]; blk_k/v [B, KV, N·Lk, hd] (block-major) -> [B, H, N·Lq, hd]."""
    Lq, Lk, outs = layout.q_per_block, layout.k_per_block, []
    for chunk in layout.chunks:
        k = torch.cat([ctx_k[..., chunk.start:chunk.context, :], blk_k[..., chunk.first * Lk:chunk.end * Lk, :]], -2)
        v = torch.cat([ctx_v[..., chunk.start:chunk.context, :], blk_v[..., chunk.first * Lk:chunk.end * Lk, :]], -2)
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            q[..., chunk.first * Lq:chunk.end * Lq, :], k, v, attn_mask=chunk.mask, enable_gqa=enable_gqa))
    return torch.cat(outs, dim=-2)
