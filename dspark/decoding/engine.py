"""Continuous-batching draft-plus-verify engine (no Ray; dspark/serve/ puts it behind HTTP).

One engine holds the frozen target, one drafter (its STS calibration travels with it) and the active
requests. Each `step()`:
  1. admits waiting requests (bounded queue) and prefills them in one target step; the
     first token of each comes from the prefill, the drafter context gets the prompt's features;
  2. drafts γ tokens for every active request (`drafter.propose_batch`);
  3. picks a verify length ℓ_r per request with the scheduler (dspark.decoding.scheduler: dynamic = Algorithm 1
     over the SPS table profiled at start, threshold, fixed, off);
  4. verifies [anchor_r, drafts_r[:ℓ_r]] of ALL requests in ONE target step of the decoding core
     (dspark.decoding.static_core `CoreSlots`: one row per request over its preallocated KV slot, rows
     padded to a shape bucket, compiled or eager — `decode_core`; with `decode_core: dynamic` the ragged
     store of dspark.decoding.batched_cache: tokens flattened into one row);
  5. accepts losslessly (`accept_rows`: every chain row at once, as `accept_drafts` per row), keeps the accepted
     prefix in the KV slot, queues its target features for the drafter context, emits the new tokens;
     finished requests leave, their slots are recycled.
With `draft_tree` set (EngineConfig), a step with at most `tree_max_rows` active requests drafts a tree per
request instead (`drafter.draft_trees`) and verifies every node (the row's tokens attend to their ancestors
only); the tree walk (`accept_tree`, `accept_keyed_tree`) picks the accepted path, whose KV columns move behind
the prefix (`keep_columns`). Such steps bypass the scheduler; with the draft gate on, a gate of their own
(`tree_gate`: a tree's verify cost and acceptance are not a chain's) decides whether a tree beats target-only.
The drafter context is caught up lazily: the target features of verified positions wait in
`Request.ctx_pending` and the drafter reads them, for all requests in one `extend_contexts` pass, just
before it next drafts (or when `context_catch_up_every` steps have piled up, which bounds the memory held).
So a step where the draft gate skips drafting does mode `off`'s work, through the same batched draw (plus keeping
the features, which the target forward returns anyway): a drafter costs nothing on the steps it sits out. Requests
join and leave between steps; one whose drafting, verification or acceptance fails is finished with an error, the
others continue; `healthy` turns False when steps keep failing.

Losslessness: every row is exactly batch-1 speculative decoding (dspark.decoding.specdec) with a verify length
that is non-anticipating (the scheduler's modes guarantee it; Appendix A), and the batched step
computes the same logits as a per-request forward with a KV cache (each row sees its own slot only).

Randomness: without a drafter (mode off: rollouts, target-only serving) every token is drawn on the device
with counter-based randomness keyed by (the request's seed, output position), all rows in one call
(`sample_keyed`; a keyed seeded request gets the Gumbel-max token below); so does a drafting engine's step
where no row verifies a draft. Otherwise every request draws from its own counter-based stream of uniforms
(`counter_random.CounterStream`: draw i = a hash of (key, i); every request's draws of a step hashed together
on the host and copied to the device once), keyed by the request's `seed` or, without one, by the engine's
seed stream (EngineConfig.seed).
Its prefill sample, its drafts and its acceptance draws come from that stream only, so a request's random
draws never depend on the other requests in the batch; but how many draws a round consumes depends
on its verify length, which the dynamic/async_topk schedulers and the draft gate choose over the
whole batch. So a request with a `seed` uses, by default (EngineConfig.seeded_sampling="keyed"),
position-keyed randomness instead (`dspark.decoding.sampling.KeyedNoise`): the token at output position j is
the target's Gumbel-max sample with noise keyed by (seed, j), whatever was drafted or verified, so a
seeded request's output depends on its seed, prompt and settings alone (up to floating-point differences of the
batched forward), under any load and scheduler — and stays exactly lossless ("stream": seeded requests use the
stream too, and repeat only under the same load). Logprobs (`logprobs` = number of alternatives, 0..): per emitted
token the target's log-probability of it and the top alternatives, from the verify-forward logits it was accepted
or drawn from (`dspark.decoding.sampling.to_logprobs`, EngineConfig.logprobs_mode). Structured output: a request's
`constraint` masks the target's rows (dspark.decoding.constraint: exact for the constrained distribution).

Invariant between steps, for each active request r in slot r: KV length == drafter context length +
positions in ctx_pending == len(prompt) + len(tokens) - 1 (everything but the anchor, tokens[-1]);
right after a catch-up ctx_pending is empty, so the drafter drafts from the full verified context.
Module map: request (per-request state, step report), request_batch (queue, slots, retirement, totals,
loop: Engine subclasses RequestBatch), engine_config, sps_profile, kv_sequence `open_slots` (KV + step).
"""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import Sequence

