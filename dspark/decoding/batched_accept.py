"""The rejection step of a whole verify step: every chain row's accepted prefix and next token, on an accelerator
from one batched computation and one host copy (paper §2.1; `accept_drafts` is the same rule row by row); the
keyed rows of seeded requests likewise with one host copy (`accept_keyed_rows`, as `accept_keyed` per row).

Row r verified n_r drafts x_{r,1..n_r}, drawn from q_{r,1..n_r}, against target rows p_{r,0..n_r} (row n_r:
the bonus distribution). Rows are padded to G = max n_r; a padded position is never accepted.

Invariant: a row's (n_accepted, next_token) is exactly what `accept_drafts` returns for it with the same
generator. Its stream is consumed the same way — n_r float32 uniforms for the accept tests, then one float64
uniform for the next token, drawn on the generator's own device — so a request's tokens do not depend on
the rows beside it, and batching the rule changes no output.
"""
from __future__ import annotations

from itertools import accumulate
from typing import Sequence

import numpy as np
import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from dspark.decoding.counter_random import all_counter_streams, on_device, round_down, stream_table, uniform_rows
from dspark.decoding.sampling import (KeyedNoise, accept_drafts, check_accept_shapes, inverse_cdf, prefetch_noise,
                                     residual_weights)


def acceptance_uniforms(generators: Sequence, lengths: Sequence[int], device) -> tuple[Tensor, Tensor]:
    """Per row: n_r accept uniforms (float32, padded with 1: never below a probability ratio's bar) and one
    next-token uniform (float64), in `accept_drafts`' order (counter streams: every row in one host hash and
    one copy; generators: a call per row)."""
    if all_counter_streams(generators):
        width = max(lengths)
        table = stream_table(generators, [n + 1 for n in lengths], width + 1, fill=1.0)  # row r: n_r, then next
        rows, n = np.arange(len(lengths)), np.asarray(lengths)
        table[:, width] = table[rows, n]  # the next-token draw to the last column, its place back to the padding
        short = n < width
        table[rows[short], n[short]] = 1.0
        table[:, :width] = round_down(table[:, :width], torch.float32)
        both = on_device(table, device)
        return both[:, :width].float(), both[:, width:]
    streams = [g for g in generators for _ in range(2)]
    counts = [c for n in lengths for c in (n, 1)]
    drawn = uniform_rows(streams, counts, device, [torch.float32, torch.float64] * len(lengths))
    return pad_sequence(drawn[0::2], batch_first=True, padding_value=1.0), torch.stack(drawn[1::2])


def accept_rows(drafts: Sequence[Tensor], draft_probs: Sequence[Tensor], target_probs: Sequence[Tensor],
                generators: Sequence[torch.Generator | None],
                batched: bool | None = None) -> list[tuple[int, int] | Exception]:
    """Per row r: drafts[r] [n_r], draft_probs[r] [n_r, V], target_probs[r] [n_r + 1, V] (same device),
    generators[r] its request's stream -> (n_accepted, next_token) per row, or the exception its row raised
    (one bad row fails alone). batched: one computation and one host copy for all rows (if it raises, the rows
    are redone one by one to find the bad one); else `accept_drafts` row by row. None: by device — row by row
    on a CPU, where host reads cost nothing and a row's distributions stay in cache (batched measured ~2x
    slower there: benchmarks/results/accept_rows/), batched on an accelerator, where each read-back waits."""
    if not drafts:
        return []
    if batched if batched is not None else target_probs[0].device.type != "cpu":
        states = [(g, g.get_state()) for g in {id(g): g for g in generators if g is not None}.values()]
        try:
            return _accept_batched(drafts, draft_probs, target_probs, generators)
        except Exception:  # noqa: BLE001 — a bad row: row by row below, so that only it fails, every stream
            for g, state in states:  # rewound first, so the good rows draw what they would have drawn alone
                g.set_state(state)
    return [_row_or_error(x, q, p, g) for x, q, p, g in zip(drafts, draft_probs, target_probs, generators)]


def _row_or_error(x: Tensor, q: Tensor, p: Tensor, g) -> tuple[int, int] | Exception:
    try:
        return accept_drafts(x, q, p, g)
    except Exception as err:  # noqa: BLE001 — returned: the caller fails this row only
        return err


