"""Token sampling and the lossless speculative acceptance rule (paper §2.1).

`to_probs` turns logits into the exact distribution a token is drawn from (temperature, min-p,
top-k, top-p); the target and every drafter use this same function, so the distributions compared in
`accept_drafts` are the ones the tokens were really sampled from. Temperature 0 is greedy: a
one-hot at the argmax, and the acceptance rule then reduces to "accept iff argmax matches".
`to_logprobs` gives the log-probabilities reported to clients (raw or processed).

Two sources of randomness: a request's stream of uniforms (the engine's `counter_random.CounterStream`, or
a torch.Generator for batch-1 decoding; draws consumed in order, so how many are consumed depends on how
many drafts were verified), or `KeyedNoise` (the noise of output position j is a function of (seed, j) alone;
tokens are drawn by Gumbel-max with that noise, so the target's token at j does not depend on what was drafted
or verified — see `KeyedNoise`). The keyed noise
is counter-based and made on the device (`keyed_gumbel`: splitmix64 of (seed, position, token)), so the
target-only tokens of a whole batch are drawn in one call (`sample_keyed`: the engine without a drafter; the
rollout generator's tokens by inverse CDF at the counter-based uniform `keyed_uniform(seed, position)`).
"""
from __future__ import annotations

import math
from typing import Annotated, Literal, Sequence, Union

import torch
from pydantic import Field
from torch import Tensor

from dspark.config import StrictModel
from dspark.decoding.counter_random import (CounterStream, keyed_gumbel, keyed_uniform, on_device, signed64,
                                           stream_table, uniform_rows, uniforms)

# The sampling fields, defined once: every schema that samples (SamplingParams, the HTTP bodies, the
# rollout and evaluation configs) uses these types, with its own default.
Temperature = Annotated[float, Field(ge=0, allow_inf_nan=False, description="softmax temperature; 0 = greedy")]
TopP = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False,
                              description="nucleus sampling: smallest set of tokens with this mass; 1 = off")]
TopK = Annotated[int, Field(ge=0, description="keep the k most likely tokens; 0 = off")]
MinP = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False,
                              description="keep tokens with probability >= min_p × the top probability; 0 = off")]
MaxNewTokens = Annotated[int, Field(ge=1, description="tokens generated per answer (assistant turn) at most")]


class SamplingParams(StrictModel):
    """How one token is drawn from logits (`to_probs`)."""

    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    min_p: MinP = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def to_probs(logits: Tensor, sp: SamplingParams) -> Tensor:
    """Logits [..., V] -> float32 probabilities [..., V] after temperature, min-p, top-k and top-p
    (vLLM's order)."""
    logits = logits.float()
    if sp.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / sp.temperature
    if sp.min_p > 0:  # p_x >= min_p * p_max  <=>  logit_x >= logit_max + log(min_p)
        floor = logits.max(-1, keepdim=True).values + math.log(sp.min_p)
        logits = logits.masked_fill(logits < floor, float("-inf"))
    if 0 < sp.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sp.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sp.top_p < 1.0:
        probs = _nucleus(probs, sp.top_p)
    return probs


LogprobsMode = Literal["processed", "raw"]


def to_logprobs(logits: Tensor, sp: SamplingParams, mode: LogprobsMode = "processed") -> Tensor:
    """Logits [..., V] -> float32 log-probabilities [..., V] as reported to clients.
    "raw": log_softmax of the model's logits (vLLM's default, `--logprobs-mode raw_logprobs`).
    "processed": the distribution the token is drawn from, log(to_probs(logits, sp)) computed as a
    log_softmax (no underflow): temperature applied, tokens that min-p/top-k/top-p remove at -inf and
    the rest renormalised. At temperature 0 (greedy, a one-hot) both modes report the raw
    log-probabilities, as vLLM does."""
    logits = logits.float()
    if mode == "raw" or sp.greedy:
        return torch.log_softmax(logits, -1)
    scaled = logits / sp.temperature
    if sp.top_p < 1.0 or sp.top_k > 0 or sp.min_p > 0:
        scaled = scaled.masked_fill(to_probs(logits, sp) == 0, float("-inf"))
    return torch.log_softmax(scaled, -1)


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


