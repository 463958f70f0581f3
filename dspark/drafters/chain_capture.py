"""DSpark's γ-loop (the Markov/RNN head's left-to-right sampling, `DSparkDrafter.draft_chain`) captured as one
compiled graph: on a GPU one CUDA-graph replay per drafted block instead of ~10 launches per position.

Capturable when every draw of the block comes from its uniform table (`BlockDraws.from_table`: no keyed request)
and every row samples with the same parameters (`RowSampling.single`): position k's token is then
inverse_cdf(p_k, u[:, k]) — a pure function of tensors — so the loop has no host reads and no Python state.
Rows are padded to a power of two (one graph per bucket, not per batch size); padding rows draw from zeros and
are cut off. Invariant: the same tokens, probabilities and confidence logits as the eager loop given the same
uniforms (the very same function, traced). Used where the decoding core is compiled (DSPARK_DECODE_CORE; auto:
on CUDA); if compiling or running the graph fails, the drafter warns once and runs the loop eager from then on.
"""
from __future__ import annotations

import logging
from typing import NamedTuple

import torch
from torch import Tensor

from dspark.decoding.sampling import SamplingParams, inverse_cdf, to_probs
from dspark.decoding.static_core import default_mode, resolve_mode, token_bucket

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


def chain_from_uniforms(drafter, u: Tensor, h: Tensor, anchors: Tensor, uniforms: Tensor, params: ChainParams):
    """`draft_chain` with position k drawn as inverse_cdf(p_k, uniforms[:, k]) and one sampling setting."""
    return drafter.draft_chain(u, h, anchors, lambda logits: to_probs(logits, params),
                               lambda probs, k: (slice(None), inverse_cdf(probs, uniforms[:, k:k + 1])))


def wanted(drafter) -> bool:
    """Capture where the decoding core is compiled, unless capturing failed for this drafter before."""
    return (resolve_mode(default_mode(), drafter.device) == "compiled"
            and not drafter.__dict__.get("_chain_capture_failed", False))


_compiled = {}  # (backend, device type) -> the compiled chain_from_uniforms


def _compiled_chain(device: torch.device):
    key = (BACKEND, device.type)
    if key not in _compiled:
        import torch._dynamo

        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        mode = "reduce-overhead" if device.type == "cuda" and BACKEND == "inductor" else None
        _compiled[key] = torch.compile(chain_from_uniforms, backend=BACKEND, mode=mode, dynamic=False)
    return _compiled[key]


def _pad_rows(t: Tensor, rows: int) -> Tensor:
    return t if t.shape[0] == rows else torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def run(drafter, u: Tensor, h: Tensor, anchors: Tensor, uniforms: Tensor, sp: SamplingParams):
    """(tokens [R, G], probs [R, G, N], confidence logits [R, G] or None) of the block, through the graph."""
    rows, params = u.shape[0], ChainParams.of(sp)
    bucket = token_bucket(rows)
    padded = [_pad_rows(t, bucket) for t in (u, h, anchors, uniforms)]
    try:
        out = _compiled_chain(u.device)(drafter, *padded, params)
    except Exception:  # noqa: BLE001 — the loop still runs, eager; the reason is logged once
        log.warning("capturing the drafter's sequential loop failed; drafting it eager from now on", exc_info=True)
        drafter.__dict__["_chain_capture_failed"] = True
        return chain_from_uniforms(drafter, u, h, anchors, uniforms, params)
    # cut the padding rows; a CUDA graph's outputs are overwritten by its next replay: copy them
    return tuple(None if t is None else t[:rows].clone() for t in out)
