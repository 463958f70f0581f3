"""Continuous-batching draft-plus-verify engine (no Ray; dspark/serve/ puts it behind HTTP).

(Over 400 lines on purpose: one step's admission, drafting, ragged verify and acceptance share the
engine's slot state; split apart, each piece would need that state passed around.)

One engine holds the frozen target, one drafter (its STS calibration travels with it) and the active
requests. Each `step()`:
  1. admits waiting requests (bounded queue) and prefills them in one ragged target forward; the
     first token of each comes from the prefill, the drafter context gets the prompt's features;
  2. drafts γ tokens for every active request (`drafter.propose_batch`);
  3. picks a verify length ℓ_r per request with the scheduler (dspark.decoding.scheduler: dynamic = Algorithm 1
     over the SPS table profiled at start, threshold, fixed, off);
  4. verifies [anchor_r, drafts_r[:ℓ_r]] of ALL requests in ONE target forward: tokens are flattened
     into one row and each request attends to its own KV slot (dspark.decoding.batched_cache);
  5. accepts losslessly per request (`accept_drafts`), keeps the accepted prefix in the KV slot, queues
     its target features for the drafter context, emits the new tokens; finished requests leave, their
     slots are recycled.
The drafter context is caught up lazily: the target features of verified positions wait in
`Request.ctx_pending` and the drafter reads them, for all requests in one `extend_contexts` pass, just
before it next drafts (or when `context_catch_up_every` steps have piled up, which bounds the memory held).
So a step where the draft gate skips drafting does the same work as mode `off` (plus keeping the
features, which the target forward returns anyway), and a drafter that is rarely used costs nothing
on the steps it sits out.
Requests join and leave between steps. A request whose drafting, verification or acceptance fails
is finished with an error; the others continue. `healthy` turns False when steps keep failing.

Losslessness: every row is exactly batch-1 speculative decoding (dspark.decoding.specdec) with a verify length
that is non-anticipating (the scheduler's modes guarantee it; Appendix A), and the ragged forward
computes the same logits as a per-request forward with a KV cache.

Randomness: every request draws from its own torch.Generator (on the target's device), seeded with
the request's `seed` or, without one, from the engine's seed stream (EngineConfig.seed). Its prefill
sample, its drafts and its acceptance draws come from that generator only, so a request's random
draws never depend on the other requests in the batch; but how many draws a round consumes depends
on its verify length, which the dynamic/async_topk schedulers and the draft gate choose over the
whole batch. So a request with a `seed` uses, by default (EngineConfig.seeded_sampling="keyed"),
position-keyed randomness instead (`dspark.decoding.sampling.KeyedNoise`): the token at output position j is
the target's Gumbel-max sample with noise keyed by (seed, j), whatever was drafted or verified, so a
seeded request's output depends on its seed, prompt and settings alone (up to floating-point
differences of the batched forward), under any load and scheduler — and stays exactly lossless.
("stream": seeded requests use the stream too, and repeat only under the same load.)

Logprobs: a request asking for them (`logprobs` = number of alternatives, 0..) gets, per emitted
token, the target's log-probability of it and the top alternatives, from the same verify-forward
logits the token was accepted or drawn from (`dspark.decoding.sampling.to_logprobs`, EngineConfig.logprobs_mode).

Invariant between steps, for each active request r in slot r: KV length == drafter context length +
positions in ctx_pending == len(prompt) + len(tokens) - 1 (everything but the anchor, tokens[-1]);
right after a catch-up ctx_pending is empty, so the drafter drafts from the full verified context.
"""
from __future__ import annotations

import logging
import math
import random
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Literal, Sequence

import torch
from pydantic import Field

from dspark.decoding.batched_cache import KVSlots, enable_ragged
from dspark.config import StrictModel
from dspark.decoding.sampling import (KeyedNoise, LogprobsMode, SamplingParams, accept_drafts, accept_keyed, sample,
                                      to_logprobs, to_probs)
from dspark.decoding.scheduler import DraftGate, PrefixScheduler, SchedulerConfig, SPSTable, profile_sps
from dspark.decoding.specdec import _keep, drafter_layer_ids

log = logging.getLogger("dspark.decoding.engine")


