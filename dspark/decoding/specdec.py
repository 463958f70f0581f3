"""Batch-1 speculative decoding (draft, verify in one target pass, accept losslessly) and the
target-only baseline that uses the same sampling and KV cache.

Per round (paper §2.1), with `anchor` = the last token the target produced (not yet in any cache):
  1. the drafter proposes γ tokens from its context (verified positions strictly before the anchor);
  2. `verify_len(round_idx, proposal)` picks how many of them to verify (default all γ);
  3. the target scores [anchor, drafts[:n]] in ONE forward pass over its KV cache;
  4. `accept_drafts` keeps a prefix of a drafts and draws the next token (residual or bonus);
  5. the target cache is cropped to the accepted length and the drafter's context is extended
     with the target features of [anchor, accepted drafts]; the drawn token is the new anchor.
Invariant between rounds: target cache length == drafter context length == len(prompt) +
len(tokens) - 1 (everything but the anchor).

Losslessness needs `verify_len` to be non-anticipating: whether draft k is verified may depend
on drafts 1..k-1 and on confidences computed from them, never on draft k itself (paper App. A).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

from dspark.decoding.kv_sequence import open_sequence
from dspark.decoding.sampling import SamplingParams, accept_drafts, sample, to_probs

VerifyLen = Callable[[int, object], int]  # (round_idx, DraftProposal) -> number of drafts to verify


@dataclass
class RoundStats:
    proposed: int  # drafts proposed (γ)
    verified: int  # drafts sent to the target (≤ proposed)
    accepted: int  # accepted prefix length (≤ verified); τ for the round = accepted + 1
    outcomes: list[bool]  # per verified position up to the first rejection: True accepted / False rejected
    confidences: list[float] | None = None  # drafter confidences c_1..c_γ (None if no head)
    emitted: int = 0  # tokens this round added to the output (accepted + 1 unless truncated)
    draft_s: float = 0.0
    verify_s: float = 0.0


@dataclass
class GenerationResult:
    token_ids: list[int]  # new tokens only (the first one comes from the prefill)
    rounds: list[RoundStats]
    finish_reason: str  # "stop" (a stop token, kept as last token) | "length" (max_new_tokens)
    wall_s: float
    prompt_len: int = 0
    prefill_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.wall_s if self.wall_s > 0 else 0.0


def _check_inputs(target, prompt_ids, max_new_tokens: int, lookahead: int) -> list[int]:
    ids = prompt_ids.tolist() if isinstance(prompt_ids, Tensor) else list(prompt_ids)
    if not ids:
        raise ValueError("prompt_ids is empty: give at least one prompt token (e.g. a BOS or chat-template ids)")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    limit = getattr(target, "max_positions", None)
    if limit and len(ids) + max_new_tokens + lookahead > limit:
        raise ValueError(f"prompt ({len(ids)}) + max_new_tokens ({max_new_tokens}) + lookahead ({lookahead}) "
                         f"exceeds the target's {limit} positions; shorten the prompt or lower max_new_tokens")
    return ids


def _keep(new: list[int], produced: int, max_new_tokens: int, stops: set[int]) -> tuple[list[int], str | None]:
    """Truncate a round's new tokens at the first stop token (kept) or at the token limit."""
    for i, tok in enumerate(new):
        if produced + i + 1 > max_new_tokens:
            return new[:i], "length"
        if tok in stops:
            return new[: i + 1], "stop"
    return new, ("length" if produced + len(new) >= max_new_tokens else None)


def _stop_set(target, stop_ids: Sequence[int] | None) -> set[int]:
    return set(target.eos_token_ids if stop_ids is None else stop_ids)


def _prefill(seq, ids: list[int], layer_ids, sp: SamplingParams, generator):
    """Run the prompt through the target into `seq`; returns (features [T, m*d] | None, first token). On a compiled
    core a prompt of at most COMPILED_MAX_TOKENS tokens is one replay of its token bucket's graph (the verify
    steps' graphs: eager, a short prompt's prefill is host-bound on a GPU, ~2,000 operators for any length);
    longer prompts run eager (compute-bound: no graph per prompt length)."""
    out = seq.extend(ids, layer_ids or (), logits="last")
    first = int(sample(to_probs(out.logits[0, -1], sp), generator))
    return (out.features[0] if out.features is not None else None), first


def new_draft_state(drafter, kv):
    """drafter.new_state(), its passes captured (a DraftState's `captured`) where the requests' decoding core
    (`kv`: a CoreSequence or CoreSlots; the ragged store has none) is compiled, else eager."""
    state = drafter.new_state()
    if hasattr(state, "captured"):
        state.captured = getattr(getattr(kv, "core", None), "mode", None) == "compiled"
        if state.captured:  # a slot for each of the core's sequences, up front (no regrow as the batch fills)
            drafter.reserve_capture_slots(kv.core.slots)
    return state


def drafter_layer_ids(drafter) -> list[int]:
    """The target layers whose hidden states the drafter reads as context features."""
    ids = drafter.config.target_layer_ids or drafter.target_meta.get("layer_ids")
    if not ids:
        raise ValueError("drafter has no target layer ids (config.target_layer_ids / target_meta['layer_ids']); "
                         "build it with build_drafter(cfg, target) or load_drafter(path, target)")
    return list(ids)