# ---- target-only tokens keyed by (seed, position) ------------------------------------------------
def sample_keyed(logits: Tensor, samplings: Sequence[SamplingParams], seeds: Sequence[int],
                 positions: Sequence[int], gumbel: Sequence[bool] | None = None) -> Tensor:
    """One target-only token per row of logits [R, V], drawn from to_probs(logits[r], samplings[r]) with
    randomness keyed by (seeds[r], positions[r]) alone -> LongTensor [R] on logits' device. gumbel[r]: the
    Gumbel-max sample with `keyed_gumbel` noise (the very token `KeyedNoise(seed).argmax` gives there, so a
    seeded request is the same with or without a drafter; V hashes per row); else inverse CDF at
    `keyed_uniform` (one hash per row: the rollout generator's). Rows sharing a SamplingParams are processed
    together (usually all of them: one call, no per-row work)."""
    dev, rows_n = logits.device, logits.shape[0]
    gumbel = list(gumbel) if gumbel is not None else [False] * rows_n
    keys = torch.tensor([signed64(s) for s in seeds], device=dev)
    where = torch.tensor(list(positions), device=dev)
    tokens = torch.empty(rows_n, dtype=torch.long, device=dev)
    groups: dict[tuple, tuple[SamplingParams, list[int]]] = {}
    for r, sp in enumerate(samplings):
        groups.setdefault(tuple(sp.model_dump().values()), (sp, []))[1].append(r)
    for sp, rows in groups.values():
        index = torch.tensor(rows, device=dev)
        # once per group, whichever way its rows draw (all rows: no gather copy of the logits)
        probs = to_probs(logits if len(rows) == rows_n else logits[index], sp)
        flags = [gumbel[r] for r in rows]
        if not any(flags):  # the common case: every row by inverse CDF, no masking copies
            tokens[index] = inverse_cdf(probs, keyed_uniform(keys[index], where[index])[:, None])
            continue
        mask = torch.tensor(flags, device=dev)
        by_cdf, by_gumbel = index[~mask], index[mask]
        if len(by_cdf):
            tokens[by_cdf] = inverse_cdf(probs[~mask], keyed_uniform(keys[by_cdf], where[by_cdf])[:, None])
        noise = keyed_gumbel(keys[by_gumbel], where[by_gumbel], logits.shape[-1])
        tokens[by_gumbel] = (probs[mask].double().log() + noise).argmax(-1)
    return tokens