class EngineConfig(StrictModel):
    scheduler: SchedulerConfig = Field(default_factory=lambda: SchedulerConfig(mode="dynamic"), description="which drafts each step verifies")
    gamma: int | None = Field(None, description="drafts proposed per round (None = the drafter's block size)")
    max_batch: int = Field(32, description="active requests per step")
    max_waiting: int = Field(128, description="queued requests beyond which submit() rejects (HTTP 429)")
    max_model_len: int = Field(2048, description="prompt + max_new_tokens + γ + 1 must fit (capped by the target)")
    max_prefill_tokens: int = Field(4096, description="prompt tokens admitted per step (at least one request always)")
    sps_batch_sizes: list[int] = Field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64, 128, 256], description="verify batch sizes (tokens) profiled for the SPS table at start")
    sps_context: int = Field(128, description="cached context per row while profiling")
    sps_repeats: int = Field(3, description="timed forwards per profiled batch size")
    sps_table: dict[int, float] | None = Field(None, description="given table: skip profiling (tests, or a saved profile)")
    seed: int | None = Field(0, description="seeds the generators of requests without a seed of their own (None = nondeterministic)")
    max_consecutive_failures: int = Field(3, description="failed steps in a row before the engine reports unhealthy")
    seeded_sampling: Literal["keyed", "stream"] = Field("keyed", description=(
        "randomness of requests that carry a seed: keyed = noise keyed by (seed, output position) with a "
        "Gumbel-max coupling of draft and target (output independent of the batch and scheduler; "
        "acceptance P(draft == target sample) instead of Σ min(p, q)); stream = the request's generator "
        "stream like unseeded requests (the same output only under the same load)"))
    logprobs_mode: LogprobsMode = Field("processed", description=(
        "which distribution reported logprobs come from: processed = the one the token is drawn from "
        "(temperature, min_p, top_k, top_p applied; raw at temperature 0); raw = log_softmax of the target's "
        "logits (vLLM's default)"))
    context_catch_up_every: int = Field(64, ge=1, description="steps of target features a request may hold for its drafter before the drafter reads them even without drafting (bounds memory while the draft gate skips; the drafter always catches up before it drafts)")


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
    generator: torch.Generator | None = None  # this request's own RNG (see the module docstring)
    noise: KeyedNoise | None = None  # position-keyed randomness of a seeded request (seeded_sampling=keyed)
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
    emitted: int = 0
    finished: int = 0
    failed: int = 0
    draft_s: float = 0.0  # drafter time: the context catch-up and propose_batch (what the draft gate weighs)
    verify_s: float = 0.0
    step_s: float = 0.0
    catch_up_tokens: int = 0  # verified positions the drafter context read this step (lazy catch-up)
    verify_lens: list[int] = field(default_factory=list)
    drafted: bool = False  # False: mode off, or the draft gate judged a target-only step faster


