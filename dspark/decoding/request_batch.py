"""The engine's request bookkeeping, apart from the decoding round: the bounded waiting queue, the
active requests in KV-slot order (`active[i].slot == i`), admission into free slots, retirement (a
finished request's slot is recycled, the last slot moving into the hole so slots stay contiguous),
failure and cancellation, the checks a request must pass to fit the context, the emission of a round's
tokens (stop tokens, the token limit, logprobs, the listener; without a drafter the tokens' draw itself,
`_target_only_tokens`), the running totals, and the background thread that drives `step()`.

`Engine` (dspark.decoding.engine) subclasses `RequestBatch` and adds the round itself (prefill, draft,
verify, accept); nothing here touches the target or the drafter.
"""
from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from typing import Callable

import torch

from dspark.decoding.engine_config import EngineConfig
from dspark.decoding.request import EngineUnavailableError, QueueFullError, Request, StepReport, TokenLogprob
from dspark.decoding.constraint import constrain
from dspark.decoding.counter_random import CounterStream
from dspark.decoding.sampling import sample_keyed, to_logprobs
from dspark.decoding.specdec import _keep
from dspark.decoding.static_core import full_graph_caches
from dspark.models.openmp_pool import release_openmp_pool

log = logging.getLogger("dspark.decoding.engine")  # the engine's own log (this is part of the engine)


