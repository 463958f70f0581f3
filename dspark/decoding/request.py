"""What the engine (dspark.decoding.engine) keeps per request and reports per step: `Request` (the
handle `Engine.submit` returns, with its live decoding state), its `RequestStats` and `TokenLogprob`s,
the `StepReport` of one step, and the errors `submit` raises when it cannot queue a request.
"""
from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from dspark.decoding.counter_random import CounterStream
from dspark.decoding.sampling import KeyedNoise, SamplingParams


class QueueFullError(RuntimeError):
    """The waiting queue is full: retry later (HTTP 429)."""


class EngineUnavailableError(RuntimeError):
    """The engine is stopped or unhealthy (HTTP 503)."""


@dataclass
class RequestStats:
    rounds: int = 0  # verify rounds (the prefill is not a round)
    proposed: int = 0  # draft tokens proposed
    verified: int = 0  # draft tokens sent to the target
    accepted: int = 0  # draft tokens accepted
    # per draft position k (0-based): rounds that verified / accepted a draft there (flywheel metrics)
    verified_per_pos: list[int] = field(default_factory=list)
    accepted_per_pos: list[int] = field(default_factory=list)

    def add_round(self, proposed: int, verified: int, accepted: int) -> None:
        """Count one verify round. Position k was verified in it iff k < verified, accepted iff k < accepted."""
        self.rounds, self.proposed = self.rounds + 1, self.proposed + proposed
        self.verified, self.accepted = self.verified + verified, self.accepted + accepted
        for counts, n in ((self.verified_per_pos, verified), (self.accepted_per_pos, accepted)):
            counts.extend([0] * (n - len(counts)))
            for k in range(n):
                counts[k] += 1

    @property
    def drafting_rounds(self) -> int:
        """Rounds that verified at least one draft (vLLM's num_drafts): position 0 was verified in them."""
        return self.verified_per_pos[0] if self.verified_per_pos else 0

    def spec_decode(self) -> dict:
        """OpenAI-response `spec_decode` object; mean_accepted_length = τ = (accepted + rounds) / rounds."""
        tau = (self.accepted + self.rounds) / self.rounds if self.rounds else None
        return {"rounds": self.rounds, "draft_tokens_proposed": self.proposed, "draft_tokens_verified": self.verified,
                "draft_tokens_accepted": self.accepted, "mean_accepted_length": tau}


Listener = Callable[["Request", list[int], bool], None]  # (request, new tokens, finished)


@dataclass
class TokenLogprob:
    """The target's log-probability of one emitted token and the `top` most likely alternatives
    [(token id, logprob)], best first (EngineConfig.logprobs_mode says of which distribution)."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(eq=False)
class Request:
    """A generation request and its live state (the handle `submit` returns)."""

    prompt_ids: list[int]
    sampling: SamplingParams
    max_new_tokens: int
    stop_ids: frozenset[int]
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    listener: Listener | None = None
    seed: int | None = None  # None: drawn from the engine's seed stream
    logprobs: int | None = None  # None: no logprobs; k: each token's logprob and its top-k alternatives
    tokens: list[int] = field(default_factory=list)
    token_logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token (when logprobs is set)
    finish_reason: str | None = None  # "stop" | "length" | "error" | "cancelled"
    error: str | None = None
    stats: RequestStats = field(default_factory=RequestStats)
    submitted_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False
    # engine-private
    slot: int = -1
    generator: CounterStream | None = None  # this request's own uniforms (see dspark.decoding.engine's docstring)
    key_seed: int = 0  # its seed, or the one drawn for it: keys its target-only tokens (engine without a drafter)
    noise: KeyedNoise | None = None  # position-keyed randomness of a seeded request (seeded_sampling=keyed)
    constraint: object = None  # dspark.decoding.constraint.TokenConstraint: structured output (grammar)
    draft_state: object = None
    ctx_pending: list = field(default_factory=list)  # (features, token ids) of verified positions the drafter has not read yet
    proposal: object = None
    verify_len: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def anchor(self) -> int:
        return self.tokens[-1]

    def drafts_on_host(self, ids) -> list[int]:
        """The drafts this step verifies (ids[1:] of its verify row) as host ints: the proposal's, read to the host
        with the whole batch's when drafted (`split_proposals`), else read now."""
        host = getattr(self.proposal, "host_tokens", None)
        return ids[1:].tolist() if host is None else host[:self.verify_len]

    def wait(self, timeout: float | None = None) -> "Request":
        if not self.done.wait(timeout):
            raise TimeoutError(f"request {self.id} did not finish within {timeout} s")
        return self


@dataclass
class StepReport:
    """What one step did (for logs and metrics)."""

    admitted: int = 0
    prefill_tokens: int = 0
    rows: int = 0  # requests verified in the batched forward
    batch_tokens: int = 0  # B = Σ (1 + ℓ_r)
    proposed: int = 0
    verified: int = 0
    accepted: int = 0
    expected_accepted: float | None = None  # Σ a_{r,j} (prefix survival of the confidences) over the verified drafts
    emitted: int = 0
    finished: int = 0
    failed: int = 0
    prefill_s: float = 0.0  # step start through the newcomers' prefill (admission included: the forward dominates)
    draft_s: float = 0.0  # drafter time: the context catch-up and propose_batch
    catch_up_s: float = 0.0  # drafter context catch-up, whether before drafting or overdue (`_catch_up`)
    gate_draft_s: float = 0.0  # what the draft gate weighs: draft_s less the catch-up backlog of skipped steps
    verify_s: float = 0.0
    step_s: float = 0.0
    catch_up_tokens: int = 0  # verified positions the drafter context read this step (lazy catch-up)
    verify_lens: list[int] = field(default_factory=list)
    drafted: bool = False  # False: mode off, or the draft gate judged a target-only step faster
    drafted_rows: int = 0  # requests drafted this step (all, or the draft gate's exploration sample)