class Engine:
    """Continuous-batching speculative decoding over one target and one drafter (None for mode off)."""

    def __init__(self, target, drafter=None, cfg: EngineConfig | None = None):
        self.cfg = cfg or EngineConfig()
        self.target, self.drafter = target, drafter
        self.mode = self.cfg.scheduler.mode
        self.drafting = self.mode != "off"
        self.gamma = self._check_drafter()
        self.layer_ids = drafter_layer_ids(drafter) if self.drafting else None
        self.max_model_len = min(self.cfg.max_model_len, getattr(target, "max_positions", self.cfg.max_model_len))
        enable_ragged(target.model)
        # Device invariant: KV slots, the request RNGs and every tensor a step creates live on
        # target.device (the drafter sits there too); sampling moves probabilities to the generator's
        # device, never back.
        self.kv = KVSlots(target.device, target.dtype)
        self._seeds = random.Random(self.cfg.seed)  # seeds of requests that bring none (None: OS entropy)
        self.sps: SPSTable | None = None
        if self.mode in ("dynamic", "async_topk"):
            self.sps = self._sps_table()
        self.scheduler = PrefixScheduler(self.cfg.scheduler, self.sps)
        gate_on = self.cfg.scheduler.draft_gate and self.sps is not None and self.drafting
        self.gate = DraftGate(self.sps, self.cfg.scheduler.draft_gate_explore_every) if gate_on else None
        self.active: list[Request] = []  # active[i].slot == i
        self.waiting: deque[Request] = deque()
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._thread: threading.Thread | None = None
        self._stop = False
        self.healthy, self.health_error = True, None
        self._failures_in_a_row = 0
        self.step_listeners: list[Callable[[StepReport], None]] = []
        self.totals = dict(submitted=0, rejected=0, finished=0, failed=0, cancelled=0, steps=0, rounds=0,
                           prompt_tokens=0, generated_tokens=0, proposed=0, verified=0, accepted=0,
                           batch_tokens=0, busy_s=0.0, draft_skipped_steps=0)
        self.started_at = time.time()

    # ---- setup -------------------------------------------------------------------------------
    def _check_drafter(self) -> int:
        if not self.drafting:
            return 0
        d = self.drafter
        if d is None:
            raise ValueError(f"scheduler mode {self.mode!r} needs a drafter; pass one or use mode 'off'")
        if self.mode in ("dynamic", "threshold", "async_topk") and not d.has_confidences:
            raise ValueError(f"scheduler mode {self.mode!r} needs draft confidences, but this "
                             f"{d.config.algo} drafter has no confidence head; use mode fixed/off or a DSpark drafter")
        gamma = self.cfg.gamma or d.config.block_size
        d.check_gamma(gamma)
        return gamma

    def _sps_table(self) -> SPSTable:
        if self.cfg.sps_table:
            table = SPSTable(dict(self.cfg.sps_table))
            log.info("SPS table (given): %s", _fmt_table(table))
            return table
        t0 = time.perf_counter()
        table = profile_sps(self._profile_forward(), self.cfg.sps_batch_sizes, repeats=self.cfg.sps_repeats,
                            sync=self._device_sync())
        log.info("SPS table profiled in %.1f s (B: verify steps/s): %s", time.perf_counter() - t0, _fmt_table(table))
        return table

    def _profile_forward(self) -> Callable[[int], None]:
        """B -> one ragged verify forward of B tokens split evenly over ceil(B/(γ+1)) rows, each row
        with `sps_context` cached positions (the shape of a real verify step)."""
        device = self.target.device
        scratch = KVSlots(device, self.target.dtype)
        context = self.cfg.sps_context
        gen = torch.Generator(device=device).manual_seed(0)

        def forward(batch: int) -> None:
            rows = max(1, math.ceil(batch / (self.gamma + 1)))
            counts = [batch // rows + (1 if r < batch % rows else 0) for r in range(rows)]
            while scratch.used < rows:
                scratch.set_length(scratch.allocate(), context)
            ids = torch.randint(0, self.target.vocab_size, (1, batch), generator=gen, device=device)
            self._ragged_forward(scratch, 0, ids, counts, logits_at="all")

        return forward

    def _device_sync(self) -> Callable[[], None] | None:
        """CUDA runs asynchronously: SPS timings must wait for the kernels (None on cpu)."""
        device = self.target.device
        return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None

    # ---- public API --------------------------------------------------------------------------
    def submit(self, prompt_ids: Sequence[int], sampling: SamplingParams | None = None, max_new_tokens: int = 64,
               stop_ids: Sequence[int] | None = None, listener: Listener | None = None,
               request_id: str | None = None, seed: int | None = None, logprobs: int | None = None) -> Request:
        """Queue a request (thread-safe). Raises ValueError for bad input, QueueFullError when the queue
        is full, EngineUnavailableError when the engine cannot serve. stop_ids None = the target's EOS.
        seed: the request's own seed (None: one from the engine's seed stream; with a seed and
        seeded_sampling=keyed, position-keyed randomness). logprobs: None = none; k >= 0 = each emitted
        token's logprob and its k most likely alternatives (`Request.token_logprobs`)."""
        if logprobs is not None and not 0 <= logprobs <= self.target.vocab_size:
            raise ValueError(f"logprobs must be in [0, {self.target.vocab_size}], got {logprobs}")
        self.check_request(len(prompt_ids), max_new_tokens)
        if seed is not None and not -2**63 <= seed < 2**64:
            raise ValueError(f"seed must be in [-2**63, 2**64), got {seed}")
        ids = [int(t) for t in prompt_ids]
        if min(ids) < 0 or max(ids) >= self.target.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.target.vocab_size}), got min {min(ids)} "
                             f"max {max(ids)}")
        stops = frozenset(self.target.eos_token_ids if stop_ids is None else stop_ids)
        req = Request(ids, sampling or SamplingParams(), int(max_new_tokens), stops, listener=listener, seed=seed,
                      logprobs=logprobs, **({"id": request_id} if request_id else {}))
        if seed is not None and self.cfg.seeded_sampling == "keyed":
            req.noise = KeyedNoise(seed, self.target.vocab_size, self.target.device,
                                   getattr(self.drafter, "draft_ids", None) if self.drafting else None)
        with self._lock:
            if not self.healthy or self._stop:
                raise EngineUnavailableError(f"engine cannot serve: {self.health_error or 'stopped'}")
            if len(self.waiting) >= self.cfg.max_waiting:
                self.totals["rejected"] += 1
                raise QueueFullError(f"engine queue is full ({self.cfg.max_waiting} waiting); retry later")
            req.generator = torch.Generator(device=self.target.device).manual_seed(
                seed if seed is not None else self._seeds.getrandbits(63))
            self.waiting.append(req)
            self.totals["submitted"] += 1
        self._wakeup.set()
        return req

    def check_request(self, prompt_len: int, max_new_tokens: int) -> None:
        """Raise ValueError (naming prompt or max_new_tokens) when a request cannot fit the context."""
        if prompt_len < 1:
            raise ValueError("prompt is empty: give at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        room = self.max_model_len - (self.gamma + 1)
        if prompt_len >= room:
            raise ValueError(f"prompt has {prompt_len} tokens; the context holds {self.max_model_len} "
                             f"(at most {room - 1} prompt tokens); shorten the prompt")
        if prompt_len + max_new_tokens > room:
            raise ValueError(f"prompt ({prompt_len}) + max_new_tokens ({max_new_tokens}) exceeds the context of "
                             f"{self.max_model_len} (minus {self.gamma + 1} for drafting); lower max_new_tokens "
                             f"to <= {room - prompt_len}")

    def cancel(self, req: Request) -> None:
        """Stop a request at the next step boundary (e.g. its client went away)."""
        req.cancelled = True
        self._wakeup.set()

    def has_work(self) -> bool:
        return bool(self.active or self.waiting)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams | None = None,
                 max_new_tokens: int = 64, stop_ids: Sequence[int] | None = None,
                 seeds: Sequence[int | None] | None = None, logprobs: int | None = None) -> list[Request]:
        """Offline helper: run all prompts through the engine in this thread (no background loop).
        seeds: one per prompt (None entries: from the engine's seed stream)."""
        pending, out = deque(zip(prompts, seeds if seeds is not None else [None] * len(prompts))), []
        while pending or self.has_work():
            while pending and len(self.waiting) < self.cfg.max_waiting:
                prompt, seed = pending.popleft()
                out.append(self.submit(prompt, sampling, max_new_tokens, stop_ids, seed=seed, logprobs=logprobs))
            self.step()
        return out

    # ---- background loop ---------------------------------------------------------------------
    def start(self) -> "Engine":
        if self._thread is None:
            self._stop = False
            self._thread = threading.Thread(target=self._loop, name="dspark-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self._fail_all("engine stopped", reason="cancelled")

    def _loop(self) -> None:
        while not self._stop:
            if not self.has_work():
                self._wakeup.wait(0.1)
                self._wakeup.clear()
                continue
            try:
                self.step()
                self._failures_in_a_row = 0
            except Exception as err:  # a step-level failure: requests in flight cannot be trusted
                self._failures_in_a_row += 1
                log.exception("engine step failed (%d in a row)", self._failures_in_a_row)
                self._fail_all(f"engine step failed: {err}")
                if self._failures_in_a_row >= self.cfg.max_consecutive_failures:
                    self.healthy, self.health_error = False, f"{self._failures_in_a_row} failed steps in a row: {err}"
                    log.error("engine marked unhealthy: %s", self.health_error)
                    return

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- one step ----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> StepReport:
        t0 = time.perf_counter()
        report = StepReport()
        self._retire()  # requests cancelled since the last step
        newcomers = self._admit()
        if newcomers:
            self._prefill(newcomers, report)
            self._retire()
        if self.active:
            drafted = self.drafting and (self.gate is None or self.gate.should_draft(len(self.active)))
            if drafted:
                self._draft(report)  # catches the drafter context up first
                self._retire()
            if self.active:
                self._verify(report)
                self._catch_up_overdue(report)
                self._retire()
            if drafted and self.gate is not None:
                self.gate.observe(report.rows, report.draft_s, report.verified, report.accepted)
            report.drafted = drafted
        report.step_s = time.perf_counter() - t0
        self._account(report)
        return report

    def _admit(self) -> list[Request]:
        newcomers, budget = [], self.cfg.max_prefill_tokens
        with self._lock:
            while self.waiting and len(self.active) < self.cfg.max_batch:
                req = self.waiting[0]
                if newcomers and len(req.prompt_ids) > budget:
                    break
                self.waiting.popleft()
                if req.cancelled:
                    self._finish(req, "cancelled")
                    continue
                budget -= len(req.prompt_ids)
                req.slot = self.kv.allocate()
                self.active.append(req)
                newcomers.append(req)
        return newcomers

    def _prefill(self, newcomers: list[Request], report: StepReport) -> None:
        """One ragged forward over the newcomers' prompts: first token, KV slot, drafter context."""
        report.admitted, report.prefill_tokens = len(newcomers), sum(len(r.prompt_ids) for r in newcomers)
        rows = [torch.tensor(r.prompt_ids, device=self.target.device) for r in newcomers]
        outputs = self._forward_rows(newcomers, rows, "last", report)
        for req, ids, out in zip(newcomers, rows, outputs):
            if req.finished:
                continue
            try:
                logits, features = out
                if self.drafting:
                    req.draft_state = self.drafter.new_state()
                    req.ctx_pending = [(features, ids)]  # read when the request first drafts
                self.kv.set_length(req.slot, len(req.prompt_ids))
                probs = to_probs(logits[-1], req.sampling)
                token = int(req.noise.argmax(probs[None], [0])[0]) if req.noise else int(sample(probs, req.generator))
                self._emit(req, [token], report, logits[-1:])
            except Exception as err:
                self._fail(req, f"prefill failed: {err}", report)

    def _draft(self, report: StepReport) -> None:
        """γ drafts per active request in one propose_batch call (per-request retry isolates a failure)."""
        t0 = time.perf_counter()
        self._catch_up(self.active, report)
        reqs = [r for r in self.active if not r.finished]
        args = ([r.draft_state for r in reqs], [r.anchor for r in reqs], self.gamma, [r.sampling for r in reqs])
        for r in reqs:
            if r.noise is not None:
                r.noise.cursor = len(r.tokens)  # draft k (from 0) is for output position len(tokens) + k
        try:
            proposals = self.drafter.propose_batch(*args, [r.noise or r.generator for r in reqs])
        except Exception:
            log.warning("propose_batch failed; drafting request by request to isolate the failure", exc_info=True)
            proposals = []
            for r in reqs:
                try:
                    if r.noise is not None:
                        r.noise.cursor = len(r.tokens)
                    proposals.append(self.drafter.propose(r.draft_state, r.anchor, self.gamma, r.sampling,
                                                          r.noise or r.generator))
                except Exception as err:
                    proposals.append(None)
                    self._fail(r, f"drafting failed: {err}", report)
        for r, p in zip(reqs, proposals):
            r.proposal = p
        report.draft_s = time.perf_counter() - t0

    def _catch_up_overdue(self, report: StepReport) -> None:
        """Catch up requests holding `context_catch_up_every` steps of features (bounds the memory the
        pending features pin while the gate keeps skipping; amortised, it is 1/N of a catch-up per step)."""
        if self.drafting:
            every = self.cfg.context_catch_up_every
            self._catch_up([r for r in self.active if len(r.ctx_pending) >= every], report)

    def _catch_up(self, reqs: list[Request], report: StepReport) -> None:
        """Feed the requests' pending target features to their drafter contexts: all verified positions
        since each one's last catch-up, in order, in ONE `extend_contexts` pass over the requests (a
        failure is retried request by request, so only a failing request fails)."""
        todo = []
        for r in reqs:
            pending, r.ctx_pending = r.ctx_pending, []
            if not pending or r.finished:
                continue
            if len(pending) == 1:
                todo.append((r, *pending[0]))
            else:
                todo.append((r, torch.cat([f for f, _ in pending]), torch.cat([i for _, i in pending])))
        if not todo:
            return
        before = [r.draft_state.length for r, _, _ in todo]
        try:
            self.drafter.extend_contexts([r.draft_state for r, _, _ in todo], [f for _, f, _ in todo],
                                         [i for _, _, i in todo])
        except Exception:
            log.warning("extend_contexts failed; catching up request by request to isolate the failure", exc_info=True)
            for (r, features, ids), length in zip(todo, before):
                if r.draft_state.length != length:  # this one was extended before the failure
                    continue
                try:
                    self.drafter.extend_context(r.draft_state, features, ids)
                except Exception as err:
                    self._fail(r, f"drafter context update failed: {err}", report)
        report.catch_up_tokens += sum(int(i.shape[0]) for r, _, i in todo if not r.finished)

    def _schedule(self) -> list[int]:
        proposals = [r.proposal for r in self.active]
        if not self.drafting or any(p is None for p in proposals):  # mode off, or the gate skipped drafting
            return [0] * len(self.active)
        confidences = [p.confidences.tolist() if p.confidences is not None else None for p in proposals]
        return self.scheduler.schedule(confidences, [int(p.tokens.shape[0]) for p in proposals])

    def _verify(self, report: StepReport) -> None:
        """Score [anchor, drafts[:ℓ]] of every active request in one forward; accept per request."""
        t0 = time.perf_counter()
        lengths = self._schedule()
        device = self.target.device
        rows = []
        for req, n in zip(self.active, lengths):
            req.verify_len = n
            drafts = req.proposal.tokens[:n].to(device) if n else torch.empty(0, dtype=torch.long, device=device)
            rows.append(torch.cat([torch.tensor([req.anchor], device=device), drafts]))
        report.rows, report.batch_tokens = len(rows), sum(len(r) for r in rows)
        report.verify_lens = list(lengths)
        outputs = self._forward_rows(self.active, rows, "all", report)
        for req, ids, out in zip(list(self.active), rows, outputs):
            if req.finished:
                continue
            try:
                self._accept(req, ids, *out, report)
            except Exception as err:
                self._fail(req, f"verification failed: {err}", report)
        report.verify_s = time.perf_counter() - t0

    def _accept(self, req: Request, ids: torch.Tensor, logits: torch.Tensor, features, report: StepReport) -> None:
        n = req.verify_len
        target_probs = to_probs(logits, req.sampling)  # row k scores draft k+1; row n is the bonus
        if req.noise is not None:  # row k is output position len(tokens) + k (tokens[-1], the anchor, is before)
            n_acc, next_token = accept_keyed(ids[1:], target_probs, req.noise, len(req.tokens))
            req.noise.forget_before(len(req.tokens) + n_acc + 1)
        else:
            draft_probs = req.proposal.probs[:n] if n else target_probs[:0]
            n_acc, next_token = accept_drafts(ids[1:], draft_probs.to(target_probs.device), target_probs,
                                              req.generator)
        self.kv.set_length(req.slot, self.kv.lengths[req.slot] + 1 + n_acc)  # anchor + accepted drafts
        if self.drafting:  # the drafter reads these when it next drafts (see _catch_up)
            req.ctx_pending.append((features[: 1 + n_acc], ids[: 1 + n_acc]))
        s = req.stats
        proposed = int(req.proposal.tokens.shape[0]) if req.proposal is not None else 0
        s.rounds, s.proposed, s.verified, s.accepted = s.rounds + 1, s.proposed + proposed, s.verified + n, \
            s.accepted + n_acc
        _count_positions(s, n, n_acc)
        report.proposed, report.verified, report.accepted = (report.proposed + proposed, report.verified + n,
                                                              report.accepted + n_acc)
        req.proposal = None
        self._emit(req, ids[1: 1 + n_acc].tolist() + [next_token], report, logits[: 1 + n_acc])

    # ---- the batched target forward -----------------------------------------------------------
    def _forward_rows(self, reqs: list[Request], rows: list[torch.Tensor], logits_at: str,
                      report: StepReport) -> list[tuple]:
        """Ragged forward over the requests' slots (contiguous, in order). Returns per row (logits,
        features). If the batch fails, each row is retried alone and only failing rows are failed."""
        first, counts = reqs[0].slot, [len(r) for r in rows]
        assert [r.slot for r in reqs] == list(range(first, first + len(reqs))), "slots must be contiguous"
        try:
            return self._ragged_forward(self.kv, first, torch.cat(rows)[None], counts, logits_at)
        except Exception:
            log.warning("batched target forward failed; retrying row by row to isolate the failure", exc_info=True)
        outputs = []
        for req, ids in zip(reqs, rows):
            try:
                outputs.append(self._ragged_forward(self.kv, req.slot, ids[None], [len(ids)], logits_at)[0])
            except Exception as err:
                outputs.append((None, None))
                self._fail(req, f"target forward failed: {err}", report)
        return outputs

    def _ragged_forward(self, store: KVSlots, first: int, ids: torch.Tensor, counts: list[int],
                        logits_at: str) -> list[tuple]:
        return ragged_forward(self.target, store, first, ids, counts, logits_at, self.layer_ids)

    # ---- emission and bookkeeping ---------------------------------------------------------------
    def _emit(self, req: Request, new: list[int], report: StepReport, logits: torch.Tensor | None = None) -> None:
        """Append the new tokens (up to a stop token or the limit); logits [len(new), V]: the target
        logits each was drawn or accepted from (for logprobs)."""
        kept, finish = _keep(new, len(req.tokens), req.max_new_tokens, req.stop_ids)
        if req.first_token_at is None:
            req.first_token_at = time.perf_counter()
        if req.logprobs is not None and kept:
            req.token_logprobs += self._logprobs(req, kept, logits[: len(kept)])
        req.tokens += kept
        report.emitted += len(kept)
        if finish:
            req.finish_reason = finish
            report.finished += 1
        self._notify(req, kept)

    def _logprobs(self, req: Request, tokens: list[int], logits: torch.Tensor) -> list[TokenLogprob]:
        lp = to_logprobs(logits, req.sampling, self.cfg.logprobs_mode)  # [n, V]
        chosen = lp.gather(-1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0].tolist()
        tops = [[] for _ in tokens]
        if req.logprobs:
            values, ids = lp.topk(min(req.logprobs, lp.shape[-1]), dim=-1)
            tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
        return [TokenLogprob(t, c, top) for t, c, top in zip(tokens, chosen, tops)]

    def _notify(self, req: Request, new: list[int]) -> None:
        if req.listener is not None:
            try:
                req.listener(req, new, req.finished)
            except Exception:
                log.exception("listener of request %s failed", req.id)

    def _fail(self, req: Request, message: str, report: StepReport | None) -> None:
        log.warning("request %s failed: %s", req.id, message)
        req.error = message
        req.finish_reason = "error"
        if report is not None:
            report.failed += 1

    def _finish(self, req: Request, reason: str) -> None:
        """Mark a request that is not (or no longer) in a slot as finished and wake its waiters."""
        if req.finish_reason is None:
            req.finish_reason = reason
        req.finished_at = time.perf_counter()
        key = {"error": "failed", "cancelled": "cancelled"}.get(req.finish_reason, "finished")
        self.totals[key] += 1
        if req.finish_reason in ("error", "cancelled"):
            self._notify(req, [])
        req.done.set()

    def _retire(self) -> None:
        """Remove finished (or cancelled) requests; keep slots contiguous (last slot moves into the hole)."""
        for slot in range(len(self.active) - 1, -1, -1):
            req = self.active[slot]
            if req.cancelled and not req.finished:
                req.finish_reason = "cancelled"
            if not req.finished:
                continue
            moved = self.kv.release(slot)
            last = self.active.pop()
            if moved is not None:
                last.slot = slot
                self.active[slot] = last
            req.slot, req.draft_state, req.proposal, req.generator, req.noise = -1, None, None, None, None
            req.ctx_pending = []
            self._finish(req, req.finish_reason)

    def _fail_all(self, message: str, reason: str = "error") -> None:
        with self._lock:
            pending = list(self.active) + list(self.waiting)
            self.waiting.clear()
        for req in pending:
            if not req.finished:
                req.error = message if reason == "error" else None
                req.finish_reason = reason
        self._retire()
        for req in pending:
            if not req.done.is_set():
                self._finish(req, reason)

    def _account(self, report: StepReport) -> None:
        t = self.totals
        t["steps"] += 1
        t["rounds"] += report.rows
        t["prompt_tokens"] += report.prefill_tokens
        t["generated_tokens"] += report.emitted
        for key in ("proposed", "verified", "accepted", "batch_tokens"):
            t[key] += getattr(report, key)
        t["busy_s"] += report.step_s
        t["draft_skipped_steps"] += int(self.drafting and report.rows > 0 and not report.drafted)
        for fn in self.step_listeners:
            try:
                fn(report)
            except Exception:
                log.exception("step listener failed")

    def stats(self) -> dict:
        """A JSON-able snapshot: totals, derived rates, queue, scheduler and SPS table."""
        t = dict(self.totals)
        rounds = t["rounds"] or 0
        return {
            "healthy": self.healthy, "health_error": self.health_error, "loop_alive": self.alive,
            "mode": self.mode, "gamma": self.gamma, "active": len(self.active), "waiting": len(self.waiting),
            "max_batch": self.cfg.max_batch, "max_waiting": self.cfg.max_waiting,
            "max_model_len": self.max_model_len, "uptime_s": time.time() - self.started_at,
            "totals": t,
            "mean_verify_budget": t["verified"] / rounds if rounds else None,  # drafts verified per request-round
            "mean_accepted_length": (t["accepted"] + rounds) / rounds if rounds else None,  # τ
            "mean_batch_tokens": t["batch_tokens"] / t["steps"] if t["steps"] else None,
            "tokens_per_busy_s": t["generated_tokens"] / t["busy_s"] if t["busy_s"] else None,
            "sps_table": self.sps.to_dict() if self.sps else None,
            "kv_bytes": self.kv.memory_bytes(), "device": str(self.target.device),
        }


def ragged_forward(target, store: KVSlots, first: int, ids: torch.Tensor, counts: list[int], logits_at: str,
                   layer_ids: list[int] | None = None) -> list[tuple]:
    """One target forward appending counts[r] tokens (flat `ids` [1, N]) to slots first..first+R-1 of
    `store`. Returns per row (logits, features): logits of all its new tokens (logits_at "all") or of
    its last one ("last", shape [1, V]); features of the `layer_ids` layers (None without them)."""
    layout = store.ragged(first, counts)
    slices = layout.row_slices()
    where = "all" if logits_at == "all" else torch.tensor([s.stop - 1 for s in slices], device=target.device)
    with store.batch(layout):
        out = target.forward(ids.to(target.device), position_ids=layout.position_ids,
                             attention_mask=layout.mask, layer_ids=layer_ids, logits_at=where)
    logits, feats = out.logits[0], out.features[0] if out.features is not None else None
    if logits_at == "all":
        return [(logits[s], None if feats is None else feats[s]) for s in slices]
    return [(logits[i: i + 1], None if feats is None else feats[s]) for i, s in enumerate(slices)]


def _count_positions(s: RequestStats, verified: int, accepted: int) -> None:
    """Position k was verified in this round iff k < verified, accepted iff k < accepted."""
    for counts, n in ((s.verified_per_pos, verified), (s.accepted_per_pos, accepted)):
        counts.extend([0] * (n - len(counts)))
        for k in range(n):
            counts[k] += 1


def _fmt_table(table: SPSTable) -> str:
    return ", ".join(f"{b}: {v:.1f}" for b, v in table.points.items())
