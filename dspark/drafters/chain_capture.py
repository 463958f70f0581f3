"""DSpark's γ-loop (the Markov/RNN head's left-to-right sampling, `DSparkDrafter.draft_chain`) captured as one
compiled graph: on a GPU one CUDA-graph replay per drafted block instead of ~10 launches per position.

Capturable when every row samples with the same parameters (`RowSampling.single`) and every draw of the block is
made before the loop (`capturable`): a stream's row from its uniform table, position k's token inverse_cdf(p_k,
u[:, k]); a keyed (seeded) row from its noise table, argmax(log p_k + g[:, k]) — `KeyedNoise.draw`'s Gumbel-max
token at the row's next positions (`keyed_tables`). Both are pure functions of tensors, so the loop has no host
reads and no Python state.
Rows are padded to a power of two (one graph per bucket, not per batch size); padding rows draw from zeros and
are cut off. Invariant: the same tokens, probabilities and confidence logits as the eager loop given the same
uniforms and noise (the very same function, traced). Used where the decoding core is compiled (DSPARK_DECODE_CORE; auto:
on CUDA); if compiling or running the graph fails, the drafter warns once and runs the loop eager from then on.
"""
from __future__ import annotations

import logging
from typing import NamedTuple

import torch
from torch import Tensor

from dspark.decoding.sampling import SamplingParams, inverse_cdf, one_layout, to_probs
from dspark.decoding.static_core import compile_static, default_mode, resolve_mode, token_bucket

log = logging.getLogger(__name__)
BACKEND = "inductor"  # torch.compile's backend (tests trace with "aot_eager": the same graph, no C++ build)


class ChainParams(NamedTuple):
    """SamplingParams as plain constants (what `to_probs` reads; a traced graph guards on them)."""

    greedy: bool
    temperature: float
    min_p: float
    top_k: int
    top_p: float

    @classmethod
    def of(cls, sp: SamplingParams) -> "ChainParams":
        return cls(sp.greedy, sp.temperature, sp.min_p, sp.top_k, sp.top_p)


def chain_from_uniforms(drafter, u: Tensor, h: Tensor, anchors: Tensor, uniforms: Tensor, params: ChainParams,
                        noise: Tensor | None = None, keyed: Tensor | None = None):
    """`draft_chain` with one sampling setting and every draw made before the loop (`drawn_ahead`)."""
    draw = drawn_ahead(uniforms, noise, keyed)
    return drafter.draft_chain(u, h, anchors, lambda logits: to_probs(logits, params), draw)


def drawn_ahead(uniforms: Tensor, noise: Tensor | None = None, keyed: Tensor | None = None):
    """draw(probs [R, N], k) -> (every row, tokens [R]) from draws made before the loop: entry (r, k) is
    inverse_cdf(p_k, uniforms[r, k]), or where keyed [R, G] is set argmax(log p_k + noise[r, k]) (noise [R, G, N]
    float64; None: no keyed row) — what `BlockDraws.draw` gives, as a pure function of tensors."""
    def draw(probs: Tensor, k: int):
        tokens = inverse_cdf(probs, uniforms[:, k:k + 1])
        if noise is not None:
            tokens = torch.where(keyed[:, k], (probs.double().log() + noise[:, k]).argmax(-1), tokens)
        return slice(None), tokens

    return draw


def capturable(draws) -> bool:
    """A block's draws (`BlockDraws`) are all made before the loop: streams' uniforms drawn up front, and keyed
    rows (if any) each with its own noise, all sharing one draft-vocabulary layout and device (one stacked table;
    a noise shared by several rows draws them position by position, `draw_keyed_rows`)."""
    noises = [noise for _, noise in draws.keyed]
    return draws.uniforms is not None and len({id(n) for n in noises}) == len(noises) and one_layout(noises)


