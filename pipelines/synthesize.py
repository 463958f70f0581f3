"""A prompt corpus for any target: user turns written by the target itself (Magpie) and/or real
datasets, filtered (pipelines' dspark/data/prompt_filters.py), as a resumable Ray Data job.

Magpie itself (the domain mix, the slot plan, the engine) is Ray-free library code in
dspark/data/magpie.py; this module is the Ray Data job around it.

Pipeline (driver side in `run_synthesis`):
1. plan: `magpie.num_prompts` slots, each with a domain (largest-remainder shares of the mix,
   interleaved), a topic and a seed, all pure functions of the slot index and `magpie.sampling.seed`;
   slots are cut into chunks, fingerprinted in `_plan.json` (as rollouts);
2. generate the uncommitted chunks on an actor pool of target replicas (pipelines/generate.py's
   `generate_chunks`): raw shards `raw/part-*.parquet` + commit markers `_commits/part-*.json`;
   a kill loses at most the chunks in flight;
3. finalize (cheap, deterministic, redone on every run): candidates = the real-corpus prompts (in
   source order) then the Magpie texts (in slot order); truncated generations are dropped, the rest
   run through the filter chain; kept prompts are written sorted by prompt_id to `data/part-*.parquet`,
   every dropped one with its reason to `dropped/filtered.parquet`, unreadable source records to
   `errors/load.parquet`, then `manifest.json` (format "dspark-prompts/1") last.

Output rows (PROMPT_SCHEMA): prompt_id (= dspark.data.prompts.prompt_id_of(system, turns), so
jobs.generate computes the same id), domain, turns, source, system. Point a jobs.generate source at
the output directory: dspark/data/prompts.py reads the shards its manifest lists.
"""
from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from pydantic import Field, model_validator

from dspark.config import StrictModel, config_to_dict
from dspark.data import schema
from dspark.data.magpie import (
    DROP_REASONS,
    DROPPED_SCHEMA,
    PROMPT_SCHEMA,
    RAW_SCHEMA,
    MagpieConfig,
    MagpieEngine,
    magpie_slots,
)
from dspark.data.prompt_filters import (
    EvalIndex,
    FilterConfig,
    PromptFilter,
    build_eval_index,
)
from dspark.data.prompts import (
    PROMPTS_FORMAT,
    LoadResult,
    PromptSource,
    load_prompts,
    prompt_id_of,
)
from dspark.data.rollout_engine import SamplingConfig
from dspark.data.schema import Plan
from dspark.io import storage
from dspark.io.storage.rollout_store import (
    path_in,
    prepare_output,
    read_commits,
    write_parquet,
)
from pipelines.actor_pool import target_actor_spec
from pipelines.generate import ComputeConfig, RunStats, generate_chunks


class SynthesizeConfig(StrictModel):
    target: str = Field("tiny", description="the model that writes the user turns (a target spec)")
    magpie: MagpieConfig | None = Field(None, description="self-synthesis; null = real corpora only")
    sources: list[PromptSource] = Field(default_factory=list, description="real prompt corpora, filtered too")
    eval_files: list[str] = Field(["data/eval"], description="evaluation JSONL files or directories (local or "
                                                             "s3://) to decontaminate against")
    filters: FilterConfig = Field(default_factory=FilterConfig, description="quality filters")
    output: str = Field(description="local dir or s3://bucket/prefix")
    chunk_size: int = Field(64, ge=1, description="Magpie slots per committed raw shard (the unit of resume)")
    shard_size: int = Field(10000, ge=1, description="kept prompts per output shard")
    max_context_tokens: int | None = Field(None, description="default: the target's max positions")
    overwrite: bool = Field(False, description="if the output holds a different plan: delete it (else refuse)")
    compute: ComputeConfig = Field(default_factory=ComputeConfig, description="the actor pool")

    @model_validator(mode="after")
    def _something(self) -> "SynthesizeConfig":
        if self.magpie is None and not self.sources:
            raise ValueError("nothing to do: set `magpie` and/or `sources`")
        return self