class KeyedNoise:
    """Counter-based randomness of one request: the Gumbel noise g_j [V] of output position j is
    `keyed_gumbel(seed, j)`, computed on the device, a function of (seed, j) alone, never of how many
    draws were made before.

    Coupling (invariant): a token is drawn by Gumbel-max, x_j = argmax_x log p_j(x) + g_j(x), which is
    distributed exactly as p_j (g_j i.i.d. standard Gumbel, independent of the prefix, which depends
    on g_<j only). The drafter draws its token for position j with the SAME noise, x̂_j = argmax
    log q_j + g_j; the engine accepts draft j iff x̂_j == x_j and, at the first mismatch (or after the
    last draft), emits x_j. So the token at j is always the target's own Gumbel-max sample x_j,
    whatever was drafted or verified: the output is target-only sampling (lossless) and a function of
    (seed, prompt, settings) alone. The price: P(x̂ == x) <= Σ_x min(p, q), the rejection rule's rate.

    `cursor` is the next position a drafter's `sample` call draws for (each keyed row advances it);
    `columns` maps a draft vocabulary's columns to target ids (probs with fewer than V columns)."""

    def __init__(self, seed: int, vocab_size: int, device, columns: Tensor | None = None):
        self.seed, self.vocab_size = int(seed), int(vocab_size)
        self.device = torch.device(device)
        self.columns = None if columns is None else columns.to(self.device)
        self.cursor = 0
        self._noise: dict[int, Tensor] = {}  # position -> g [V] float64 (drafts and verify share it)

    def gumbel(self, position: int) -> Tensor:
        if position not in self._noise:
            prefetch_noise([(self, position)])
        return self._noise[position]

    def forget_before(self, position: int) -> None:
        """Drop the noise of positions already emitted (they are never drawn again)."""
        for p in [p for p in self._noise if p < position]:
            del self._noise[p]

    def argmax(self, probs: Tensor, positions: Sequence[int]) -> Tensor:
        """Gumbel-max tokens of probs [n, V or N] at the given output positions -> LongTensor [n]
        (target ids' columns when probs cover a draft vocabulary of N < V columns)."""
        g = torch.stack([self.gumbel(p) for p in positions]) if positions else \
            torch.empty(0, self.vocab_size, dtype=torch.float64, device=self.device)
        return self._keys(probs, g).argmax(-1)

    def top_distinct(self, probs: Tensor, n: int, position: int) -> Tensor:
        """The n tokens of largest log p + noise(position) per row of probs [R, V or N] -> [R, min(n, ·)]
        (target ids' columns as in `argmax`): a draft tree's children at one output position, the first
        being the row's own Gumbel-max draw, coupled with the target's keyed sample there."""
        return self._keys(probs, self.gumbel(position)).topk(min(n, probs.shape[-1]), dim=-1).indices

    def _keys(self, probs: Tensor, g: Tensor) -> Tensor:
        """log probs + Gumbel noise g [..., V] (`restrict`ed to probs' columns)."""
        return probs.to(self.device, torch.float64).log() + self.restrict(g, probs.shape[-1])

    def restrict(self, g: Tensor, columns: int) -> Tensor:
        """Noise g [..., V] for probs of `columns` columns: g itself (the vocabulary), or its draft vocabulary's
        columns (N < V)."""
        if columns == self.vocab_size:
            return g
        if self.columns is None or self.columns.shape[0] != columns:
            raise ValueError(f"probs have {columns} columns: not the vocabulary ({self.vocab_size}) "
                             "nor the draft vocabulary this noise was given")
        return g[..., self.columns]

    def draw(self, probs: Tensor) -> Tensor:
        """Rows of probs [n, ·] are consecutive positions from `cursor` on (a drafter's draws)."""
        positions = list(range(self.cursor, self.cursor + probs.shape[0]))
        self.cursor += probs.shape[0]
        return self.argmax(probs, positions)


def one_layout(noises: Sequence[KeyedNoise]) -> bool:
    """The noises share one draft-vocabulary layout and device (their noise stacks into one table)."""
    return all(n.columns is noises[0].columns and n.device == noises[0].device for n in noises)


def draw_keyed_rows(noises: Sequence[KeyedNoise], probs: Tensor) -> Tensor:
    """Row i of probs [n, V or N] drawn by noises[i] at its next position — each row's `KeyedNoise.draw` — in one
    argmax over the stacked noise (rows of one drafter share its draft-vocabulary columns; otherwise row by row)."""
    first = noises[0]
    if not one_layout(noises):
        return torch.cat([n.draw(probs[i:i + 1]).to(first.device) for i, n in enumerate(noises)])
    g = torch.stack([n.gumbel(n.cursor) for n in noises])
    for n in noises:
        n.cursor += 1
    return first._keys(probs, g).argmax(-1)


def prefetch_noise(pairs: Sequence[tuple[KeyedNoise, int]]) -> None:
    """Make the missing noise of (noise, output position) pairs in one `keyed_gumbel` call per (vocabulary,
    device) — a step's keyed rows: every position of their drafted blocks, or of their verify rows — instead of
    one call per pair. Each row of keyed_gumbel is computed alone (elementwise), so the noise is the same."""
    groups: dict[tuple, dict[tuple[int, int], tuple[KeyedNoise, int]]] = {}
    for noise, position in pairs:
        if position not in noise._noise:
            groups.setdefault((noise.vocab_size, noise.device), {})[(id(noise), position)] = (noise, position)
    for (vocab, device), missing in groups.items():
        seeds = torch.tensor([signed64(n.seed) for n, _ in missing.values()], device=device)
        positions = torch.tensor([p for _, p in missing.values()], device=device)
        for (noise, position), g in zip(missing.values(), keyed_gumbel(seeds, positions, vocab)):
            noise._noise[position] = g


