"""How many drafts of each request to verify: the hardware-aware prefix scheduler (paper §3.2.2,
Algorithm 1, Appendix A, §5.2) and its baselines.

Modes
- dynamic:   Algorithm 1. a_{r,j} = Π_{i≤j} c_{r,i}; admit candidates (r, j) in descending a while
             the expected throughput Θ = τ*·SPS(B) strictly improves; stop at the first Θ ≤ Θ_best.
- threshold: verify while a_{r,j} ≥ threshold (`threshold_on="prefix"`, the default) or while the
             conditional confidence c_{r,j} ≥ threshold (`threshold_on="confidence"`).
- fixed:     verify min(gamma, proposed) drafts of every request (gamma None = all proposed).
- off:       verify nothing (target-only decoding through the same engine).
- async_topk: the production variant (§5.2): the batch capacity K comes from an unconstrained
             global search over the confidences of `lag` (2) steps ago, then the K current
             candidates with the highest a_{r,j} are verified.

Why these are lossless although the engine sees all γ confidences at once. Speculative decoding
stays exact if the event "draft k of request r is verified" is independent of x_{r,k} given the
tokens before it (non-anticipating). The Markov confidence c_{r,k+1} is computed from x_{r,k}, so
that event may depend on c_{r,1..k} (and on other requests, whose drafts are independent) but never
on c_{r,k+1..γ}. In Algorithm 1 candidates are visited in descending a; for one request a_{r,j} is
non-increasing in j and ties are broken by j, so every candidate (r, j') with j' > k comes after
(r, k). With the early stop, "(r, k) admitted" is decided when (r, k) is visited, from candidates
visited so far only — so it depends on c_{r,≤k} and never on later confidences. Without the early
stop the argmax over the whole path lets c_{r,k+1} (i.e. x_{r,k}) decide whether x_{r,k} is verified:
Appendix A shows this turns a (0.7, 0.3) target into (0.85, 0.15) output. Threshold mode is a
per-position test of a_{r,≤k} (or c_{r,k}), and async_topk ranks current candidates by a_{r,k} (rank
of (r, k) depends on a_{r,k} and earlier positions only) with K fixed from old, already verified
steps — both non-anticipating too.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

import numpy as np

from pydantic import Field

from dspark.config import StrictModel


# ---- the profiled cost table ---------------------------------------------------------------
@dataclass
class SPSTable:
    """Target forward steps per second as a function of tokens per verify batch B.

    Between profiled points the step time (1/SPS) is interpolated linearly; below the smallest
    point SPS is flat; beyond the largest it grows with the slope of the last two points (or
    proportionally to B, compute-bound, when that slope is not positive)."""

    points: dict[int, float]

    def __post_init__(self):
        if not self.points or any(v <= 0 for v in self.points.values()):
            raise ValueError(f"SPS table needs at least one positive steps/s entry, got {self.points}")
        self.points = {int(b): float(v) for b, v in sorted(self.points.items())}
        self._b = np.array(list(self.points), dtype=np.float64)
        self._t = 1.0 / np.array(list(self.points.values()), dtype=np.float64)

    def step_time(self, batch: float) -> float:
        b, t = self._b, self._t
        if batch <= b[-1]:
            return float(np.interp(batch, b, t))
        slope = (t[-1] - t[-2]) / (b[-1] - b[-2]) if len(b) > 1 else 0.0
        if slope <= 0:
            slope = t[-1] / b[-1]
        return float(t[-1] + slope * (batch - b[-1]))

    def __call__(self, batch: float) -> float:
        return 1.0 / self.step_time(batch)

    def to_dict(self) -> dict[str, float]:
        return {str(b): v for b, v in self.points.items()}

    @classmethod
    def from_dict(cls, d: dict) -> "SPSTable":
        return cls({int(b): float(v) for b, v in d.items()})


def profile_sps(fn: Callable[[int], object], batch_sizes: Sequence[int], repeats: int = 5, warmup: int = 1,
                sync: Callable[[], None] | None = None) -> SPSTable:
    """Time fn(B) (one target forward over B tokens) for each B; SPS = 1 / median seconds.
    The sizes take turns (one forward of each per round, `repeats` rounds): a load that comes and goes
    during the profile (another replica loading, a job starting) then hits every size alike, and the
    table's ratios — all Algorithm 1 reads — stay right (timed size by size, such a burst once made
    a 4-token verify cost 1.6 one-token steps in the table, against 1.1 measured by the engine).
    Pass `sync` (e.g. torch.cuda.synchronize) on asynchronous devices."""
    sizes = [int(b) for b in batch_sizes]
    for _ in range(warmup):
        for batch in sizes:
            fn(batch)
    times: dict[int, list[float]] = {b: [] for b in sizes}
    for _ in range(repeats):
        for batch in sizes:
            if sync:
                sync()
            t0 = time.perf_counter()
            fn(batch)
            if sync:
                sync()
            times[batch].append(time.perf_counter() - t0)
    points = {b: 1.0 / max(float(np.median(t)), 1e-9) for b, t in times.items()}
    return SPSTable(monotone_envelope(points))


def monotone_envelope(points: dict[int, float]) -> dict[int, float]:
    """SPS(B) := max over B' >= B of the measured SPS(B'). A batch of B tokens is never slower than
    a larger one (it could be padded), so a measured dip at small B is timing noise; left in, it
    makes Algorithm 1 see a cliff that is not there."""
    out, best = {}, 0.0
    for batch in sorted(points, reverse=True):
        best = max(best, points[batch])
        out[batch] = best
    return dict(sorted(out.items()))


def target_verify_fn(target, context_len: int = 64, seed: int = 0) -> Callable[[int], None]:
    """A callable B -> one batch-1 target forward of B new tokens over a cached context of
    `context_len` tokens (the shape of a verify pass), for `profile_sps`."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ctx = torch.randint(0, target.vocab_size, (1, context_len), generator=gen).to(target.device)
    cache = target.new_cache()
    target.forward(ctx, cache=cache, use_cache=True, logits_at=None)

    def step(batch: int) -> None:
        ids = torch.randint(0, target.vocab_size, (1, batch), generator=gen).to(target.device)
        out = target.forward(ids, cache=cache, use_cache=True, logits_at="all")
        target.crop_cache(out.cache, context_len)

    return step


