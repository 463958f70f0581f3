"""Drift: each domain's acceptance on live traffic (the replicas' acceptance windows) against the
served drafter's evaluation baseline (τ per domain, recorded on its registered version).

A domain drifts when, over the window, enough drafts were verified (`min_draft_tokens`) and its
expected accepted length 1 + Σ_k s_k (dspark.flywheel.acceptance) fell more than `margin` below the
baseline τ. Domains without a baseline are reported, never flagged.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

from dspark.flywheel.acceptance import DomainAcceptance
from dspark.flywheel.capture import writer_dirs
from dspark.io import storage


@dataclass
class DomainDrift:
    domain: str
    live: float | None          # expected accepted length over the window
    baseline: float | None      # τ of the evaluation
    draft_tokens: int
    requests: int
    drop: float | None
    drifted: bool
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)


def read_windows(output: str, since: float, drafter_version: str | None = None) -> dict[str, DomainAcceptance]:
    """Per-domain totals of every replica's windows that ended after `since` (unix seconds), for one
    served drafter version (None: any)."""
    totals: dict[str, DomainAcceptance] = {}
    for writer in writer_dirs(output, "acceptance"):
        base = storage.join(output, "acceptance", writer)
        for uri in storage.list_files(base):
            name = uri.rsplit("/", 1)[-1]
            if not name.endswith(".json") or int(name[:-5]) < since * 1000:
                continue
            record = json.loads(storage.read_text(uri))
            if drafter_version is not None and str(record.get("drafter_version", "")) != str(drafter_version):
                continue
            for domain, counts in record["domains"].items():
                totals.setdefault(domain, DomainAcceptance()).merge(DomainAcceptance.from_dict(counts))
    return totals


def compare(live: dict[str, DomainAcceptance], baseline: dict[str, float], margin: float,
            min_draft_tokens: int) -> list[DomainDrift]:
    out = []
    for domain in sorted(set(live) | set(baseline)):
        acc = live.get(domain, DomainAcceptance())
        value, base = acc.expected_accept_len(), baseline.get(domain)
        drop = base - value if value is not None and base is not None else None
        if base is None:
            drifted, reason = False, "no baseline for this domain"
        elif acc.draft_tokens < min_draft_tokens or value is None:
            drifted, reason = False, f"too little traffic ({acc.draft_tokens} < {min_draft_tokens} draft tokens)"
        elif drop > margin:
            drifted, reason = True, f"drop {drop:.3f} > margin {margin:.3f}"
        else:
            drifted, reason = False, f"drop {drop:.3f} <= margin {margin:.3f}"
        out.append(DomainDrift(domain, value, base, acc.draft_tokens, acc.requests, drop, drifted, reason))
    return out


def window_start(window_s: float, now: float | None = None) -> float:
    return (now or time.time()) - window_s