import torch

from dspark.decoding.constraint import constrain
from dspark.decoding.engine_config import EngineConfig, check_drafter, check_tree, engine_core_mode
from dspark.decoding.kv_sequence import open_slots
from dspark.decoding.request import (EngineUnavailableError, Listener, QueueFullError, Request, RequestStats,
                                     StepReport, TokenLogprob)
from dspark.decoding.request_batch import RequestBatch
from dspark.decoding.batched_accept import accept_keyed_rows, accept_rows
from dspark.decoding.counter_random import host_values
from dspark.decoding.sampling import KeyedNoise, SamplingParams, sample, to_probs
from dspark.decoding.scheduler import DraftGate, PrefixScheduler, SPSTable, prefix_survival
from dspark.decoding.specdec import drafter_layer_ids, new_draft_state
from dspark.decoding.tree_specdec import (DraftTree, accept_keyed_tree, accept_tree, tree_expected_accepted,
                                          verify_parents)
from dspark.decoding.sps_profile import engine_sps_table

__all__ = ["Engine", "EngineConfig", "EngineUnavailableError", "Listener", "QueueFullError", "Request", "RequestStats",
           "StepReport", "TokenLogprob"]  # the engine's API, wherever each piece is defined

log = logging.getLogger("dspark.decoding.engine")