class RequestBatch:
    """Queue, slots and lifecycle of the engine's requests; `step()` is the subclass's decoding round."""

    drafting = False  # Engine: whether it drafts at all (scheduler mode != off); counts draft-skipped steps
    gamma = 0  # Engine: drafts per round (γ + 1 positions of the context are kept free for a round)
    max_model_len = 0  # Engine: the context a request must fit in

    def __init__(self, cfg: EngineConfig, kv):  # kv: the KV slots (dspark.decoding.kv_sequence.open_slots)
        self.cfg, self.kv = cfg, kv
        self._seeds = random.Random(cfg.seed)  # seeds of requests that bring none (None: OS entropy)
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
                           batch_tokens=0, busy_s=0.0, draft_skipped_steps=0,
                           # where busy_s went: prefill forwards, drafter (catch-up + proposals), verify forwards
                           prefill_s=0.0, draft_s=0.0, verify_s=0.0, catch_up_s=0.0)
        self.started_at = time.time()

    def step(self) -> StepReport:
        raise NotImplementedError

    # ---- queue -------------------------------------------------------------------------------
    def _enqueue(self, req: Request, device: torch.device) -> None:
        """Queue a built request (thread-safe) with its own uniform stream on `device` (a CounterStream: every
        request's draws of a step reach the device in one copy), keyed by req.seed or from the engine's seed stream.
        Raises EngineUnavailableError / QueueFullError."""
        with self._lock:
            if not self.healthy or self._stop:
                raise EngineUnavailableError(f"engine cannot serve: {self.health_error or 'stopped'}")
            if len(self.waiting) >= self.cfg.max_waiting:
                self.totals["rejected"] += 1
                raise QueueFullError(f"engine queue is full ({self.cfg.max_waiting} waiting); retry later")
            req.key_seed = req.seed if req.seed is not None else self._seeds.getrandbits(63)
            req.generator = CounterStream(req.key_seed, device)
            self.waiting.append(req)
            self.totals["submitted"] += 1
        self._wakeup.set()

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

    def cancel_all(self) -> None:
        """Finish every active and waiting request now as cancelled (their tokens so far stay)."""
        self._fail_all("cancelled", reason="cancelled")

    def has_work(self) -> bool:
        return bool(self.active or self.waiting)

    def _admit(self) -> list[Request]:
        """Move waiting requests into free slots: up to max_batch active, max_prefill_tokens prompt
        tokens per step (the first newcomer always fits)."""
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

    # ---- background loop ---------------------------------------------------------------------
    def start(self) -> "RequestBatch":
        """Step in a background thread from now on. The calling thread's OpenMP pool (left by loading
        the models and profiling) is released first, so the loop thread's pool is the only one and keeps
        spin-waiting between parallel regions (dspark.models.openmp_pool)."""
        if self._thread is None:
            release_openmp_pool()
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

    # ---- emission (the tokens a round produced: stop, limit, logprobs, listener) ---------------
    def _emit(self, req: Request, new: list[int], report: StepReport, logits: torch.Tensor | None = None) -> None:
        """Append the new tokens (up to a stop token or the limit); logits [len(new), V]: the target
        logits each was drawn or accepted from (for logprobs)."""
        kept, finish = _keep(new, len(req.tokens), req.max_new_tokens, req.stop_ids)
        if req.first_token_at is None:
            req.first_token_at = time.perf_counter()
        if req.logprobs is not None and kept:
            req.token_logprobs += self._logprobs(req, kept, logits[: len(kept)])
        req.tokens += kept
        if req.constraint is not None:
            req.constraint.commit(kept)
        report.emitted += len(kept)
        if finish:
            req.finish_reason = finish
            report.finished += 1
        self._notify(req, kept)

    def _target_only_tokens(self, reqs: list[Request], outputs: list[tuple], report: StepReport,
                            rows: list[torch.Tensor] | None = None) -> None:
        """A step where no row verifies a draft (no drafter; or the gate skipped drafting, or the scheduler chose
        length 0 for every row): every row gets one token, all drawn in one device call and one host copy, the
        token at output position j keyed by (key_seed, j) (`sample_keyed`: the same alone or in any batch): for
        a seeded request with seeded_sampling keyed the Gumbel-max token a drafting engine would emit, else the
        inverse-CDF draw at u(key_seed, j) (fresh for every j, and whether j is drawn here does not depend on
        it: exact). With a drafter the anchor's features wait in ctx_pending (rows: the verified [anchor] rows)."""
        live = [(r, out, i) for i, (r, out) in enumerate(zip(reqs, outputs)) if not r.finished]
        if not live:
            return
        logits = torch.cat([constrain(lg[-1:], r.constraint) for r, (lg, _), _ in live])  # grammar masks
        keyed = [r.seed is not None and self.cfg.seeded_sampling == "keyed" for r, _, _ in live]  # Gumbel (KeyedNoise)
        tokens = sample_keyed(logits, [r.sampling for r, _, _ in live], [r.key_seed for r, _, _ in live],
                              [len(r.tokens) for r, _, _ in live], keyed).tolist()
        for (req, (lg, features), i), token in zip(live, tokens):
            self.kv.set_length(req.slot, len(req.prompt_ids) + len(req.tokens))
            if rows is not None:  # the drafter reads the anchor's features when it next drafts
                req.ctx_pending.append((features[:1], rows[i][:1]))
                if req.noise is not None:
                    req.noise.forget_before(len(req.tokens) + 1)
            if req.tokens:
                proposed = 0 if req.proposal is None else int(req.proposal.tokens.shape[0])
                req.stats.add_round(proposed, 0, 0)
                report.proposed += proposed
            req.proposal = None
            self._emit(req, [token], report, lg[-1:])

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

    # ---- finishing ---------------------------------------------------------------------------
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

    # ---- totals ------------------------------------------------------------------------------
    def _account(self, report: StepReport) -> None:
        t = self.totals
        t["steps"] += 1
        t["rounds"] += report.rows
        t["prompt_tokens"] += report.prefill_tokens
        t["generated_tokens"] += report.emitted
        for key in ("proposed", "verified", "accepted", "batch_tokens", "prefill_s", "draft_s", "verify_s", "catch_up_s"):
            t[key] += getattr(report, key)
        t["busy_s"] += report.step_s
        t["draft_skipped_steps"] += int(self.drafting and report.rows > 0 and not report.drafted)
        for fn in self.step_listeners:
            try:
                fn(report)
            except Exception:
                log.exception("step listener failed")

    def stats(self) -> dict:
        """A JSON-able snapshot of the batch: health, queue, totals and the rates derived from them."""
        t = dict(self.totals)
        rounds = t["rounds"] or 0
        return {
            "healthy": self.healthy, "health_error": self.health_error, "loop_alive": self.alive,
            "active": len(self.active), "waiting": len(self.waiting),
            "max_batch": self.cfg.max_batch, "max_waiting": self.cfg.max_waiting,
            "uptime_s": time.time() - self.started_at, "totals": t,
            "mean_verify_budget": t["verified"] / rounds if rounds else None,  # drafts verified per request-round
            "mean_accepted_length": (t["accepted"] + rounds) / rounds if rounds else None,  # τ
            "mean_batch_tokens": t["batch_tokens"] / t["steps"] if t["steps"] else None,
            "tokens_per_busy_s": t["generated_tokens"] / t["busy_s"] if t["busy_s"] else None,
            "kv_bytes": self.kv.memory_bytes(),
            "graph_caches_full": full_graph_caches(),  # compiled steps/captures whose new buckets now run eager
        }
