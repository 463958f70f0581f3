"""Token sampling and the lossless speculative acceptance rule (paper §2.1).

`to_probs` turns logits into the exact distribution a token is drawn from (temperature, top-k,
top-p); the target and every drafter use this same function, so the distributions compared in
`accept_drafts` are the ones the tokens were really sampled from. Temperature 0 is greedy: a
one-hot at the argmax, and the acceptance rule then reduces to "accept iff argmax matches".
"""
from __future__ import annotations

from typing import Annotated, Sequence, Union

import torch
from pydantic import Field
from torch import Tensor

from dspark.config import StrictModel

# The sampling fields, defined once: every schema that samples (SamplingParams, the HTTP bodies, the
# rollout and evaluation configs) uses these types, with its own default.
Temperature = Annotated[float, Field(ge=0, allow_inf_nan=False, description="softmax temperature; 0 = greedy")]
TopP = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False,
                              description="nucleus sampling: smallest set of tokens with this mass; 1 = off")]
TopK = Annotated[int, Field(ge=0, description="keep the k most likely tokens; 0 = off")]
MaxNewTokens = Annotated[int, Field(ge=1, description="tokens generated per answer (assistant turn) at most")]


class SamplingParams(StrictModel):
    """How one token is drawn from logits (`to_probs`)."""

    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def to_probs(logits: Tensor, sp: SamplingParams) -> Tensor:
    """Logits [..., V] -> float32 probabilities [..., V] after temperature, top-k and top-p."""
    logits = logits.float()
    if sp.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / sp.temperature
    if 0 < sp.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sp.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sp.top_p < 1.0:
        probs = _nucleus(probs, sp.top_p)
    return probs


TOP_P_CANDIDATES = 1024  # nucleus search among the top-k first: a full sort of a 49k vocabulary is ~8x slower