def make_magpie_plan(cfg: SynthesizeConfig) -> Plan:
    slots = magpie_slots(cfg.magpie) if cfg.magpie else []
    chunks = [slots[i:i + cfg.chunk_size] for i in range(0, len(slots), cfg.chunk_size)]
    settings = {"target": cfg.target, "magpie": cfg.magpie.model_dump() if cfg.magpie else None,
                "chunk_size": cfg.chunk_size, "max_context_tokens": cfg.max_context_tokens}
    return Plan(chunks, hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:24])


class MagpieActor:
    """A Ray Data actor: one target replica writing user turns for whole batches."""

    def __init__(self, spec: dict, local_copy: Callable[[str], str] | None = None):
        from dspark.models.precision import torch_dtype
        from dspark.models.target import load_target

        torch.set_num_threads(spec["threads"])
        # "auto" resolves here, on the replica's own device (bf16 only where it is native)
        target = load_target(spec["target"], dtype=torch_dtype(spec["dtype"], spec["device"]), device=spec["device"],
                             local_copy=local_copy)
        self.engine = MagpieEngine(target, SamplingConfig(**spec["sampling"]), spec["max_context_tokens"])

    def __call__(self, batch: pa.Table) -> pa.Table:
        return pa.Table.from_pylist(self.engine.run(batch.to_pylist()), schema=RAW_SCHEMA)


def commit_raw(out: str, chunk: int, results: list[dict]) -> dict:
    """Write the chunk's raw generations, then its marker (the commit point)."""
    name = schema.shard_name(chunk)
    rows = sorted(results, key=lambda r: r["slot"])
    write_parquet(path_in(out, "raw", f"{name}.parquet"), rows, RAW_SCHEMA)
    marker = {"chunk": chunk, "rows": len(rows), "errors": sum(r["error"] is not None for r in rows),
              "generated_tokens": sum(r["num_tokens"] for r in rows),
              "files": {"raw": f"raw/{name}.parquet"}, "committed_at": time.time()}
    storage.write_text(path_in(out, "_commits", f"{name}.json"), json.dumps(marker))
    return marker


def read_raw(out: str) -> list[dict]:
    """Every committed raw generation, in slot order."""
    rows = []
    for _, marker in sorted(read_commits(out).items()):
        fs, path = storage.pyarrow_fs(path_in(out, marker["files"]["raw"]))
        rows.extend(pq.read_table(path, filesystem=fs, schema=RAW_SCHEMA).to_pylist())
    return sorted(rows, key=lambda r: r["slot"])


# ---------------------------------------------------------------- finalize: filter and write
@dataclass
class Candidate:
    prompt_id: str
    domain: str
    turns: list[str]
    source: str
    system: str = ""
    location: str = ""


def magpie_candidates(raw: list[dict], target: str) -> tuple[list[Candidate], list[dict]]:
    """Raw generations -> candidates, and drop rows for failed or truncated ones."""
    kept, dropped = [], []
    for r in raw:
        cand = Candidate(prompt_id_of("", [r["text"]]), r["domain"], [r["text"]], f"magpie:{target}",
                         location=f"slot {r['slot']}")
        if r["error"] is not None:
            dropped.append(_dropped(cand, "generation_error", r["error"]))
        elif r["finish_reason"] != "stop":
            dropped.append(_dropped(cand, "truncated", f"no end of turn within {r['num_tokens']} tokens"))
        else:
            kept.append(cand)
    return kept, dropped


def corpus_candidates(loaded: LoadResult) -> list[Candidate]:
    return [Candidate(p.prompt_id, p.domain, p.turns, p.source, p.system, p.location) for p in loaded.prompts]


def _dropped(c: Candidate, reason: str, detail: str) -> dict:
    return {"prompt_id": c.prompt_id, "domain": c.domain, "turns": c.turns, "source": c.source,
            "location": c.location, "reason": reason, "detail": detail}


