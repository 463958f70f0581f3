"""Eagle3's passes for one request captured as static-shape graphs: the context update (`extend_captured`) and the
γ autoregressive steps with their sampling (`draft_captured`), over the request's own K/V buffer,
preallocated in chunks (`reserved_buffers`).
A batch-1 drafting round is then two graph replays (CUDA graphs on a GPU) instead of γ layer passes of eager
operators and a host-side draw per position (counted by benchmarks/draft_step.py --drafter untrained-eagle3).

Nothing in a graph depends on the request's length as a Python value: the steps read the first W columns of the
buffer, W a power of two >= length (`window_bucket`), under a key mask built on the device from the length (a
1-element tensor), then the block's own earlier steps; a context update writes n positions padded to a power of
two (at most `block_capture.MAX_NEW`; prompts run eager) at columns length.. — padding columns lie past the length,
where no step looks. Every draw is made before the loop (`chain_capture.capturable`: uniforms, keyed noise).
Invariant: the same K/V columns, tokens and probabilities as eager `extend_context` / `draft_batch` given the
same uniforms and noise (`Eagle3Drafter.draft_steps` is the eager loop itself, traced), up to float rounding. Where a
capture fails the drafter warns once and runs these same functions eager from then on.
"""
from __future__ import annotations

import torch
from torch import Tensor

from dspark.decoding.sampling import SamplingParams, to_probs
from dspark.decoding.static_core import token_bucket, window_bucket
from dspark.drafters import block_capture, chain_capture


def _context_update(drafter, keys: list[Tensor], values: list[Tensor], features: Tensor, token_ids: Tensor,
                    first: Tensor, start: Tensor) -> Tensor:
    """Write the entries of positions start.. (features [n, m*d], token_ids [n]; first [d]: the fused feature of
    position start-1, zeros at 0) into columns start.. of the buffer, in place; the fused features [n, d]."""
    fused = drafter.fused(features)
    x, _ = drafter.midlayer.inputs(drafter.embed(token_ids), torch.cat([first[None], fused[:-1]]))
    columns = start + torch.arange(features.shape[0], device=start.device)
    k, v = drafter.midlayer.self_attn.keys_values(x[None], *drafter.rotary(columns))  # [1, KV, n, hd]
    keys[0][:, columns] = k[0].to(keys[0].dtype)
    values[0][:, columns] = v[0].to(values[0].dtype)
    return fused


def _draft_steps(drafter, keys: list[Tensor], values: list[Tensor], window: int, length: Tensor, anchor: Tensor,
                 hidden: Tensor, uniforms: Tensor, params: chain_capture.ChainParams, noise: Tensor | None,
                 keyed: Tensor | None) -> tuple[Tensor, Tensor]:
    """(tokens [1, G], probs [1, G, N]) of the block anchored at position `length` (tensor [1]): the steps attend
    to the buffer's first `window` columns, those before `length` visible."""
    visible = (torch.arange(window, device=length.device) < length)[None]  # [1, W]
    return drafter.draft_steps(keys[0][None, :, :window], values[0][None, :, :window], visible, hidden, anchor,
                               length[:, None], uniforms.shape[1], lambda logits: to_probs(logits, params),
                               chain_capture.drawn_ahead(uniforms, noise, keyed))


def reserved_buffers(drafter, state, columns: int) -> tuple[list[Tensor], list[Tensor]]:
    """The state's own K/V buffers (Eagle3 drafts one request per graph, on per-request buffers), per layer,
    holding at least `columns` columns (grown in chunks of block_capture.CHUNK)."""
    c = drafter.config
    like = torch.empty(c.num_kv_heads, 0, c.head_dim, device=drafter.device, dtype=drafter.dtype)
    for buf in state.kv:
        buf.reserve(columns, like, block_capture.CHUNK)
        if drafter.device.type == "cuda":  # CUDA graphs then read and write the buffers in place
            from torch._dynamo import mark_static_address

            mark_static_address(buf.k)
            mark_static_address(buf.v)
    return [buf.k for buf in state.kv], [buf.v for buf in state.kv]


def extend_captured(drafter, state, features: Tensor, token_ids: Tensor) -> None:
    """`extend_context` of one state with n <= MAX_NEW positions through the captured update."""
    n, device = features.shape[0], drafter.device
    bucket = token_bucket(n)
    features, token_ids = (chain_capture.pad_rows(t.to(device), bucket) for t in (features, token_ids))
    keys, values = reserved_buffers(drafter, state, state.length + bucket)
    fused = chain_capture.call_captured(drafter, _context_update, keys, values, features, token_ids,
                                        drafter.fused_before(state), torch.tensor([state.length], device=device))
    state.last_fused = fused[n - 1].clone()  # a CUDA graph's output is overwritten by its next replay
    state.kv[0].length += n
    state.length += n


def draft_captured(drafter, state, anchors: Tensor, draws, sp: SamplingParams) -> tuple[Tensor, Tensor]:
    """(tokens [1, γ], probs [1, γ, N]) of one request's block through the captured steps; draws: a `capturable`
    BlockDraws (its keyed row's cursor advances)."""
    device = drafter.device
    window = window_bucket(state.length)
    keys, values = reserved_buffers(drafter, state, window)
    noise, keyed = chain_capture.keyed_tables(draws, 1, drafter.draft_vocab_size, device)
    length = torch.tensor([state.length], device=device)
    out = chain_capture.call_captured(drafter, _draft_steps, keys, values, window, length,
                                      anchors.reshape(1).to(device), drafter.fused_before(state).reshape(1, 1, -1),
                                      draws.uniforms.to(device), chain_capture.ChainParams.of(sp), noise, keyed)
    return tuple(t.clone() for t in out) if device.type == "cuda" else out
