"""Opt-in traffic capture: sampled finished requests and their answers, written off the request path
into the rollout store format (jobs.train reads it like jobs.generate's output).

    <flywheel.output>/capture/<writer>/data/part-<k>.parquet   CAPTURE_SCHEMA (rollout columns + acceptance)
    <flywheel.output>/capture/<writer>/_commits/part-<k>.json  the commit marker (a shard counts only with it)
    <flywheel.output>/capture/<writer>/manifest.json           rewritten after every commit and every window
    <flywheel.output>/acceptance/<writer>/<window_end_ms>.json  per-domain acceptance windows (drift job)

<writer> names one replica process (host, pid, random suffix), so replicas never write the same key.
Exactly once: a row enters the bounded queue once (`offer`, from the event loop, never blocking; a
full queue drops and counts it), lands in exactly one shard, and the shard counts only after its data
file is written and its marker names it; a failed write is retried under the same name.
Nothing lost unseen: the manifest counts the rows queued and not yet committed (`pending`) at every commit
and window; a writer that was closed says `closed: true`. A replica killed with rows in its queue loses
those rows only, and its manifest (never closed) still holds how many were pending at its last window
(`unclosed_writers`: what the retraining job reports).

What is stored: the request's messages (the operator opted the domain in), the target's answer, token
ids, domain, sampling, served drafter version and acceptance figures. Never headers: the API key and
everything else of the HTTP request stay out (the capture never sees them).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import random
import socket
import threading
import time
import uuid
from dataclasses import dataclass

import pyarrow as pa
import tenacity

from dspark.flywheel.acceptance import AcceptanceStats
from dspark.flywheel.config import FlywheelConfig
from dspark.io import storage
from dspark.data import schema
from dspark.io.storage.rollout_store import path_in, read_commits, write_parquet

log = logging.getLogger("dspark.flywheel")

CAPTURE_SOURCE = "capture"
CAPTURE_SCHEMA = pa.schema(list(schema.ROLLOUT_SCHEMA) + [
    ("domain_source", pa.string()),        # metadata | user | request | classifier
    ("drafter", pa.string()),              # the served drafter reference, pinned (models:/<name>/<version>)
    ("drafter_version", pa.string()),
    ("rounds", pa.int32()),
    ("draft_tokens", pa.int32()),          # drafts verified (the verify budget spent)
    ("accepted_tokens", pa.int32()),
    ("accepted_per_pos", pa.list_(pa.int32())),
    ("verified_per_pos", pa.list_(pa.int32())),
    ("captured_at", pa.float64()),
])
WRITE_ATTEMPTS = 3
WRITE_BACKOFF_S = 0.5  # the wait before retry k is k * WRITE_BACKOFF_S


def writer_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def split_of(row_id: str, holdout_fraction: float) -> str:
    """Deterministic split from the row id: the same row always lands on the same side."""
    bucket = int(hashlib.sha256(row_id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "holdout" if bucket < holdout_fraction else "train"


def row_id_in(split: str, base: str, holdout_fraction: float) -> str:
    """A row id (a client's X-Request-Id) starting with `base` that split_of puts in `split`: how a
    client decides which side of the capture split its request lands on."""
    return next(f"{base}-{k}" for k in range(1000) if split_of(f"{base}-{k}", holdout_fraction) == split)


class RateLimit:
    """Token bucket: `rate` per second, burst of max(1, rate)."""

    def __init__(self, rate: float):
        self.rate, self.burst = rate, max(1.0, rate)
        self.tokens, self.at = self.burst, time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


@dataclass
class CaptureCounts:
    offered: int = 0      # finished requests seen
    sampled_out: int = 0  # not in the allow-list, not sampled, or over the rate
    dropped: int = 0      # the queue was full
    queued: int = 0       # rows handed to the writer thread
    written: int = 0      # rows committed
    failed: int = 0       # rows of shards that could not be written after retries

    @property
    def pending(self) -> int:
        """Rows queued and not yet committed (or failed): what a killed replica would lose."""
        return self.queued - self.written - self.failed


class FlywheelWriter:
    """Background thread: commits capture shards and acceptance windows to `cfg.output`."""

    def __init__(self, cfg: FlywheelConfig, stats: AcceptanceStats, served: dict, writer: str | None = None,
                 seed: int | None = None):
        self.cfg, self.stats, self.served = cfg, stats, served
        self.writer = writer or writer_id()
        self.capture_dir = storage.join(cfg.output, "capture", self.writer)
        self.acceptance_dir = storage.join(cfg.output, "acceptance", self.writer)
        self.counts = CaptureCounts()
        self._queue: queue.Queue = queue.Queue(maxsize=cfg.capture.queue_size)
        self._rng = random.Random(seed)
        self._rate = RateLimit(cfg.capture.max_per_s)
        self._stop = threading.Event()
        self._chunk = 0
        self._thread = threading.Thread(target=self._run, name="dspark-flywheel-writer", daemon=True)

    def start(self) -> "FlywheelWriter":
        self._thread.start()
        return self

    # ---- the request side (event loop): decide and hand off, never block ---------------------------
    def wants(self, domain: str) -> bool:
        c = self.cfg.capture
        self.counts.offered += 1
        ok = (c.enabled and domain in c.domains and self._rng.random() < c.sample_rate and self._rate.take())
        if not ok:
            self.counts.sampled_out += 1
        return ok

    def offer(self, row: dict) -> bool:
        try:
            self._queue.put_nowait(row)
            self.counts.queued += 1
            return True
        except queue.Full:
            self.counts.dropped += 1
            if self.counts.dropped == 1 or self.counts.dropped % 100 == 0:
                log.warning("capture queue full: %d captures dropped so far", self.counts.dropped)
            return False

    # ---- the writer thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        rows: list[dict] = []
        first_at = window_at = time.monotonic()
        c = self.cfg.capture
        while True:
            stopping = self._stop.is_set()
            try:
                rows.append(self._queue.get(timeout=0.2))
                if len(rows) == 1:
                    first_at = time.monotonic()
            except queue.Empty:
                pass
            now = time.monotonic()
            drained = stopping and self._queue.empty()
            if rows and (len(rows) >= c.shard_rows or now - first_at >= c.flush_every_s or drained):
                self._commit(rows)
                rows = []
            if now - window_at >= self.cfg.summary_every_s or drained:
                self._write_window()
                self._write_manifest(closed=drained)
                window_at = now
            if drained:
                return

    def _commit(self, rows: list[dict]) -> None:
        name = schema.shard_name(self._chunk)
        files = {"data": f"data/{name}.parquet"}
        marker = {"chunk": self._chunk, "rows": len(rows), "errors": 0, "files": files,
                  "rows_by_split": _count(rows, "split"), "rows_by_domain": _count(rows, "domain"),
                  "drafter_versions": _count(rows, "drafter_version"), "committed_at": time.time()}

        def write() -> None:
            write_parquet(path_in(self.capture_dir, files["data"]), rows, CAPTURE_SCHEMA)
            storage.write_text(path_in(self.capture_dir, "_commits", f"{name}.json"), json.dumps(marker))

        if _retry_write(write, f"capture shard {name}"):
            self._chunk += 1
            self.counts.written += len(rows)
            self._write_manifest()
        else:
            self.counts.failed += len(rows)

    def _write_manifest(self, closed: bool = False) -> None:
        if not (self.counts.queued or self._chunk or closed):
            return  # nothing captured yet: no manifest to keep current
        manifest = {"writer": self.writer, "source": CAPTURE_SOURCE, "shards": self._chunk,
                    "counts": vars(self.counts), "pending": self.counts.pending, "closed": closed,
                    **self.served, "updated_at": time.time()}
        _retry_write(lambda: storage.write_text(path_in(self.capture_dir, "manifest.json"), json.dumps(manifest, indent=2)),
               "capture manifest")

    def _write_window(self) -> None:
        window = self.stats.take_window()
        if not window:
            return
        end = time.time()
        record = {"writer": self.writer, "window_end": end, **self.served,
                  "domains": {d: a.to_dict() for d, a in window.items()}}
        _retry_write(lambda: storage.write_text(storage.join(self.acceptance_dir, f"{int(end * 1000)}.json"),
                                          json.dumps(record)), "acceptance window")

    def close(self, timeout_s: float = 30.0) -> None:
        """Commit what is queued and the last window; wait at most timeout_s."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)


def capture_row(req, messages: list[dict], answer: str, domain: str, domain_source: str, served: dict,
                holdout_fraction: float) -> dict:
    """A CAPTURE_SCHEMA row from a finished engine request (prompt ids + every generated token)."""
    prompt, generated, s = list(req.prompt_ids), list(req.tokens), req.stats
    sampling = {"temperature": req.sampling.temperature, "top_p": req.sampling.top_p, "top_k": req.sampling.top_k,
                "max_new_tokens": req.max_new_tokens}
    return {
        "prompt_id": req.id, "source": CAPTURE_SOURCE, "domain": domain, "split": split_of(req.id, holdout_fraction),
        "messages": [{"role": m["role"], "content": m["content"]} for m in messages]
                    + [{"role": "assistant", "content": answer}],
        "input_ids": prompt + generated, "loss_mask": [0] * len(prompt) + [1] * len(generated),
        "num_prompt_tokens": len(prompt), "num_generated_tokens": len(generated), "num_turns": 1,
        "finish_reason": req.finish_reason, "turn_finish_reasons": [req.finish_reason],
        "target": served.get("target", ""), "target_revision": served.get("target_revision", ""),
        "sampling": json.dumps(sampling), "chunk": 0, "domain_source": domain_source,
        "drafter": served.get("drafter") or "", "drafter_version": served.get("drafter_version") or "",
        "rounds": s.rounds, "draft_tokens": s.verified, "accepted_tokens": s.accepted,
        "accepted_per_pos": list(s.accepted_per_pos), "verified_per_pos": list(s.verified_per_pos),
        "captured_at": time.time(),
    }


# ---- readers --------------------------------------------------------------------------------------------
def writer_dirs(output: str, kind: str = "capture") -> list[str]:
    """The per-replica directories under <output>/<kind>/ (from a listing of their files)."""
    base = storage.join(output, kind).rstrip("/")
    try:
        files = storage.list_files(base)
    except FileNotFoundError:
        return []
    return sorted({f[len(base) + 1:].split("/", 1)[0] for f in files if f.startswith(base + "/")})


def capture_files(output: str) -> list[str]:
    """Committed capture shards of every writer (commit markers, never a listing of data/)."""
    files = []
    for writer in writer_dirs(output):
        out = storage.join(output, "capture", writer)
        files += [path_in(out, m["files"]["data"]) for _, m in sorted(read_commits(out).items())]
    return files


def unclosed_writers(output: str) -> dict[str, dict]:
    """Writers whose manifest was never closed, {writer: {"pending", "updated_at"}}: replicas still serving, or
    killed with `pending` rows queued at their last window (those rows are lost; nothing else is)."""
    found = {}
    for writer in writer_dirs(output):
        try:
            manifest = json.loads(storage.read_text(storage.join(output, "capture", writer, "manifest.json")))
        except (FileNotFoundError, ValueError):
            continue
        if not manifest.get("closed"):
            found[writer] = {"pending": int(manifest.get("pending", 0)), "updated_at": manifest.get("updated_at")}
    return found


def read_captures(output: str) -> pa.Table:
    import pyarrow.parquet as pq

    tables = []
    for uri in capture_files(output):
        fs, path = storage.pyarrow_fs(uri)
        tables.append(pq.read_table(path, filesystem=fs, schema=CAPTURE_SCHEMA))
    return pa.concat_tables(tables) if tables else CAPTURE_SCHEMA.empty_table()


def _count(rows: list[dict], key: str) -> dict:
    out: dict = {}
    for r in rows:
        out[r[key]] = out.get(r[key], 0) + 1
    return out


def _retry_write(fn, what: str) -> bool:
    """Call fn up to WRITE_ATTEMPTS times (0.5 s, 1 s, ... between); False (and an error logged) when
    every attempt failed: a storage error of any kind costs that write, never the serving path."""
    retrying = tenacity.Retrying(stop=tenacity.stop_after_attempt(WRITE_ATTEMPTS),
                                 wait=tenacity.wait_incrementing(start=WRITE_BACKOFF_S, increment=WRITE_BACKOFF_S),
                                 retry=tenacity.retry_if_exception_type(Exception), reraise=True)
    try:
        retrying(fn)
        return True
    except Exception as err:  # noqa: BLE001 - storage errors of any kind: retry, then count
        log.error("flywheel: %s not written after %d attempts: %s", what, retrying.statistics.get("attempt_number", 1), err)
        return False
