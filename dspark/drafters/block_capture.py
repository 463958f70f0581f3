"""A block drafter's (DFlash, DSpark) passes for any set of requests captured as static-shape graphs over the
drafter's slot store (`draft_slots`): the backbone over each request's anchor block (`hidden`) and the context
update with newly verified positions (`extend`). With DSpark's captured γ-loop (`chain_capture`), a drafting round
of R requests is then three graph replays (CUDA graphs on a GPU) instead of ~1,160 eager aten calls at one
request, ~1,360 at four (counted by benchmarks/draft_step.py --requests).

Nothing in a graph depends on the requests' lengths or slots as Python values:
- rows are the requests' slots, picked by a device tensor of slot ids; the rows are padded to a power of two by
  repeating the last request (a padding row reads what it reads, and writes exactly what that request writes);
- `hidden` reads the first W columns of each row, W a power of two >= the longest length (the decoding core's
  `window_bucket`), under a key mask built on the device from the lengths: column j of row r is visible iff
  j < length_r (and j >= length_r - context_window with a window), then the block's own L keys. With a context
  window and a length past its bucket S (`window_bucket(context_window)`), every row reads only the S columns
  before its length (its first S if shorter; gathered by a device-built index), so a pass costs the window, not
  the context, whatever the batch mixes;
- `extend` writes n_r new positions at columns length_r.. of row r, padded to a power of two (at most MAX_NEW;
  longer updates, i.e. prompts, run eager): padding columns hold stale finite values that no pass sees.
Graphs: one per (rows, window, new-token bucket, store capacity), and one gathered per context-window bucket.
Invariant: row r of `hidden` is `DFlashDrafter.block_hidden` of request r (masked keys weigh nothing) and the
first `length` columns of a slot are what eager `extend_context` appends, up to float rounding (sums over other
counts of terms). Where a capture fails the drafter warns once and runs these same functions eager from then on.
"""
from __future__ import annotations

import torch
from torch import Tensor

from dspark.decoding.static_core import token_bucket, window_bucket
from dspark.drafters import chain_capture, draft_slots

MAX_NEW = 64  # context updates longer than this (prompts) run eager


def _hidden(drafter, keys: list[Tensor], values: list[Tensor], slots: Tensor, window: int, lengths: Tensor,
            anchors: Tensor, gather: bool = False) -> Tensor:
    """Final-normed hidden states [R, L, d] of the blocks anchored at positions `lengths` ([R]) of rows `slots`
    ([R]) of the store ([S, KV, capacity, hd] per layer), over each row's first `window` columns, or with `gather`
    over the `window` columns just before its length (the first `window` for a shorter row)."""
    L, device = drafter.block_len, anchors.device
    if gather:  # columns length-W .. length-1 (0 .. W-1 for a shorter row); the keys carry their positions (RoPE)
        columns = (lengths[:, None] - window).clamp(min=0) + torch.arange(window, device=device)  # [R, W]
        context = [(k[slots[:, None], :, columns].transpose(1, 2), v[slots[:, None], :, columns].transpose(1, 2))
                   for k, v in zip(keys, values)]
    else:
        columns = torch.arange(window, device=device).expand(len(slots), window)
        context = [(k[slots, :, :window], v[slots, :, :window]) for k, v in zip(keys, values)]
    visible = columns < lengths[:, None]
    if drafter.config.context_window:
        visible = visible & (columns >= lengths[:, None] - drafter.config.context_window)
    mask = torch.cat([visible, visible.new_ones(len(slots), L)], 1)[:, None, None, :]  # [R, 1, 1, W + L]
    positions = lengths[:, None] + torch.arange(L, device=device)  # [R, L]
    return drafter.run_blocks(drafter.block_inputs(anchors), positions, context, mask)


def _extend(drafter, keys: list[Tensor], values: list[Tensor], slots: Tensor, features: Tensor,
            starts: Tensor) -> None:
    """Write the context K/V of features [R, n, m*d] (row r at positions starts[r]..) into columns starts[r]..
    of slot slots[r] of every layer's store, in place."""
    columns = starts[:, None] + torch.arange(features.shape[1], device=starts.device)  # [R, n]
    h_ctx = drafter.context_states(features)  # [R, n, d]
    cos, sin = drafter.rotary(columns)
    for layer, k_buf, v_buf in zip(drafter.layers, keys, values):
        k, v = layer.context_kv(h_ctx, cos, sin)  # [R, KV, n, hd]
        k_buf[slots[:, None], :, columns] = k.transpose(1, 2).to(k_buf.dtype)  # entries [R, n, KV, hd]
        v_buf[slots[:, None], :, columns] = v.transpose(1, 2).to(v_buf.dtype)


def hidden(drafter, states, anchors: Tensor) -> Tensor:
    """`blocks_hidden` of the states ([R, L, d]) through the captured backbone pass."""
    span = window_bucket(drafter.config.context_window) if drafter.config.context_window else None
    lengths = [s.length for s in states]
    gather = span is not None and max(lengths) > span  # a window far behind: every row reads only its bucket
    window = span if gather else window_bucket(max(lengths))
    slots, lengths_t, real = draft_slots.padded_rows(drafter, states, lengths)
    store = draft_slots.store_of(drafter)
    store.reserve(window)
    anchors = chain_capture.pad_rows(anchors.reshape(-1).to(drafter.device), len(slots))
    out = chain_capture.call_captured(drafter, _hidden, store.keys, store.values, slots, window, lengths_t, anchors,
                                      gather)[:real]
    return out.clone() if drafter.device.type == "cuda" else out  # a CUDA graph's output is overwritten next replay


def extend(drafter, states, features: list[Tensor]) -> None:
    """`extend_contexts` of the states, each with n_r <= MAX_NEW positions (features[r] [n_r, m*d]), through the
    captured context update."""
    counts = [int(f.shape[0]) for f in features]
    bucket = token_bucket(max(counts))
    slots, starts, _ = draft_slots.padded_rows(drafter, states, [s.length for s in states])
    padded = draft_slots.last_repeated(torch.stack([chain_capture.pad_rows(f.to(drafter.device), bucket)
                                                    for f in features]), len(slots))  # [rows, n, m*d]
    store = draft_slots.store_of(drafter)
    store.reserve(max(s.length for s in states) + bucket)
    chain_capture.call_captured(drafter, _extend, store.keys, store.values, slots, padded, starts)
    for state, n in zip(states, counts):
        for buf in state.kv:
            buf.length += n
        state.length += n