def eval_files_text(uris: list[str]) -> dict[str, str]:
    """Every .jsonl/.json file under the given files/directories -> its text. Missing paths are errors."""
    texts = {}
    for uri in uris:
        files = storage.list_files(uri)
        if not files:
            raise FileNotFoundError(f"evaluation file/directory not found or empty: {uri} (check `eval_files`)")
        for f in files:
            if f.lower().endswith((".jsonl", ".json")):
                texts[f] = storage.read_bytes(f).decode("utf-8")
    return texts


@dataclass
class FilterOutcome:
    kept: list[Candidate] = field(default_factory=list)
    dropped: list[dict] = field(default_factory=list)
    counts: dict = field(default_factory=dict)


def apply_filters(candidates: list[Candidate], pre_dropped: list[dict], cfg: FilterConfig,
                  eval_index: EvalIndex | None) -> FilterOutcome:
    """Run the chain over the candidates in order. An id already kept is always a duplicate, whatever
    the dedup settings, so the output holds every prompt_id at most once."""
    chain = PromptFilter(cfg, eval_index)
    outcome = FilterOutcome(dropped=list(pre_dropped))
    kept_ids: set[str] = set()
    for cand in candidates:
        if cand.prompt_id in kept_ids:
            outcome.dropped.append(_dropped(cand, "duplicate", "same prompt_id as an earlier kept prompt"))
            continue
        verdict = chain.check(cand.prompt_id, cand.turns, cand.domain)
        if verdict.reason is None:
            outcome.kept.append(cand)
            kept_ids.add(cand.prompt_id)
        else:
            outcome.dropped.append(_dropped(cand, verdict.reason, verdict.detail))
    by_reason = Counter(d["reason"] for d in outcome.dropped)
    outcome.counts = {"candidates": len(candidates) + len(pre_dropped), "kept": len(outcome.kept),
                      "dropped": {r: by_reason.get(r, 0) for r in DROP_REASONS},
                      "kept_by_domain": dict(sorted(Counter(c.domain for c in outcome.kept).items())),
                      "kept_by_source": dict(sorted(Counter(c.source for c in outcome.kept).items()))}
    return outcome


def kept_digest(kept: list[Candidate]) -> str:
    return hashlib.sha256("\n".join(sorted(c.prompt_id for c in kept)).encode()).hexdigest()


def write_final(out: str, outcome: FilterOutcome, loaded: LoadResult, shard_size: int) -> list[str]:
    """Data shards (sorted by prompt_id), dropped rows and load errors; stale shards of an earlier
    finalize are deleted. Returns the shard paths (relative to `out`)."""
    rows = sorted(({"prompt_id": c.prompt_id, "domain": c.domain, "turns": c.turns, "source": c.source,
                    "system": c.system} for c in outcome.kept), key=lambda r: r["prompt_id"])
    shards = []
    for i in range(0, max(len(rows), 1), shard_size):
        shards.append(f"data/{schema.shard_name(i // shard_size)}.parquet")
        write_parquet(path_in(out, shards[-1]), rows[i:i + shard_size], PROMPT_SCHEMA)
    wanted = {path_in(out, s) for s in shards}
    for uri in storage.list_files(path_in(out, "data")):
        if uri not in wanted:
            storage.delete(uri)
    write_parquet(path_in(out, "dropped", "filtered.parquet"), outcome.dropped, DROPPED_SCHEMA)
    write_parquet(path_in(out, "errors", "load.parquet"), loaded.errors, schema.ERROR_SCHEMA)
    return shards


def length_stats(kept: list[Candidate]) -> dict:
    """Characters of the kept prompts per domain (for the manifest; plots come from the rows)."""
    by_domain: dict[str, list[int]] = {}
    for c in kept:
        by_domain.setdefault(c.domain, []).append(sum(len(t) for t in c.turns))
    return {d: {"n": len(v), "min": min(v), "max": max(v), "mean": sum(v) / len(v)}
            for d, v in sorted(by_domain.items())}