@torch.no_grad()
def speculative_generate(target, drafter, prompt_ids, sp: SamplingParams, max_new_tokens: int,
                         stop_ids: Sequence[int] | None = None, verify_len: VerifyLen | None = None,
                         generator: torch.Generator | None = None, gamma: int | None = None,
                         core_mode: str | None = None) -> GenerationResult:
    """Lossless speculative decoding of one prompt. stop_ids None -> target.eos_token_ids ([] = none).
    gamma defaults to the drafter's block size. core_mode: the decoding core's mode (auto | compiled |
    eager; default DSPARK_DECODE_CORE, see dspark.decoding.kv_sequence)."""
    gamma = gamma or drafter.config.block_size
    return generate_rounds(target, drafter, prompt_ids, sp, max_new_tokens, stop_ids, generator, gamma,
                           lambda state, seq, anchor, round_idx, layer_ids: _round(
                               target, drafter, state, seq, anchor, gamma, sp, generator, verify_len, round_idx,
                               layer_ids), core_mode)


RoundFn = Callable[[object, object, int, int, list], tuple]


def generate_rounds(target, drafter, prompt_ids, sp: SamplingParams, max_new_tokens: int,
                    stop_ids: Sequence[int] | None, generator, gamma: int, one_round: RoundFn,
                    core_mode: str | None = None) -> GenerationResult:
    """The decoding loop of chain and tree rounds: prefill, then `one_round(state, seq, anchor, round_idx,
    layer_ids)` (seq: the target's KV sequence, dspark.decoding.kv_sequence) -> (stats, new tokens, features and ids of the positions to add to the drafter's context)
    until a stop token or the token budget."""
    ids = _check_inputs(target, prompt_ids, max_new_tokens, gamma + 1)
    stops, layer_ids = _stop_set(target, stop_ids), drafter_layer_ids(drafter)
    start = time.perf_counter()
    seq = open_sequence(target, core_mode)
    features, anchor = _prefill(seq, ids, layer_ids, sp, generator)
    state = new_draft_state(drafter, seq)
    drafter.extend_context(state, features, torch.tensor(ids, device=features.device))
    tokens, rounds = [anchor], []
    finish = "stop" if anchor in stops else ("length" if max_new_tokens == 1 else None)
    prefill_s = time.perf_counter() - start
    while finish is None:
        stats, new, features, anchor_ids = one_round(state, seq, anchor, len(rounds), layer_ids)
        kept, finish = _keep(new, len(tokens), max_new_tokens, stops)
        stats.emitted = len(kept)
        tokens += kept
        rounds.append(stats)
        anchor = new[-1]
        if finish is None:
            drafter.extend_context(state, features, anchor_ids)  # verified, accepted positions only
    return GenerationResult(tokens, rounds, finish, time.perf_counter() - start, len(ids), prefill_s)


def _round(target, drafter, state, seq, anchor: int, gamma: int, sp, generator, verify_len, round_idx, layer_ids):
    """One draft-verify cycle. Returns (stats, new tokens, features and ids of the positions to add to
    the drafter context). Crops the target's sequence to [.. anchor, accepted drafts]."""
    t0 = time.perf_counter()
    proposal = drafter.propose(state, anchor, gamma, sp, generator)
    t1 = time.perf_counter()
    proposed = int(proposal.tokens.shape[0])
    n = proposed if verify_len is None else int(verify_len(round_idx, proposal))
    if not 0 <= n <= proposed:
        raise ValueError(f"verify_len returned {n}; it must be in [0, {proposed}] (the number of proposed drafts)")
    drafts = proposal.tokens[:n].to(target.device)
    base = seq.length
    verify_ids = torch.cat([torch.tensor([anchor], device=target.device), drafts])
    out = seq.extend(verify_ids, layer_ids, logits="all")
    target_probs = to_probs(out.logits[0], sp)  # row k scores draft k+1; row n is the bonus distribution
    n_acc, next_token = accept_drafts(drafts, proposal.probs[:n].to(target.device), target_probs, generator)
    seq.crop(base + 1 + n_acc)
    conf = proposal.confidences.tolist() if getattr(proposal, "confidences", None) is not None else None
    stats = RoundStats(proposed=proposed, verified=n, accepted=n_acc,
                       outcomes=[True] * n_acc + ([False] if n_acc < n else []), confidences=conf,
                       draft_s=t1 - t0, verify_s=time.perf_counter() - t1)
    new = drafts[:n_acc].tolist() + [next_token]
    return stats, new, out.features[0, : 1 + n_acc], verify_ids[: 1 + n_acc]


@torch.no_grad()
def target_generate(target, prompt_ids, sp: SamplingParams, max_new_tokens: int,
                    stop_ids: Sequence[int] | None = None, generator: torch.Generator | None = None,
                    core_mode: str | None = None) -> GenerationResult:
    """Target-only decoding with the same sampling and KV sequence (one round per token, nothing drafted)."""
    ids = _check_inputs(target, prompt_ids, max_new_tokens, 1)
    stops = _stop_set(target, stop_ids)
    start = time.perf_counter()
    seq = open_sequence(target, core_mode)
    _, token = _prefill(seq, ids, None, sp, generator)
    tokens, rounds = [token], []
    finish = "stop" if token in stops else ("length" if max_new_tokens == 1 else None)
    prefill_s = time.perf_counter() - start
    while finish is None:
        t0 = time.perf_counter()
        out = seq.extend([token], logits="last")
        token = int(sample(to_probs(out.logits[0, -1], sp), generator))
        tokens.append(token)
        rounds.append(RoundStats(0, 0, 0, [], None, emitted=1, verify_s=time.perf_counter() - t0))
        finish = "stop" if token in stops else ("length" if len(tokens) >= max_new_tokens else None)
    return GenerationResult(tokens, rounds, finish, time.perf_counter() - start, len(ids), prefill_s)
