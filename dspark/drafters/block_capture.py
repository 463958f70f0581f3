"""A block drafter's (DFlash, DSpark) passes for one request captured as static-shape graphs: the backbone over
the anchor's block (`hidden`) and the context update with newly verified positions (`extend`). With DSpark's
captured γ-loop (`chain_capture`), a batch-1 drafting round is then three graph replays (CUDA graphs on a GPU)
instead of ~2,000 eager operators (counted by benchmarks/draft_step.py).

Nothing in a graph depends on the request's length as a Python value:
- the state's K/V buffers are preallocated in chunks of CHUNK columns (`KVBuffer.reserve`);
- `hidden` reads the first W columns, W a power of two >= length (the decoding core's `window_bucket`), under a
  key mask built on the device from the length (a 1-element tensor): column j is visible iff j < length (and
  j >= length - context_window with a window), then the block's own L keys. With a context window and a length
  past its bucket S (`window_bucket(context_window)`), it reads only the S columns before the length (gathered
  by a device-built index), so a pass costs the window, not the context;
- `extend` writes n new positions at columns length.., padded to a power of two (at most MAX_NEW; longer
  updates, i.e. prompts, run eager): padding columns hold stale finite values that no pass sees (j >= length).
Graphs: one per (window, new-token bucket, buffer capacity), and one gathered per context-window bucket.
Invariant: `hidden` is `DFlashDrafter.block_hidden` (masked keys weigh nothing) and the buffers' first `length`
columns are what eager `extend_context` appends, up to float rounding (sums over other counts of terms). Where a
capture fails the drafter warns once and runs these same functions eager from then on.
"""
from __future__ import annotations

import torch
from torch import Tensor

from dspark.decoding.static_core import token_bucket, window_bucket
from dspark.drafters import chain_capture

CHUNK = 1024  # K/V columns a captured state's buffers grow by (a growth retraces: rare)
MAX_NEW = 64  # context updates longer than this (prompts) run eager


def _hidden(drafter, keys: list[Tensor], values: list[Tensor], window: int, length: Tensor, anchor: Tensor,
            gather: bool = False) -> Tensor:
    """Final-normed hidden states [1, L, d] of the block anchored at position `length` (tensor [1]) over the first
    `window` columns of the buffers ([KV, capacity, hd] per layer), or with `gather` over the `window` columns
    just before `length` (length >= window)."""
    L, device = drafter.block_len, anchor.device
    if gather:  # columns length-W .. length-1: all held; the keys carry their own positions (RoPE at insert)
        columns = length - window + torch.arange(window, device=device)
        context = [(k[None, :, columns], v[None, :, columns]) for k, v in zip(keys, values)]
    else:
        columns = torch.arange(window, device=device)
        context = [(k[None, :, :window], v[None, :, :window]) for k, v in zip(keys, values)]
    visible = columns < length
    if drafter.config.context_window:
        visible = visible & (columns >= length - drafter.config.context_window)
    mask = torch.cat([visible, visible.new_ones(L)])[None, None, None, :]  # [1, 1, 1, W + L]: context, then block
    positions = length[:, None] + torch.arange(L, device=device)  # [1, L]
    return drafter.run_blocks(drafter.block_inputs(anchor), positions, context, mask)


def _extend(drafter, keys: list[Tensor], values: list[Tensor], features: Tensor, start: Tensor) -> None:
    """Write the context K/V of features [n, m*d] (positions start.., start a tensor [1]) into columns start..
    of every layer's buffers, in place."""
    columns = start + torch.arange(features.shape[0], device=start.device)  # [n]
    h_ctx = drafter.context_states(features).unsqueeze(0)  # [1, n, d]
    cos, sin = drafter.rotary(columns)
    for layer, k_buf, v_buf in zip(drafter.layers, keys, values):
        k, v = layer.context_kv(h_ctx, cos, sin)  # [1, KV, n, hd]
        k_buf[:, columns] = k[0].to(k_buf.dtype)
        v_buf[:, columns] = v[0].to(v_buf.dtype)


def reserved_buffers(drafter, state, columns: int) -> tuple[list[Tensor], list[Tensor]]:
    """The state's K/V buffers, per layer, holding at least `columns` columns (grown in chunks of CHUNK)."""
    c = drafter.config
    like = torch.empty(c.num_kv_heads, 0, c.head_dim, device=drafter.device, dtype=drafter.dtype)
    for buf in state.kv:
        buf.reserve(columns, like, CHUNK)
        if drafter.device.type == "cuda":  # CUDA graphs then read and write the buffers in place
            from torch._dynamo import mark_static_address

            mark_static_address(buf.k)
            mark_static_address(buf.v)
    return [buf.k for buf in state.kv], [buf.v for buf in state.kv]


def hidden(drafter, state, anchors: Tensor) -> Tensor:
    """`blocks_hidden` of one state ([1, L, d]) through the captured backbone pass."""
    span = window_bucket(drafter.config.context_window) if drafter.config.context_window else None
    gather = span is not None and state.length > span  # a window far behind: read only its bucket
    window = span if gather else window_bucket(state.length)
    keys, values = reserved_buffers(drafter, state, state.length if gather else window)
    length = torch.tensor([state.length], device=drafter.device)
    anchor = anchors.reshape(1).to(drafter.device)
    out = chain_capture.call_captured(drafter, _hidden, keys, values, window, length, anchor, gather)
    return out.clone() if drafter.device.type == "cuda" else out  # a CUDA graph's output is overwritten next replay


def extend(drafter, state, features: Tensor) -> None:
    """`extend_context` of one state with n <= MAX_NEW positions through the captured context update."""
    n = features.shape[0]
    bucket = token_bucket(n)
    padded = chain_capture.pad_rows(features.to(drafter.device), bucket)
    keys, values = reserved_buffers(drafter, state, state.length + bucket)
    start = torch.tensor([state.length], device=drafter.device)
    chain_capture.call_captured(drafter, _extend, keys, values, padded, start)
    for buf in state.kv:
        buf.length += n
    state.length += n