# ---- Algorithm 1 -------------------------------------------------------------------------------
def prefix_survival(confidences: Sequence[Sequence[float]]) -> list[np.ndarray]:
    """a_{r,j} = Π_{i≤j} c_{r,i} for each request (rows may differ in length)."""
    return [np.cumprod(np.asarray(c, dtype=np.float64)) for c in confidences]


def _candidates(survival: list[np.ndarray]) -> list[tuple[float, int, int]]:
    """(a, r, j) with a > 0, descending a; ties by request then position, so (r, j-1) precedes (r, j)."""
    cands = [(float(a), r, j + 1) for r, row in enumerate(survival) for j, a in enumerate(row) if a > 0]
    return sorted(cands, key=lambda c: (-c[0], c[1], c[2]))


def prefix_schedule(confidences: Sequence[Sequence[float]], sps: Callable[[float], float],
                    early_stop: bool = True) -> list[int]:
    """Algorithm 1: per-request verify lengths ℓ_r maximising Θ = τ*·SPS(B) along the greedy path.
    early_stop=False searches the whole path (NOT lossless on fresh confidences; Appendix A)."""
    survival = prefix_survival(confidences)
    n_req = len(survival)
    if n_req == 0:
        return []
    lengths, best_lengths = [0] * n_req, [0] * n_req
    batch, tau = n_req, float(n_req)  # every request verifies at least its anchor
    best = tau * sps(batch)
    for a, r, j in _candidates(survival):
        lengths[r], batch, tau = j, batch + 1, tau + a
        theta = tau * sps(batch)
        if theta > best:
            best, best_lengths = theta, list(lengths)
        elif early_stop:
            break  # the decision for (r, j) uses only candidates visited so far: non-anticipating
    return best_lengths


def topk_schedule(confidences: Sequence[Sequence[float]], capacity: int) -> list[int]:
    """Verify the `capacity` candidates (r, j) with the highest a_{r,j} (prefix-closed by the ordering)."""
    lengths = [0] * len(confidences)
    for _, r, j in _candidates(prefix_survival(confidences))[: max(capacity, 0)]:
        lengths[r] = j
    return lengths


def threshold_schedule(confidences: Sequence[Sequence[float]], threshold: float, on: str = "prefix") -> list[int]:
    """Leading positions with a_{r,j} ≥ threshold (on="prefix") or c_{r,j} ≥ threshold (on="confidence")."""
    rows = prefix_survival(confidences) if on == "prefix" else [np.asarray(c, dtype=np.float64) for c in confidences]
    return [int(np.argmin(np.append(row >= threshold, False))) for row in rows]  # first failing position