def keyed_tables(draws, rows: int, columns: int, device) -> tuple[Tensor | None, Tensor | None]:
    """(noise [rows, max γ, N] float64, keyed [rows, max γ] bool) on `device` for a capturable block's keyed rows
    (rows >= R: padding rows stay unkeyed): entry (r, k), k < γ_r, is the noise of row r's position cursor + k,
    restricted to the draft vocabulary (`KeyedNoise.restrict`); each keyed row's cursor advances by γ_r, as its
    position-by-position draws would. Past γ_r and for stream rows: unkeyed (their uniforms, 0 for a keyed row,
    as `BlockDraws.draw` gives). (None, None) without keyed rows. The noise was made for the block by `BlockDraws`."""
    if not draws.keyed:
        return None, None
    width = max(draws.gammas)
    noise = torch.zeros(rows, width, columns, dtype=torch.float64, device=device)
    keyed = torch.zeros(rows, width, dtype=torch.bool)
    for r, row_noise in draws.keyed:
        gamma = draws.gammas[r]
        g = torch.stack([row_noise.gumbel(row_noise.cursor + k) for k in range(gamma)])
        noise[r, :gamma] = row_noise.restrict(g, columns).to(device)
        keyed[r, :gamma] = True
        row_noise.cursor += gamma
    return noise, keyed.to(device)


def compiled_for(drafter, states=()) -> bool:
    """The requests' decoding core is compiled: `DraftState.captured` (set by batch-1 decoding from its core) when
    every state says; else where DSPARK_DECODE_CORE compiles (auto: on CUDA)."""
    flags = {getattr(s, "captured", None) for s in states}
    if flags and None not in flags:
        return flags == {True}
    return resolve_mode(default_mode(), drafter.device) == "compiled"


def wanted(drafter, states=(), part: str = "chain") -> bool:
    """Capture `part` ("chain": this γ-loop; "block": the block passes, `block_capture` or `eagle3_capture`, for any
    number of requests) where the requests' core is compiled, unless capturing it failed for this drafter before."""
    return compiled_for(drafter, states) and not drafter.__dict__.get(f"_{part}_capture_failed", False)


def fell_back(drafter) -> list[str]:
    """The drafter's captures ("block": its batch-1 passes, "chain": this γ-loop) that failed and now run eager.
    Not counted here: a function whose graph cache is full (`static_core.full_graph_caches` names those)."""
    return [part for part in ("block", "chain") if drafter.__dict__.get(f"_{part}_capture_failed")]


_compiled = {}  # (module, function name, backend, device type) -> its torch.compile wrapper


def compiled(fn, device: torch.device):
    """`fn` under torch.compile with BACKEND, static shapes, CUDA graphs on a GPU (inductor), made once per
    (function, backend, device type): the γ-loop here, `block_capture`'s and `eagle3_capture`'s passes."""
    key = (fn.__module__, fn.__qualname__, BACKEND, device.type)
    if key not in _compiled:
        _compiled[key] = compile_static(fn, device, BACKEND)
    return _compiled[key]


_GAVE_UP = {"chain": "capturing the drafter's sequential loop (%s) failed; drafting it eager from now on",
            "block": "capturing the drafter's %s pass failed; running its passes eager from now on"}


def call_captured(drafter, fn, *args, part: str = "block"):
    """fn(drafter, *args) through its captured graph (`compiled`). If capturing or replaying fails: warn once with
    the reason, mark `part` failed for this drafter (`wanted` then says no, `fell_back` names it), run fn eager."""
    try:
        return compiled(fn, drafter.device)(drafter, *args)
    except Exception:  # noqa: BLE001 — the pass still runs, eager; the reason is logged once
        log.warning(_GAVE_UP[part], fn.__name__.strip("_"), exc_info=True)
        drafter.__dict__[f"_{part}_capture_failed"] = True
        return fn(drafter, *args)  # the same function, eager


def pad_rows(t: Tensor, rows: int) -> Tensor:
    """t with zero rows appended up to `rows` (a graph's bucket)."""
    return t if t.shape[0] == rows else torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def run(drafter, u: Tensor, h: Tensor, anchors: Tensor, draws, sp: SamplingParams):
    """(tokens [R, G], probs [R, G, N], confidence logits [R, G] or None) of the block, through the graph; draws:
    a `capturable` BlockDraws (its keyed rows' cursors advance)."""
    rows, params = u.shape[0], ChainParams.of(sp)
    bucket = token_bucket(rows)
    noise, keyed = keyed_tables(draws, bucket, u.shape[-1], u.device)  # made at the bucket's rows
    padded = [pad_rows(t.to(u.device), bucket) for t in (u, h, anchors, draws.uniforms)]
    out = call_captured(drafter, chain_from_uniforms, *padded, params, noise, keyed, part="chain")
    # cut the padding rows; a CUDA graph's outputs are overwritten by its next replay: copy them
    return tuple(None if t is None else t[:rows].clone() for t in out)