class Engine(RequestBatch):
    """Continuous-batching speculative decoding over one target and one drafter (None for mode off)."""

    def __init__(self, target, drafter=None, cfg: EngineConfig | None = None):
        cfg = cfg or EngineConfig()
        self.cfg = cfg
        self.target, self.drafter = target, drafter
        self.mode = cfg.scheduler.mode
        self.drafting = self.mode != "off"
        self.gamma = check_drafter(cfg, drafter)
        self.tree = check_tree(cfg, drafter, self.gamma)
        self.layer_ids = drafter_layer_ids(drafter) if self.drafting else None
        self.max_model_len = min(cfg.max_model_len, getattr(target, "max_positions", cfg.max_model_len),
                                 getattr(target, "sliding_window", None) or cfg.max_model_len)  # exact within it
        # Device invariant: KV slots, request RNGs and every tensor a step creates live on target.device (so
        # does the drafter); sampling moves probabilities to the generator's device, never back.
        kv = open_slots(target, cfg.max_batch, engine_core_mode(cfg.decode_core, target), self.max_model_len)
        self.sps: SPSTable | None = None
        if self.mode in ("dynamic", "async_topk"):
            self.sps = engine_sps_table(cfg, kv, target, self.gamma, self.layer_ids)
        self.scheduler = PrefixScheduler(cfg.scheduler, self.sps)
        sched = cfg.scheduler
        gate_on = sched.draft_gate and self.sps is not None and self.drafting
        self.gate = self._draft_gate(sched.draft_gate_decay, 0) if gate_on else None
        # tree steps get a gate of their own: a tree's verify cost and acceptance are not a chain's
        tree_gate_on = gate_on and self.tree is not None
        self.tree_gate = self._draft_gate(sched.tree_gate_decay, sched.tree_gate_warmup) if tree_gate_on else None
        self._explore_offset = 0  # round-robin start of the gate's exploration sample
        super().__init__(cfg, kv)  # queue, slots, totals; started_at = now, after the profiling

    def _draft_gate(self, decay: float, warmup: int) -> DraftGate:
        sched = self.cfg.scheduler
        return DraftGate(self.sps, sched.draft_gate_explore_every, decay=decay, warmup=warmup,
                         explore_rows=sched.draft_gate_explore_rows)

    def submit(self, prompt_ids: Sequence[int], sampling: SamplingParams | None = None, max_new_tokens: int = 64,
               stop_ids: Sequence[int] | None = None, listener: Listener | None = None,
               request_id: str | None = None, seed: int | None = None, logprobs: int | None = None,
               constraint=None) -> Request:
        """Queue a request (thread-safe). Raises ValueError for bad input, QueueFullError when the queue is full,
        EngineUnavailableError when the engine cannot serve. stop_ids None = the target's EOS. seed: the request's
        own (None: from the engine's seed stream; with seeded_sampling=keyed, position-keyed randomness). logprobs:
        k >= 0 = each emitted token's logprob and its k most likely alternatives (`Request.token_logprobs`).
        constraint: a dspark.decoding.constraint.TokenConstraint (structured output; verified as chains)."""
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
                      logprobs=logprobs, constraint=constraint, **({"id": request_id} if request_id else {}))
        if seed is not None and self.cfg.seeded_sampling == "keyed" and self.drafting:
            req.noise = KeyedNoise(seed, self.target.vocab_size, self.target.device,
                                   getattr(self.drafter, "draft_ids", None))
        self._enqueue(req, self.target.device)
        return req

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

    @torch.no_grad()
    def step(self) -> StepReport:
        t0 = time.perf_counter()
        report = StepReport()
        self._retire()  # requests cancelled since the last step
        newcomers = self._admit()
        if newcomers:
            self._prefill(newcomers, report)
            self._retire()
            report.prefill_s = time.perf_counter() - t0
        if self.active:
            tree_step = (self.tree is not None and len(self.active) <= self.cfg.tree_max_rows
                         and all(r.constraint is None for r in self.active))
            gate = self.tree_gate if tree_step else self.gate
            drafted = self.drafting and (gate is None or gate.should_draft(len(self.active)))
            if drafted:  # catches the drafter context up first
                self._draft(report, self._draft_rows(gate), tree_step)
                self._retire()
            if self.active:
                self._verify(report)
                self._catch_up_overdue(report)
                self._retire()
            if gate is not None and report.rows:
                gate.observe_verify(report.batch_tokens, report.verify_s, drafted)
            if drafted and gate is not None:  # what a tree costs is its nodes, not its depth
                verified = report.batch_tokens - report.rows if tree_step else report.verified
                gate.observe(report.drafted_rows, report.gate_draft_s, verified, report.accepted,
                             report.expected_accepted)
            report.drafted = drafted
        report.step_s = time.perf_counter() - t0
        self._account(report)
        return report

    def _prefill(self, newcomers: list[Request], report: StepReport) -> None:
        """One target step over the newcomers' prompts: first token, KV slot, drafter context."""
        report.admitted, report.prefill_tokens = len(newcomers), sum(len(r.prompt_ids) for r in newcomers)
        rows = [torch.tensor(r.prompt_ids, device=self.target.device) for r in newcomers]
        outputs = self._forward_rows(newcomers, rows, "last", report, eager=True)
        if not self.drafting:
            return self._target_only_tokens(newcomers, outputs, report)
        drawn = []  # (request, its first token on the device, its logits row): all read back in one copy
        for req, ids, (logits, features) in ((r, i, o) for r, i, o in zip(newcomers, rows, outputs) if not r.finished):
            try:
                req.draft_state = new_draft_state(self.drafter, self.kv)  # captured where the core compiles
                req.ctx_pending = [(features, ids)]  # read when the request first drafts
                self.kv.set_length(req.slot, len(req.prompt_ids))
                probs = to_probs(constrain(logits[-1:], req.constraint)[0], req.sampling)
                token = req.noise.argmax(probs[None], [0]) if req.noise else sample(probs[None], req.generator)
                drawn.append((req, token.to(self.target.device).reshape(1), logits[-1:]))
            except Exception as err:
                self._fail(req, f"prefill failed: {err}", report)
        for (req, _, logits), token in zip(drawn, torch.cat([t for _, t, _ in drawn]).tolist() if drawn else []):
            self._emit(req, [token], report, logits)

    def _draft_rows(self, gate: DraftGate | None) -> list[Request]:
        """Who drafts this step: every active request, or, on the draft gate's exploration steps, a
        round-robin sample of `explore_rows` (chosen before any draft exists: lossless)."""
        k = getattr(gate, "explore_rows", None) if getattr(gate, "exploring", False) else None
        if k is None or k >= len(self.active):
            return list(self.active)
        start = self._explore_offset % len(self.active)
        self._explore_offset += k
        return [self.active[(start + i) % len(self.active)] for i in range(k)]

    def _draft(self, report: StepReport, rows: list[Request], tree: bool = False) -> None:
        """γ drafts (or a draft tree) per request of `rows` in one batched drafter call (per-request
        retry isolates a failure)."""
        t0, caught_before = time.perf_counter(), report.catch_up_tokens
        self._catch_up(rows, report)
        catch_up_s, caught = time.perf_counter() - t0, report.catch_up_tokens - caught_before
        reqs = [r for r in rows if not r.finished]
        try:
            proposals = self._propose(reqs, tree)
        except Exception:
            log.warning("batched drafting failed; drafting request by request to isolate the failure", exc_info=True)
            proposals = []
            for r in reqs:
                try:
                    proposals += self._propose([r], tree)
                except Exception as err:
                    proposals.append(None)
                    self._fail(r, f"drafting failed: {err}", report)
        for r, p in zip(reqs, proposals):
            r.proposal = p
        report.drafted_rows = sum(p is not None for p in proposals)
        report.draft_s = time.perf_counter() - t0
        report.gate_draft_s = report.draft_s - catch_up_s + catch_up_s * self._steady_share(len(reqs), caught)

    def _propose(self, reqs: list[Request], tree: bool) -> list:
        """One batched drafter call: a DraftProposal (chain of γ) or a DraftTree per request."""
        for r in reqs:
            if r.noise is not None:
                r.noise.cursor = len(r.tokens)  # draft k (from 0) is for output position len(tokens) + k
        args = ([r.draft_state for r in reqs], [r.anchor for r in reqs], self.gamma)
        samplings, generators = [r.sampling for r in reqs], [r.noise or r.generator for r in reqs]
        if tree:
            return self.drafter.draft_trees(*args, self.tree, samplings, generators)
        return self.drafter.propose_batch(*args, samplings, generators)

    def _steady_share(self, rows: int, caught: int) -> float:
        """The share of this step's catch-up that steady drafting would pay per step (1 + accepted positions
        per row); the rest is the skipped steps' backlog, read anyway (`_catch_up_overdue`): pricing it into
        an exploration step made every exploration look expensive and kept the gate closed."""
        steady = rows * (1.0 + getattr(self.gate, "accepted_per_req", 0.0))
        return min(1.0, steady / caught) if caught else 1.0

    def _catch_up_overdue(self, report: StepReport) -> None:
        """Catch up requests holding `context_catch_up_every` steps of features (bounds the memory they pin
        while the gate keeps skipping)."""
        if self.drafting:
            every = self.cfg.context_catch_up_every
            self._catch_up([r for r in self.active if len(r.ctx_pending) >= every], report)

    def _catch_up(self, reqs: list[Request], report: StepReport) -> None:
        """Feed the requests' pending target features to their drafter contexts: all verified positions
        since each one's last catch-up, in order, in ONE `extend_contexts` pass over the requests (a
        failure is retried request by request, so only a failing request fails)."""
        t0, todo = time.perf_counter(), []
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
        report.catch_up_s += time.perf_counter() - t0

    def _schedule(self, report: StepReport) -> list[int]:
        """Verify lengths: the scheduler's over the requests holding drafts; 0 (a target-only row) for the
        rest (mode off, a step the gate skipped, the ones outside an exploration sample, a failed draft)."""
        lengths = [0] * len(self.active)
        drafted = [i for i, r in enumerate(self.active) if r.proposal is not None]
        if not self.drafting or not drafted:
            return lengths
        proposals = [self.active[i].proposal for i in drafted]
        if isinstance(proposals[0], DraftTree):  # a tree step: every node is verified
            for i, tree in zip(drafted, proposals):
                lengths[i] = len(tree.parents)
            return lengths
        confidences = [c if (c := p.host_confidences) is not None or p.confidences is None  # read when drafted:
                       else p.confidences.tolist() for p in proposals]  # one copy for every request
        for i, n in zip(drafted, self.scheduler.schedule(confidences, [int(p.tokens.shape[0]) for p in proposals])):
            lengths[i] = n
        if all(c is not None for c in confidences):  # Σ a_{r,j} over the verified drafts (for the draft gate)
            report.expected_accepted = sum(float(a[:lengths[i]].sum())
                                           for i, a in zip(drafted, prefix_survival(confidences)))
        return lengths

    def _verify(self, report: StepReport) -> None:
        """Score [anchor, drafts[:ℓ]] of every active request in one forward; accept per request."""
        t0 = time.perf_counter()
        lengths = self._schedule(report)
        device = self.target.device
        rows, parents, anchors = [], [], host_values([req.anchor for req in self.active], device)  # one copy
        for req, n, anchor in zip(self.active, lengths, anchors.split(1)):
            req.verify_len = n
            drafts = req.proposal.tokens[:n].to(device) if n else torch.empty(0, dtype=torch.long, device=device)
            rows.append(torch.cat([anchor, drafts]))
            parents.append(verify_parents(req.proposal.parents) if isinstance(req.proposal, DraftTree) else None)
        report.rows, report.batch_tokens = len(rows), sum(len(r) for r in rows)
        report.verify_lens = list(lengths)
        outputs = self._forward_rows(self.active, rows, "all", report, parents)
        if not any(lengths) and not any(parents):  # no row verifies a draft: one batched draw (as mode off)
            self._target_only_tokens(list(self.active), outputs, report, rows if self.drafting else None)
            report.verify_s = time.perf_counter() - t0
            return
        live = [(req, ids, out) for req, ids, out in zip(list(self.active), rows, outputs) if not req.finished]
        trees = [isinstance(req.proposal, DraftTree) for req, *_ in live]
        self._accept_chains([row for row, tree in zip(live, trees) if not tree], report)
        for req, ids, out in (row for row, tree in zip(live, trees) if tree):
            try:
                self._accept_tree(req, ids, *out, report)
            except Exception as err:
                self._fail(req, f"verification failed: {err}", report)
        report.verify_s = time.perf_counter() - t0

    def _accept_chains(self, rows: list[tuple], report: StepReport) -> None:
        """The chain rows, each rule for all its rows at once with one host copy: the rejection rule for the rows
        drawing from their generators (`accept_rows`: each row's tokens exactly as `accept_drafts` gives them
        alone), the keyed rule for seeded requests' rows (`accept_keyed_rows`: as `accept_keyed`)."""
        ready = []  # (req, ids, logits, features, target probs p, draft probs q) of the rows that got them
        for req, ids, (logits, features) in rows:
            try:  # row k of p: draft k+1
                p = to_probs(constrain(logits, req.constraint, ids[1:]), req.sampling)
                q = req.proposal.probs[:req.verify_len].to(p.device) if req.verify_len else p[:0]
                ready.append((req, ids, logits, features, p, q))
            except Exception as err:
                self._fail(req, f"verification failed: {err}", report)
        streamed, keyed = [r for r in ready if r[0].noise is None], [r for r in ready if r[0].noise is not None]
        pairs = accept_rows([ids[1:] for _, ids, *_ in streamed], [q for *_, q in streamed],
                            [p for *_, p, _ in streamed], [req.generator for req, *_ in streamed])
        pairs += accept_keyed_rows([req.drafts_on_host(ids) for req, ids, *_ in keyed], [p for *_, p, _ in keyed],
                                   [req.noise for req, *_ in keyed], [len(req.tokens) for req, *_ in keyed])
        for (req, ids, logits, features, _, _), result in zip(streamed + keyed, pairs):  # its pair or its error
            try:
                if isinstance(result, Exception):
                    raise result
                self._commit_chain(req, *result, ids, logits, features, report)
            except Exception as err:
                self._fail(req, f"verification failed: {err}", report)

    def _commit_chain(self, req: Request, n_acc: int, next_token: int, ids, logits, features, report) -> None:
        proposed = int(req.proposal.tokens.shape[0]) if req.proposal is not None else 0
        self._commit(req, list(range(1 + n_acc)), req.drafts_on_host(ids)[:n_acc] + [next_token], ids, logits,
                     features, (proposed, req.verify_len), report)

    def _accept_tree(self, req: Request, ids: torch.Tensor, logits: torch.Tensor, features,
                     report: StepReport) -> None:
        """Walk the verified tree (row [anchor, nodes]) and keep the accepted path."""
        tree = req.proposal
        target_probs = to_probs(logits, req.sampling)  # row 0 after the anchor, row 1 + i after node i
        if req.noise is not None:
            path, next_token = accept_keyed_tree(tree.tokens, tree.parents, target_probs, req.noise, len(req.tokens))
            expected = len(path)
        else:
            path, next_token = accept_tree(tree.tokens, tree.parents, tree.probs, target_probs, req.generator)
            expected = tree_expected_accepted(tree.tokens, tree.parents, tree.probs, target_probs)
        report.expected_accepted = (report.expected_accepted or 0.0) + expected  # for the tree gate
        # proposed: the nodes; verified: the depth any path reaches (so position k's acceptance reads as a chain's)
        kept = [0, *(1 + node for node in path)]  # in the verified row [anchor, nodes]
        self._commit(req, kept, ids[kept[1:]].tolist() + [next_token], ids, logits, features,
                     (len(tree.parents), max(tree.depths, default=0)), report)

    def _commit(self, req: Request, kept: list[int], new: list[int], ids: torch.Tensor, logits: torch.Tensor,
                features, proposed_verified: tuple[int, int], report: StepReport) -> None:
        """Keep the verified row's positions `kept` (the anchor, 0, and the accepted drafts, ascending) in the
        KV slot and for the drafter context; emit `new` (their drafts and the next token, host ints)."""
        n_acc, (proposed, verified) = len(kept) - 1, proposed_verified
        if req.noise is not None:
            req.noise.forget_before(len(req.tokens) + n_acc + 1)
        base = self.kv.lengths[req.slot]
        self.kv.keep_columns(req.slot, base, [base + k for k in kept])
        rows = slice(0, len(kept)) if kept[-1] == n_acc else kept  # a chain's prefix: views, no index copy
        if self.drafting:  # the drafter reads these when it next drafts (see _catch_up)
            req.ctx_pending.append((features[rows], ids[rows]))
        req.stats.add_round(proposed, verified, n_acc)
        report.proposed, report.verified, report.accepted = (report.proposed + proposed, report.verified + verified,
                                                              report.accepted + n_acc)
        req.proposal = None
        self._emit(req, new, report, logits[rows])

    def _forward_rows(self, reqs: list[Request], rows: list[torch.Tensor], logits_at: str, report: StepReport,
                      parents: list[list[int] | None] | None = None, eager: bool = False) -> list[tuple]:
        """One target step over the requests' slots (contiguous, in order); parents: per row None or its tree;
        eager: uncompiled (prefills). Returns per row (logits, features). If the batch fails, each row is
        retried alone and only failing rows are failed."""
        first = reqs[0].slot
        parents = parents or [None] * len(rows)
        assert [r.slot for r in reqs] == list(range(first, first + len(reqs))), "slots must be contiguous"
        try:
            return self.kv.forward(first, rows, logits_at, self.layer_ids, parents, eager)
        except Exception:
            log.warning("batched target forward failed; retrying row by row to isolate the failure", exc_info=True)
        outputs = []
        for req, ids, tree in zip(reqs, rows, parents):
            try:
                outputs.append(self.kv.forward(req.slot, [ids], logits_at, self.layer_ids, [tree], eager)[0])
            except Exception as err:
                outputs.append((None, None))
                self._fail(req, f"target forward failed: {err}", report)
        return outputs

    def stats(self) -> dict:
        """A JSON-able snapshot: the batch's (queue, totals, rates) plus scheduler, gates and SPS table."""
        return {**super().stats(), "mode": self.mode, "gamma": self.gamma, "draft_tree": self.tree,
                "max_model_len": self.max_model_len, "sps_table": self.sps.to_dict() if self.sps else None,
                "draft_gate": self.gate.to_dict() if isinstance(self.gate, DraftGate) else None,
                "tree_draft_gate": self.tree_gate.to_dict() if isinstance(self.tree_gate, DraftGate) else None,
                "device": str(self.target.device)}
