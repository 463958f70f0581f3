"""Per-domain acceptance of the served drafter, collected in a plain object (no Ray: the Serve
deployment exports it to Prometheus, the summariser writes windows of it to the object store).

Counters follow vLLM's `spec_decode` ones (num_drafts, num_draft_tokens, num_accepted_tokens,
num_accepted_tokens_per_pos), with a domain label and the verify budget beside them:
- drafts: request-rounds that verified at least one draft;
- draft_tokens: drafts sent to the target (the verify budget spent); proposed: drafts proposed;
- accepted / accepted_per_pos[k]: drafts accepted (at position k);
- verified_per_pos[k]: request-rounds that verified a draft at position k.

The drift statistic is `expected_accept_len` = 1 + Σ_k s_k with s_k = accepted_per_pos[k] /
verified_per_pos[k], the share of rounds verifying position k that accepted it (prefix survival: a
draft is accepted only after all before it). With every proposed draft verified (scheduler `fixed`)
it is exactly τ, the mean tokens per round, so it compares with the τ jobs.evaluate measures for the
drafter (which verifies every draft). Under `dynamic`/`threshold` a position is verified more often
where the drafter is confident, which biases s_k upward: compare like with like (the margin absorbs
a little). Draft trees (engine `draft_tree`) verify several candidates per position, so their rounds read
as a chain that accepts more (tree 2 on the committed CPU drafter: τ 1.90 against the chain's 1.74): also
upward, never a false drift alarm, but not the chain's τ.
"""
from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field

COUNTS = ("requests", "rounds", "drafts", "proposed", "draft_tokens", "accepted", "generated_tokens")


@dataclass
class DomainAcceptance:
    requests: int = 0
    rounds: int = 0
    drafts: int = 0
    proposed: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    generated_tokens: int = 0
    verified_per_pos: list[int] = field(default_factory=list)
    accepted_per_pos: list[int] = field(default_factory=list)

    def add_request(self, stats, generated: int) -> None:
        """One finished request's engine RequestStats."""
        self.requests += 1
        self.rounds += stats.rounds
        self.drafts += stats.drafting_rounds
        self.proposed += stats.proposed
        self.draft_tokens += stats.verified
        self.accepted += stats.accepted
        self.generated_tokens += generated
        _add_lists(self.verified_per_pos, stats.verified_per_pos)
        _add_lists(self.accepted_per_pos, stats.accepted_per_pos)

    def merge(self, other: "DomainAcceptance") -> None:
        for key in COUNTS:
            setattr(self, key, getattr(self, key) + getattr(other, key))
        _add_lists(self.verified_per_pos, other.verified_per_pos)
        _add_lists(self.accepted_per_pos, other.accepted_per_pos)

    def survival(self) -> dict[int, float]:
        """s_k by 1-based position k, for positions that were verified at least once."""
        return {k + 1: a / v for k, (v, a) in enumerate(zip(self.verified_per_pos, self.accepted_per_pos)) if v}

    def expected_accept_len(self) -> float | None:
        return expected_accept_len(self.survival())

    def to_dict(self) -> dict:
        return {**asdict(self), "survival_by_pos": self.survival(), "expected_accept_len": self.expected_accept_len(),
                "mean_accepted_length": (self.accepted + self.rounds) / self.rounds if self.rounds else None}

    @classmethod
    def from_dict(cls, data: dict) -> "DomainAcceptance":
        return cls(**{k: data[k] for k in (*COUNTS, "verified_per_pos", "accepted_per_pos") if k in data})


def expected_accept_len(survival: dict) -> float | None:
    """1 + Σ_k s_k over consecutive positions 1, 2, ... (the expected tokens per round when every
    proposed draft is verified). None without position 1."""
    points = {int(k): float(v) for k, v in (survival or {}).items()}
    if 1 not in points:
        return None
    total, k = 1.0, 1
    while k in points:
        total += points[k]
        k += 1
    return total


class AcceptanceStats:
    """Thread-safe per-domain counters: cumulative (`snapshot`) and since the last `take_window`."""

    def __init__(self):
        self._lock = threading.Lock()
        self.total: dict[str, DomainAcceptance] = {}
        self.window: dict[str, DomainAcceptance] = {}

    def record(self, domain: str, stats, generated: int) -> None:
        with self._lock:
            for table in (self.total, self.window):
                table.setdefault(domain, DomainAcceptance()).add_request(stats, generated)

    def take_window(self) -> dict[str, DomainAcceptance]:
        with self._lock:
            window, self.window = self.window, {}
        return window

    def snapshot(self) -> dict[str, dict]:
        with self._lock:
            return {d: a.to_dict() for d, a in self.total.items()}


def _add_lists(into: list[int], values: list[int]) -> None:
    into.extend([0] * (len(values) - len(into)))
    for k, v in enumerate(values):
        into[k] += v
