"""Eagle3's passes for any set of requests captured as static-shape graphs over the drafter's slot store
(`draft_slots`, as DSpark's and DFlash's): the context update (`extend_captured`) and the γ autoregressive steps
with their sampling (`draft_captured`). A drafting round is then two graph replays (CUDA graphs on a GPU) instead
of γ layer passes of eager operators and a host-side draw per position (counted by benchmarks/draft_step.py
--drafter untrained-eagle3).

Nothing in a graph depends on the requests' lengths or slots as Python values: rows are slots picked by a device
tensor (padded to a power of two by repeating the last request); the steps read each row's first W columns, W a
power of two >= the longest length (`window_bucket`), under a key mask built on the device from the lengths, then
the block's own earlier steps; a context update writes n_r positions padded to a power of two (at most
`block_capture.MAX_NEW`; prompts run eager) at columns length_r.. — padding columns lie past the length, where no
step looks. Every draw is made before the loop (`chain_capture.capturable`: uniforms, keyed noise).
Invariant: the same K/V columns, tokens and probabilities as eager `extend_context` / `draft_batch` given the
same uniforms and noise (`Eagle3Drafter.draft_steps` is the eager loop itself, traced), up to float rounding. Where a
capture fails the drafter warns once and runs these same functions eager from then on.
"""
from __future__ import annotations

import torch
from torch import Tensor

from dspark.decoding.sampling import SamplingParams, to_probs
from dspark.decoding.static_core import token_bucket, window_bucket
from dspark.drafters import chain_capture, draft_slots


def _context_update(drafter, keys: list[Tensor], values: list[Tensor], slots: Tensor, features: Tensor,
                    token_ids: Tensor, first: Tensor, starts: Tensor) -> Tensor:
    """Write the entries of row r's positions starts[r].. (features [R, n, m*d], token_ids [R, n]; first [R, d]: the
    fused feature of position starts[r]-1, zeros at 0) into columns starts[r].. of slot slots[r], in place; the
    fused features [R, n, d]."""
    fused = drafter.fused(features)
    x, _ = drafter.midlayer.inputs(drafter.embed(token_ids), torch.cat([first[:, None], fused[:, :-1]], 1))
    columns = starts[:, None] + torch.arange(features.shape[1], device=starts.device)  # [R, n]
    k, v = drafter.midlayer.self_attn.keys_values(x, *drafter.rotary(columns))  # [R, KV, n, hd]
    keys[0][slots[:, None], :, columns] = k.transpose(1, 2).to(keys[0].dtype)
    values[0][slots[:, None], :, columns] = v.transpose(1, 2).to(values[0].dtype)
    return fused


def _draft_steps(drafter, keys: list[Tensor], values: list[Tensor], slots: Tensor, window: int, lengths: Tensor,
                 anchors: Tensor, hidden: Tensor, uniforms: Tensor, params: chain_capture.ChainParams,
                 noise: Tensor | None, keyed: Tensor | None) -> tuple[Tensor, Tensor]:
    """(tokens [R, G], probs [R, G, N]) of the blocks anchored at positions `lengths` ([R]) of rows `slots`: the
    steps attend to each row's first `window` columns, those before its length visible."""
    visible = torch.arange(window, device=lengths.device) < lengths[:, None]  # [R, W]
    return drafter.draft_steps(keys[0][slots, :, :window], values[0][slots, :, :window], visible, hidden, anchors,
                               lengths[:, None], uniforms.shape[1], lambda logits: to_probs(logits, params),
                               chain_capture.drawn_ahead(uniforms, noise, keyed))


def _fused_before(drafter, states, count: int) -> Tensor:
    return draft_slots.last_repeated(torch.stack([drafter.fused_before(s) for s in states]), count)  # [count, d]


def extend_captured(drafter, states, features: list[Tensor], token_ids: list[Tensor]) -> None:
    """`extend_context` of the states, each with n_r <= MAX_NEW positions, through the captured update."""
    device, counts = drafter.device, [int(f.shape[0]) for f in features]
    bucket = token_bucket(max(counts))
    slots, starts, _ = draft_slots.padded_rows(drafter, states, [s.length for s in states])
    padded = [draft_slots.last_repeated(torch.stack([chain_capture.pad_rows(t.to(device), bucket) for t in rows]),
                                        len(slots)) for rows in (features, token_ids)]
    store = draft_slots.store_of(drafter)
    store.reserve(max(s.length for s in states) + bucket)
    fused = chain_capture.call_captured(drafter, _context_update, store.keys, store.values, slots, *padded,
                                        _fused_before(drafter, states, len(slots)), starts)
    for r, (state, n) in enumerate(zip(states, counts)):
        state.last_fused = fused[r, n - 1].clone()  # a CUDA graph's output is overwritten by its next replay
        state.kv[0].length += n
        state.length += n


def draft_captured(drafter, states, anchors: Tensor, draws, sp: SamplingParams) -> tuple[Tensor, Tensor]:
    """(tokens [R, γ], probs [R, γ, N]) of the requests' blocks through the captured steps; draws: a `capturable`
    BlockDraws (its keyed rows' cursors advance)."""
    device = drafter.device
    window = window_bucket(max(s.length for s in states))
    slots, lengths, real = draft_slots.padded_rows(drafter, states, [s.length for s in states])
    store = draft_slots.store_of(drafter)
    store.reserve(window)
    noise, keyed = chain_capture.keyed_tables(draws, len(slots), drafter.draft_vocab_size, device)
    pad = lambda t: chain_capture.pad_rows(t.to(device), len(slots))  # noqa: E731
    out = chain_capture.call_captured(drafter, _draft_steps, store.keys, store.values, slots, window, lengths,
                                      pad(anchors.reshape(-1)), _fused_before(drafter, states, len(slots))[:, None],
                                      pad(draws.uniforms), chain_capture.ChainParams.of(sp), noise, keyed)
    return tuple(t[:real].clone() if device.type == "cuda" else t[:real] for t in out)