# ---------------------------------------------------------------- the job
@dataclass
class SynthesisResult:
    manifest: dict
    stats: RunStats
    outcome: FilterOutcome = field(repr=False, default=None)
    raw: list[dict] = field(repr=False, default_factory=list)
    source_digests: dict = field(default_factory=dict)


def source_digests(loaded: LoadResult, sources: list[PromptSource]) -> dict[str, dict]:
    """label -> {uri, digest}: sha256 of the prompt ids read from that source."""
    ids: dict[str, list[str]] = {}
    for p in loaded.prompts:
        ids.setdefault(p.source, []).append(p.prompt_id)
    return {s.label: {"uri": s.uri, "digest": hashlib.sha256("\n".join(ids.get(s.label, [])).encode()).hexdigest()}
            for s in sources}


def build_manifest(cfg: SynthesizeConfig, plan: Plan, loaded: LoadResult, outcome: FilterOutcome,
                   shards: list[str], commits: dict) -> dict:
    return {
        "format": PROMPTS_FORMAT, "complete": len(commits) == len(plan.chunks), "target": cfg.target,
        "plan": plan.describe(), "counts": {**outcome.counts, "records_read": loaded.records_read,
                                            "source_duplicates": loaded.duplicates, "load_errors": len(loaded.errors),
                                            "magpie_generated": sum(m["rows"] for m in commits.values())},
        "errors_by_reason": dict(Counter(e["reason"] for e in loaded.errors)),
        "lengths": length_stats(outcome.kept), "digest": kept_digest(outcome.kept),
        "shards": shards, "dropped_file": "dropped/filtered.parquet", "error_files": ["errors/load.parquet"],
        "config": config_to_dict(cfg), "written_at": time.time(),
    }


def run_synthesis(cfg: SynthesizeConfig, on_chunk: Callable[[RunStats], None] | None = None,
                  progress: bool = True, on_start: Callable[[str], None] | None = None) -> SynthesisResult:
    out = cfg.output.rstrip("/")
    storage.check_writable(out)
    loaded = load_prompts(cfg.sources, files=storage) if cfg.sources else LoadResult()
    eval_index = build_eval_index(eval_files_text(cfg.eval_files), cfg.filters.decontam_ngram,
                                  cfg.filters.decontam_max_ngram_prompts)
    plan = make_magpie_plan(cfg)
    prepare_output(out, plan, cfg.overwrite)
    if on_start:
        on_start(out)
    commits = read_commits(out)
    pending = [c for c in range(len(plan.chunks)) if c not in commits]
    stats = RunStats(chunks_total=len(plan.chunks), chunks_skipped=len(plan.chunks) - len(pending))
    if pending:
        generate_chunks(cfg, plan, pending, out, stats, on_chunk, progress, actor=MagpieActor,
                        spec=target_actor_spec(cfg, cfg.magpie.sampling), commit=commit_raw, desc="magpie")
    raw = read_raw(out)
    magpie, pre_dropped = magpie_candidates(raw, cfg.target)
    outcome = apply_filters(corpus_candidates(loaded) + magpie, pre_dropped, cfg.filters, eval_index)
    shards = write_final(out, outcome, loaded, cfg.shard_size)
    manifest = build_manifest(cfg, plan, loaded, outcome, shards, read_commits(out))
    manifest["eval_prompts"] = eval_index.prompts
    storage.write_text(path_in(out, "manifest.json"), json.dumps(manifest, indent=2))
    return SynthesisResult(manifest, stats, outcome, raw, source_digests(loaded, cfg.sources))


def read_prompts(output_uri: str) -> pa.Table:
    """The kept prompts of a finished synthesis output, via its manifest."""
    out = output_uri.rstrip("/")
    manifest = json.loads(storage.read_text(path_in(out, "manifest.json")))
    tables = []
    for shard in manifest["shards"]:
        fs, path = storage.pyarrow_fs(path_in(out, shard))
        tables.append(pq.read_table(path, filesystem=fs, schema=PROMPT_SCHEMA))
    return pa.concat_tables(tables) if tables else PROMPT_SCHEMA.empty_table()