def accept_keyed(draft_tokens: Tensor, target_probs: Tensor, noise: KeyedNoise, position: int) -> tuple[int, int]:
    """The keyed counterpart of `accept_drafts` (see `KeyedNoise`): target_probs [n+1, V], row k the
    distribution of output position `position + k`. Draft k is accepted iff it equals the target's
    Gumbel-max token there; returns (n_accepted, the target's token at the first mismatch / bonus)."""
    n = draft_tokens.shape[0]
    xs = noise.argmax(target_probs, list(range(position, position + n + 1)))
    n_acc = int((xs[:n] == draft_tokens.to(xs.device)).long().cumprod(0).sum()) if n else 0
    return n_acc, int(xs[n_acc])


# One generator for every row, or one per row (a list: per-request randomness in the batched engine);
# a KeyedNoise draws by position instead of from a stream.
# A request's stream is a CounterStream (the engine's: drawn for all requests in one call) or a torch.Generator.
Generators = Union[torch.Generator, CounterStream, KeyedNoise,
                   Sequence[Union[torch.Generator, CounterStream, KeyedNoise]], None]


def _single(generator) -> bool:
    return generator is None or isinstance(generator, (torch.Generator, CounterStream, KeyedNoise))


def _to_generator_device(t: Tensor, generator: torch.Generator | CounterStream | None) -> Tensor:
    return t if generator is None or t.device == generator.device else t.to(generator.device)


def rows_generators(generator: Generators, counts: Sequence[int]) -> Generators:
    """The generators of sampled rows laid out request-major, counts[r] rows of request r (per-request
    generators, one per request): request r's generator repeated counts[r] times. The counts come from the
    host (the requests' γs), so choosing the rows reads nothing back from the device. A single generator
    (or None) is returned as it is."""
    if _single(generator):
        return generator
    if len(counts) != len(generator):
        raise ValueError(f"{len(generator)} generators for {len(counts)} rows; pass one per request")
    return [g for g, c in zip(generator, counts) for _ in range(int(c))]


def block_uniforms(generator: Generators, gammas: Sequence[int], device) -> Tensor:
    """A drafted block's uniforms, drawn before drafting: u [R, max γ] float64 on `device`, entry (r, k) for
    k < γ_r, request-major (request r's γ_r draws in one take from its stream: the very values γ_r single draws
    give), 0 past γ_r and for requests drawing by position (KeyedNoise: nothing drawn). One stream for all:
    every draw in one call; counter streams: every request's draws in one call."""
    per_request = [generator] * len(gammas) if _single(generator) else list(generator)
    if len(per_request) != len(gammas):
        raise ValueError(f"{len(per_request)} generators for {len(gammas)} requests; pass one per request")
    counts, width = [0 if isinstance(g, KeyedNoise) else int(n) for g, n in zip(per_request, gammas)], max(gammas)
    if all(isinstance(g, (CounterStream, KeyedNoise)) for g in per_request):  # the engine's: one hash, one copy
        return on_device(stream_table(per_request, counts, width), device)
    if _single(generator) and not isinstance(generator, KeyedNoise):  # one stream: every draw in one call
        rows = uniform_rows([generator], [sum(counts)], device)[0].split(counts)
    else:  # a stream per request (a keyed request draws nothing)
        rows = uniform_rows([None if isinstance(g, KeyedNoise) else g for g in per_request], counts, device)
    if min(counts) == width:  # every request draws the whole block
        return torch.stack(list(rows))
    u = torch.nn.utils.rnn.pad_sequence(list(rows), batch_first=True)
    return u if u.shape[1] == width else torch.nn.functional.pad(u, (0, width - u.shape[1]))