def _accept_batched(drafts, draft_probs, target_probs, generators) -> list[tuple[int, int]]:
    """`accept_rows` batched: every row at once, one host read (the `.tolist()` at the end)."""
    lengths = [int(d.shape[0]) for d in drafts]
    for n, q, p in zip(lengths, draft_probs, target_probs):
        check_accept_shapes(n, q, p)
    device = target_probs[0].device
    u, u_next = acceptance_uniforms(generators, lengths, device)
    # p(x) and q(x) of every draft, gathered row by row (no copy of a distribution), padded to [R, G]
    p_x = pad_sequence([p[torch.arange(n, device=device), x] for p, x, n in zip(target_probs, drafts, lengths)],
                       batch_first=True)
    q_x = pad_sequence([q[torch.arange(n, device=device), x] for q, x, n in zip(draft_probs, drafts, lengths)],
                       batch_first=True)
    live = pad_sequence([torch.ones(n, dtype=torch.bool, device=device) for n in lengths], batch_first=True)
    accepted = (u[:, :p_x.shape[1]] * q_x < p_x) & live               # P(u < p/q) = min(1, p/q)
    n_acc = accepted.long().cumprod(1).sum(1)                         # [R]: the accepted prefix's length
    full = n_acc == live.sum(1)
    # next token: at the first rejection from `residual_weights(p, q)`; after a full accept q is zeroed, so that is
    # p itself: the bonus row. Row r's distributions at n_acc[r] are picked on the device (index_select: no
    # read-back); per row the same numbers as `accept_drafts`, so the same token (inverse_cdf's cumulative sum
    # runs along each row alone).
    at = n_acc[:, None]
    target_at = torch.cat([p.index_select(0, at[r]) for r, p in enumerate(target_probs)])             # [R, V]
    draft_at = torch.cat([q.index_select(0, at[r].clamp_max(n - 1)) if n else target_at.new_zeros(1, q.shape[-1])
                          for r, (q, n) in enumerate(zip(draft_probs, lengths))]) * ~full[:, None]
    next_token = inverse_cdf(residual_weights(target_at, draft_at), u_next)
    return [tuple(pair) for pair in torch.stack([n_acc, next_token], 1).tolist()]


def accept_keyed_rows(drafts: Sequence[Sequence[int]], target_probs: Sequence[Tensor], noises: Sequence[KeyedNoise],
                      positions: Sequence[int]) -> list[tuple[int, int] | Exception]:
    """`accept_keyed` for every keyed chain row of a step with ONE host read: per row r the target's Gumbel-max
    tokens at output positions positions[r] .. + n_r (on the device; target_probs[r] [n_r + 1, V]), read back
    together and compared on the host with the drafts (host ints: the drafter's tokens are there already).
    Per row exactly `accept_keyed`'s (n_accepted, next_token), or the exception its row raised (it fails alone)."""
    try:  # every row's missing noise in one call (usually the bonus positions: the drafts' were made drafting)
        prefetch_noise([(noise, p) for x, noise, at in zip(drafts, noises, positions)
                        for p in range(at, at + len(x) + 1)])
    except Exception:  # noqa: BLE001 — each row then makes its own noise below, and a bad one fails alone
        pass
    picked = []  # per row: its tokens [n_r + 1] on the device, or its error
    for x, p, noise, at in zip(drafts, target_probs, noises, positions):
        try:
            picked.append(noise.argmax(p, list(range(at, at + len(x) + 1))))
        except Exception as err:  # noqa: BLE001 — returned: the caller fails this row only
            picked.append(err)
    good = [t for t in picked if not isinstance(t, Exception)]
    try:  # the one read: every row's tokens together, cut back into rows on the host
        flat, ends = torch.cat(good).tolist() if good else [], list(accumulate(len(t) for t in good))
        per_row = iter([flat[a:b] for a, b in zip([0] + ends, ends)])
    except Exception:  # noqa: BLE001 — some row cannot join the others: each row read alone
        per_row = iter([_read_or_error(t) for t in good])
    out = []
    for x, t in zip(drafts, picked):
        if not isinstance(t, Exception) and not isinstance(t := next(per_row), Exception):
            n_acc = next((k for k, (a, b) in enumerate(zip(t, x)) if a != b), len(x))  # the matching prefix
            t = (n_acc, t[n_acc])
        out.append(t)
    return out


def _read_or_error(t: Tensor) -> list | Exception:
    try:
        return t.tolist()
    except Exception as err:  # noqa: BLE001 — returned: the caller fails this row only
        return err