def _nucleus(probs: Tensor, top_p: float) -> Tensor:
    """Keep, in descending order, each token while the mass above it is < top_p; renormalise.
    Exactness of the shortcut: if the top-k candidates hold mass >= top_p, every token ranked below
    them has mass above it >= top_p and is dropped anyway, so sorting the top-k alone is enough;
    otherwise (a flat distribution) the whole vocabulary is sorted."""
    k = min(TOP_P_CANDIDATES, probs.shape[-1])
    top, order = probs.topk(k, dim=-1)  # sorted descending
    if k < probs.shape[-1] and not bool((top.sum(-1) >= top_p).all()):
        top, order = probs.sort(dim=-1, descending=True)
    mass_before = top.cumsum(-1) - top  # keep a token while the mass above it < top_p
    top = top.masked_fill(mass_before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter(-1, order, top)
    return kept / kept.sum(-1, keepdim=True)


# One generator for every row, or one per row (a list: per-request randomness in the batched engine).
Generators = Union[torch.Generator, Sequence[torch.Generator], None]


def _to_generator_device(t: Tensor, generator: torch.Generator | None) -> Tensor:
    return t if generator is None or t.device == generator.device else t.to(generator.device)


def rows_generators(generator: Generators, mask: Tensor) -> Generators:
    """The generators of the rows that `tensor[mask]` selects, for per-request generators (a list with
    one per request, i.e. per row of mask [R] or [R, G]): request r's generator repeated once per
    selected entry of row r, request-major, as boolean indexing orders them. A single generator (or
    None) is returned as it is."""
    if generator is None or isinstance(generator, torch.Generator):
        return generator
    counts = mask.reshape(mask.shape[0], -1).sum(-1).tolist()
    if len(counts) != len(generator):
        raise ValueError(f"{len(generator)} generators for {len(counts)} rows; pass one per request")
    return [g for g, c in zip(generator, counts) for _ in range(int(c))]


def _row_uniforms(generators: Sequence[torch.Generator], rows: int, device) -> Tensor:
    """u [rows, 1] float64 with row i drawn from generators[i]; consecutive rows that share a generator
    are drawn in one call, so one request's rows consume its stream exactly as a single-generator
    `sample` over those rows alone would."""
    if len(generators) != rows:
        raise ValueError(f"{len(generators)} generators for {rows} sampled rows; pass one per row")
    draws, i = [], 0
    while i < rows:
        j = i
        while j < rows and generators[j] is generators[i]:
            j += 1
        g = generators[i]
        draws.append(torch.rand(j - i, 1, generator=g, device=g.device, dtype=torch.float64).to(device))
        i = j
    return torch.cat(draws) if draws else torch.empty(0, 1, dtype=torch.float64, device=device)


def sample(probs: Tensor, generator: Generators = None) -> Tensor:
    """One token per row of probs [..., V] -> LongTensor [...]. generator: one for all rows (the result
    is on its device), or a list with one per row (rows stay on probs' device)."""
    per_row = generator is not None and not isinstance(generator, torch.Generator)
    if not per_row:
        probs = _to_generator_device(probs, generator)
    flat = probs.reshape(-1, probs.shape[-1])
    if per_row:
        u = _row_uniforms(list(generator), flat.shape[0], flat.device)
    else:
        u = torch.rand(flat.shape[0], 1, generator=generator, device=flat.device, dtype=torch.float64)
    return inverse_cdf(flat, u).reshape(probs.shape[:-1])


def inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """probs [N, V] and uniforms u [N, 1] in [0, 1) (float64, same device) -> LongTensor [N]."""
    # Inverse CDF in float64: the first index whose cumulative mass exceeds u·total, u ~ U[0, 1).
    # A zero-probability token adds nothing to the CDF, so it is never picked (u·total < total
    # except by a 2^-53 rounding). ~9x faster than torch.multinomial on a 49k vocabulary.
    cdf = probs.double().cumsum(-1)
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_max(cdf.shape[-1] - 1).squeeze(-1)


def accept_drafts(draft_tokens: Tensor, draft_probs: Tensor, target_probs: Tensor,
                  generator: torch.Generator | None = None) -> tuple[int, int]:
    """Speculative rejection sampling. draft_tokens [n], draft_probs [n, V], target_probs [n+1, V]
    (row n = the bonus distribution). Returns (n_accepted, next_token).

    Invariant (Leviathan et al. 2023): at each position the emitted token is distributed exactly as
    p_t — accept x~p_d w.p. min(1, p_t(x)/p_d(x)), else draw from norm(max(0, p_t - p_d)); the mass
    sum_x min(p_t, p_d) + (1 - sum_x min(p_t, p_d)) * residual = p_t. Tokens after the first
    rejection are discarded, so every emitted token is conditioned on the emitted prefix only.
    """
    n = draft_tokens.shape[0]
    if target_probs.shape[0] != n + 1 or draft_probs.shape[0] != n:
        raise ValueError(f"accept_drafts needs draft_probs [{n}, V] and target_probs [{n + 1}, V], "
                         f"got {tuple(draft_probs.shape)} and {tuple(target_probs.shape)}")
    draft_tokens, draft_probs, target_probs = (_to_generator_device(t, generator)
                                               for t in (draft_tokens, draft_probs, target_probs))
    rows = torch.arange(n, device=draft_tokens.device)
    p_t, p_d = target_probs[rows, draft_tokens], draft_probs[rows, draft_tokens]
    u = torch.rand(n, generator=generator, device=draft_tokens.device)
    accepted = (u * p_d < p_t).long()  # P(u < p_t/p_d) = min(1, p_t/p_d) for u ~ U[0, 1)
    n_acc = int(accepted.cumprod(0).sum())  # length of the accepted prefix
    if n_acc == n:  # all accepted: bonus token from the target at position n+1
        return n, int(sample(target_probs[n], generator))
    residual = (target_probs[n_acc] - draft_probs[n_acc]).clamp_min(0.0)
    if residual.sum() <= 0:  # only reachable through rounding when p_t == p_d
        residual = target_probs[n_acc]
    return n_acc, int(sample(residual / residual.sum(), generator))