def _row_uniforms(generators: Sequence, rows: int, device) -> Tensor:
    """u [rows, 1] float64 with row i drawn from generators[i]; consecutive rows that share a generator
    are drawn in one take, so one request's rows consume its stream exactly as a single-generator
    `sample` over those rows alone would (and counter streams are all drawn in one call)."""
    if len(generators) != rows:
        raise ValueError(f"{len(generators)} generators for {rows} sampled rows; pass one per row")
    streams, counts = [], []
    for g in generators:
        if streams and g is streams[-1]:
            counts[-1] += 1
        else:
            streams.append(g)
            counts.append(1)
    if not streams:
        return torch.empty(0, 1, dtype=torch.float64, device=device)
    return torch.cat(uniform_rows(streams, counts, device))[:, None]


def sample(probs: Tensor, generator: Generators = None) -> Tensor:
    """One token per row of probs [..., V] -> LongTensor [...]. generator: one for all rows (the result
    is on its device), or a list with one per row (rows stay on probs' device). A KeyedNoise row is
    drawn by Gumbel-max at its next position (`KeyedNoise.draw`), a torch.Generator row by inverse CDF."""
    if isinstance(generator, KeyedNoise):
        flat = probs.reshape(-1, probs.shape[-1])
        return generator.draw(flat).reshape(probs.shape[:-1])
    per_row = not _single(generator)
    if not per_row:
        probs = _to_generator_device(probs, generator)
    flat = probs.reshape(-1, probs.shape[-1])
    if per_row and any(isinstance(g, KeyedNoise) for g in generator):
        return _sample_mixed(flat, list(generator)).reshape(probs.shape[:-1])
    if per_row:
        u = _row_uniforms(list(generator), flat.shape[0], flat.device)
    else:
        u = uniforms(generator, (flat.shape[0], 1), flat.device)
    return inverse_cdf(flat, u).reshape(probs.shape[:-1])


def draw_distinct(probs: Tensor, n: int, generator: torch.Generator | CounterStream | None = None) -> Tensor:
    """min(n, V) distinct tokens per row of probs [R, V] -> [R, n'], in the order sequential sampling
    without replacement draws them (Gumbel top-n: the j-th is drawn from `sibling_proposals`' row j).
    Tokens of probability 0 come last, once the row's support is used up (their proposal row is 0)."""
    u = uniforms(generator, probs.shape, probs.device)
    keys = probs.double().log() - torch.log(-torch.log(u.clamp(1e-300, 1 - 1e-16)))  # log p + Gumbel noise
    return keys.topk(min(n, probs.shape[-1]), dim=-1).indices


def sibling_proposals(probs: Tensor, picks: Tensor) -> Tensor:
    """[R, n, V]: row j = probs [R, V] without the tokens picks[:, :j], renormalised: the distribution the
    j-th distinct draw came from. All zero once nothing is left (a draw that is no proposal)."""
    rows, n = picks.shape
    taken = torch.zeros(rows, n, probs.shape[-1], dtype=torch.bool, device=probs.device)
    for j in range(1, n):
        taken[:, j] = taken[:, j - 1]
        taken[:, j].scatter_(1, picks[:, j - 1: j], True)
    left = probs.unsqueeze(1).masked_fill(taken, 0.0)
    total = left.sum(-1, keepdim=True)
    return torch.where(total > 0, left / total.clamp_min(1e-30), 0.0)


def _sample_mixed(flat: Tensor, generators: list) -> Tensor:
    """Rows with a KeyedNoise drawn by position, in row order; the others from their streams."""
    if len(generators) != flat.shape[0]:
        raise ValueError(f"{len(generators)} generators for {flat.shape[0]} sampled rows; pass one per row")
    out = torch.empty(flat.shape[0], dtype=torch.long, device=flat.device)
    streamed = [i for i, g in enumerate(generators) if not isinstance(g, KeyedNoise)]
    if streamed:
        u = _row_uniforms([generators[i] for i in streamed], len(streamed), flat.device)
        out[streamed] = inverse_cdf(flat[streamed], u)
    for i, g in enumerate(generators):
        if isinstance(g, KeyedNoise):
            out[i] = g.draw(flat[i: i + 1]).to(flat.device)[0]
    return out


def inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """probs [N, V] and uniforms u [N, 1] in [0, 1) (float64, same device) -> LongTensor [N]."""
    # Inverse CDF in float64: the first index whose cumulative mass exceeds u·total, u ~ U[0, 1).
    # A zero-probability token adds nothing to the CDF, so it is never picked (u·total < total
    # except by a 2^-53 rounding). ~9x faster than torch.multinomial on a 49k vocabulary.
    cdf = probs.double().cumsum(-1)
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_max(cdf.shape[-1] - 1).squeeze(-1)


def accept_drafts(draft_tokens: Tensor, draft_probs: Tensor, target_probs: Tensor,
                  generator: torch.Generator | CounterStream | None = None) -> tuple[int, int]:
    """Speculative rejection sampling. draft_tokens [n], draft_probs [n, V], target_probs [n+1, V]
    (row n = the bonus distribution). Returns (n_accepted, next_token).

    Invariant (Leviathan et al. 2023): at each position the emitted token is distributed exactly as
    p_t — accept x~p_d w.p. min(1, p_t(x)/p_d(x)), else draw from norm(max(0, p_t - p_d)); the mass
    sum_x min(p_t, p_d) + (1 - sum_x min(p_t, p_d)) * residual = p_t. Tokens after the first
    rejection are discarded, so every emitted token is conditioned on the emitted prefix only.
    """
    n = draft_tokens.shape[0]
    check_accept_shapes(n, draft_probs, target_probs)
    draft_tokens, draft_probs, target_probs = (_to_generator_device(t, generator)
                                               for t in (draft_tokens, draft_probs, target_probs))
    rows = torch.arange(n, device=draft_tokens.device)
    p_t, p_d = target_probs[rows, draft_tokens], draft_probs[rows, draft_tokens]
    u = uniforms(generator, (n,), draft_tokens.device, torch.float32)
    accepted = (u * p_d < p_t).long()  # P(u < p_t/p_d) = min(1, p_t/p_d) for u ~ U[0, 1)
    n_acc = int(accepted.cumprod(0).sum())  # length of the accepted prefix
    if n_acc == n:  # all accepted: bonus token from the target at position n+1
        return n, int(sample(target_probs[n], generator))
    return n_acc, int(sample(residual_weights(target_probs[n_acc], draft_probs[n_acc]), generator))


def check_accept_shapes(n: int, draft_probs: Tensor, target_probs: Tensor) -> None:
    """n drafts need draft_probs [n, V] and target_probs [n + 1, V] (row n: the bonus distribution)."""
    if target_probs.shape[0] != n + 1 or draft_probs.shape[0] != n:
        raise ValueError(f"accept_drafts needs draft_probs [{n}, V] and target_probs [{n + 1}, V], "
                         f"got {tuple(draft_probs.shape)} and {tuple(target_probs.shape)}")


def residual_weights(p: Tensor, q: Tensor) -> Tensor:
    """max(0, p − q) per row [..., V], unnormalised: what a rejected draft from q leaves of the target's p; p itself
    where nothing is left, which only rounding reaches (p == q). The next token is drawn from it as it is
    (inverse_cdf scales by the row's total), so row-by-row and batched acceptance (dspark.decoding.batched_accept)
    draw from the very same numbers: a total summed over [R, V] differs in the last bits from a row's own."""
    left = (p - q).clamp_min(0.0)
    return torch.where((left > 0).any(-1, keepdim=True), left, p)


def rejection_residual(p: Tensor, q: Tensor) -> Tensor:
    """norm(`residual_weights`): the law the next token is drawn from after a rejection, as a distribution (tree
    walks subtract the next sibling's proposal from it)."""
    left = residual_weights(p, q)
    return left / left.sum(-1, keepdim=True)