# ---- the scheduler the engines call ---------------------------------------------------------------
class SchedulerConfig(StrictModel):
    mode: Literal["dynamic", "threshold", "fixed", "off", "async_topk"] = Field("fixed", description="which drafts to verify: dynamic (Algorithm 1 over the SPS table), threshold (prefix survival >= threshold), fixed (gamma drafts), off (no drafting), async_topk (capacity from confidences `lag` steps old)")
    # dynamic / async_topk: skip drafting in steps where a target-only step is expected to emit more
    # tokens per second (DraftGate); off = always draft, as in the paper's Algorithm 1
    draft_gate: bool = Field(False, description="dynamic/async_topk: skip drafting in steps where a target-only step is expected to emit more tokens per second (off = always draft, as in Algorithm 1)")
    draft_gate_explore_every: int = Field(16, ge=1, description="draft at least every N steps to refresh the estimates")
    draft_gate_explore_rows: int = Field(4, ge=1, description="requests an exploration step drafts (a sample: at high load drafting every request to refresh the estimates would cost several target steps)")
    draft_gate_decay: float = Field(0.8, gt=0, lt=1, description="weight of the past in the gate's running means of draft time, verified and accepted drafts per request, per drafting step (higher: steadier, slower to follow a change)")
    tree_gate_decay: float = Field(0.95, gt=0, lt=1, description="draft_gate_decay of the draft-tree steps' own gate (engine draft_tree): a tree round's path length varies more than a chain's confidence-based estimate, so it averages over more rounds")
    tree_gate_warmup: int = Field(16, ge=0, description="drafting steps the draft-tree gate takes before it may skip one: its first rounds set the running means, and a closed gate samples only every draft_gate_explore_every steps")
    threshold: float = Field(0.5, description="threshold mode: verify drafts while this value stays >= it")
    threshold_on: Literal["prefix", "confidence"] = Field("prefix", description="threshold mode: compare a_k = Π c_i (prefix) or c_k (confidence)")
    gamma: int | None = Field(None, description="fixed mode: drafts verified per request (None = all proposed)")
    lag: int = Field(2, description="async_topk: capacity from the confidences of `lag` steps ago")


class PrefixScheduler:
    """Stateful front end: `schedule(confidences, proposed)` -> verify length per active request."""

    def __init__(self, cfg: SchedulerConfig | None = None, sps: SPSTable | Callable[[float], float] | None = None):
        self.cfg = cfg or SchedulerConfig()
        if self.cfg.mode in ("dynamic", "async_topk") and sps is None:
            raise ValueError(f"scheduler mode {self.cfg.mode!r} needs an SPS table: profile one with "
                             "profile_sps(target_verify_fn(target), batch_sizes) or pick mode fixed/threshold")
        self.sps = sps
        self._history: deque[list[list[float]]] = deque(maxlen=max(self.cfg.lag, 1))

    def schedule(self, confidences: Sequence[Sequence[float] | None], proposed: Sequence[int]) -> list[int]:
        mode = self.cfg.mode
        if mode == "off":
            return [0] * len(proposed)
        if mode == "fixed":
            cap = self.cfg.gamma
            return [p if cap is None else min(cap, p) for p in proposed]
        if any(c is None for c in confidences):
            raise ValueError(f"scheduler mode {mode!r} needs confidences: use a DSpark drafter with "
                             "confidence_head=True, or scheduler mode fixed/off")
        conf = [list(c)[:p] for c, p in zip(confidences, proposed)]
        if mode == "threshold":
            return threshold_schedule(conf, self.cfg.threshold, self.cfg.threshold_on)
        if mode == "dynamic":
            return prefix_schedule(conf, self.sps)
        return self._async_topk(conf)

    def _async_topk(self, conf: list[list[float]]) -> list[int]:
        """§5.2: K from an unconstrained search over stale confidences (already verified, so they
        carry no information about the current drafts); until `lag` steps exist, K comes from
        Algorithm 1 with the early stop on the current ones (lossless either way)."""
        if len(self._history) == self._history.maxlen:
            stale = self._history[0]
            capacity = sum(prefix_schedule(stale, self.sps, early_stop=False))
        else:
            capacity = sum(prefix_schedule(conf, self.sps))
        self._history.append(conf)
        return topk_schedule(conf, capacity)

    def verify_len_hook(self) -> Callable[[int, object], int]:
        """Adapter for batch-1 `speculative_generate(..., verify_len=...)`."""

        def hook(_round_idx: int, proposal) -> int:
            conf = proposal.confidences.tolist() if getattr(proposal, "confidences", None) is not None else None
            return self.schedule([conf], [int(proposal.tokens.shape[0])])[0]

        return hook


class DraftGate:
    """Whether to draft at all this step (engine, dynamic modes). Algorithm 1 picks verify lengths
    for drafts that already exist, with a cost model (SPS) of the verify forward only; the draft pass
    itself is a cost it never sees, and where drafting is expensive next to a target step (a small
    target, a CPU) speculation can lose to plain decoding at every load. Before each step, with N
    active requests and running means over recent drafting steps of the draft time per request d,
    the drafts verified per request v and accepted per request a:

        spec = N·(1 + a) / (N·d + 1/SPS(N·(1 + v)))        off = N / (1/SPS(N))

    The accepted count of one round is a noisy sample (a round accepts 0 or several drafts): at
    concurrency 1 a few unlucky rounds read as "drafting loses" and closed the gate on a drafter that
    gains 1.08x. So a is estimated from the confidences instead when the engine passes them:
    expected = Σ_{j≤ℓ_r} a_{r,j} of the verified drafts (the conditional mean of the accepted count,
    far less noisy), times a calibration ratio (realized / expected over a long window, with a
    one-token prior) that removes the head's bias from the estimate; without confidences, the
    realized count.

    The SPS table is profiled once, at start, with a few repeats; its error at the two operating
    points decides a close call (at concurrency 1 on CPU it priced a 1-token step 20 % below what the
    engine then measured). So both verify times are corrected by what the engine measures
    (`observe_verify`): κ_off and κ_spec are running means of measured / table time of the steps that
    skipped drafting and of those that drafted; the rule uses κ_spec·T(N(1+v)) and κ_off·T(N).

    Draft iff spec >= off, and at least every `interval` steps so the estimates track the load; the
    interval starts at `explore_every` and doubles (up to `max_explore_every`) at each exploration
    step while drafting clearly loses (spec < `backoff_below`·off), so an unprofitable drafter costs
    ever less; near break-even it stays at `explore_every` (the estimates are what decides there, and
    they need samples); a step that the rule itself chooses to draft resets it. It does not grow before
    `back_off_after` drafting steps have been observed: at concurrency 1 an exploration is one request's
    round, and the first few (the very first draft pass paying one-off costs: 18 ms against 8.5 ms warm)
    read 0.7-0.8 on a smollm2 drafter that decodes 1.2x faster, which doubled the interval to 128 before
    the estimates recovered and kept it from drafting on 99 % of the steps of a 1,000-step run.
    With `warmup` > 0 it drafts on its first `warmup` drafting steps whatever the rule says, so the running
    means start from that many rounds rather than from the first one (the engine's draft-tree gate: a tree
    round's path length ranges over 0.01-3 on the committed CPU drafter, and a low first estimate that
    closed the gate was lifted only by exploration steps, 1 in 16).
    An exploration step (`exploring`) drafts only a sample of `explore_rows` requests: the estimates are
    per request, and drafting all N at high load would cost several target steps (the engine picks the
    sample round-robin, never by its drafts).
    Lossless: the decision uses only finished rounds, never the current drafts, so a skipped step is
    an ordinary target-only step (the non-anticipation argument of the module docstring)."""

    def __init__(self, sps: SPSTable | Callable[[float], float], explore_every: int = 16, decay: float = 0.8,
                 max_explore_every: int = 256, explore_rows: int = 4, calibration_decay: float = 0.98,
                 kappa_decay: float = 0.95, backoff_below: float = 0.9, back_off_after: int = 8, warmup: int = 0):
        self.sps, self.explore_every, self.decay, self.max_explore_every = sps, explore_every, decay, max_explore_every
        self.interval, self.explore_rows, self.exploring = explore_every, explore_rows, False
        self.draft_s_per_req: float | None = None
        self.verified_per_req = self.predicted_per_req = 0.0  # predicted: accepted per request before calibration
        self.calibration_decay, self.realized_sum, self.expected_sum = calibration_decay, 0.0, 0.0
        self.kappa_decay, self.backoff_below, self.back_off_after = kappa_decay, backoff_below, back_off_after
        self.samples, self.warmup = 0, warmup  # drafting steps observed; steps drafted before the rule decides
        # measured / table verify time of target-only steps (False) and of drafting steps (True); None: none yet
        self.kappa: dict[bool, float | None] = {False: None, True: None}
        self.skipped_in_a_row = 0

    @property
    def calibration(self) -> float:
        """Realized / expected accepted drafts over the recent drafting steps (1 with no evidence)."""
        return (self.realized_sum + 1.0) / (self.expected_sum + 1.0)

    @property
    def accepted_per_req(self) -> float:
        return self.predicted_per_req * self.calibration

    def should_draft(self, n_active: int) -> bool:
        self.exploring = False
        if self.draft_s_per_req is None or self.samples < self.warmup:
            return self._decide(True)
        gain = self.expected_gain(n_active)
        if gain >= 1.0:
            self.interval = self.explore_every
            return self._decide(True)
        if self.skipped_in_a_row + 1 < self.interval:
            return self._decide(False)
        # exploration step: back off only when drafting clearly loses; near break-even the estimates
        # decide, so they keep being refreshed (a marginal drafter's first unlucky samples must not
        # shut it out for 256 steps at a time)
        losing = gain < self.backoff_below and self.samples >= self.back_off_after
        self.interval = min(2 * self.interval, self.max_explore_every) if losing else self.explore_every
        self.exploring = True
        return self._decide(True)

    def expected_gain(self, n: int) -> float:
        """spec / off: tokens per second of a drafting step over those of a target-only step, at n requests."""
        verify_spec = self._kappa(True) / self.sps(n * (1 + self.verified_per_req))
        spec = n * (1 + self.accepted_per_req) / (n * self.draft_s_per_req + verify_spec)
        return spec / (n / (self._kappa(False) / self.sps(n)))

    def _kappa(self, drafted: bool) -> float:
        """The table correction of that kind of step (1 until one is measured)."""
        kappa = self.kappa[drafted]
        return 1.0 if kappa is None else kappa

    def _decide(self, draft: bool) -> bool:
        self.skipped_in_a_row = 0 if draft else self.skipped_in_a_row + 1
        return draft

    def to_dict(self) -> dict:
        """The estimates the rule reads (for /v1/stats and benchmarks)."""
        return {"draft_s_per_req": self.draft_s_per_req, "verified_per_req": self.verified_per_req,
                "accepted_per_req": self.accepted_per_req, "calibration": self.calibration,
                "kappa_off": self._kappa(False), "kappa_spec": self._kappa(True), "interval": self.interval,
                "expected_gain_at_1": self.expected_gain(1) if self.draft_s_per_req is not None else None}

    def observe_verify(self, batch_tokens: int, verify_s: float, drafted: bool) -> None:
        """Fold in one step's measured verify time (every step: drafted or not) against the table's."""
        if batch_tokens <= 0 or verify_s <= 0:
            return
        ratio, mean = verify_s * self.sps(batch_tokens), self.kappa[drafted]
        k = self.kappa_decay
        self.kappa[drafted] = ratio if mean is None else k * mean + (1 - k) * ratio

    def observe(self, n_requests: int, draft_s: float, verified: int, accepted: int,
                expected: float | None = None) -> None:
        """Fold in one drafting step (n_requests drafted and verified; expected: Σ a_{r,j} over the
        verified drafts, the confidences' prediction of `accepted`, None when there are none)."""
        if n_requests <= 0:
            return
        if expected is not None:
            k = self.calibration_decay
            self.realized_sum, self.expected_sum = k * self.realized_sum + accepted, k * self.expected_sum + expected
        predicted = accepted if expected is None else expected
        sample = (draft_s / n_requests, verified / n_requests, predicted / n_requests)
        self.samples += 1
        if self.draft_s_per_req is None:
            self.draft_s_per_req, self.verified_per_req, self.predicted_per_req = sample
            return
        k = self.decay
        self.draft_s_per_req = k * self.draft_s_per_req + (1 - k) * sample[0]
        self.verified_per_req = k * self.verified_per_req + (1 - k) * sample[1]
        self.predicted_per_req = k * self.predicted_per_req + (1 - k) * sample[2]
