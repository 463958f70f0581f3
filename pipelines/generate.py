"""Rollout generation: prompts → the target's own answers, as a resumable Ray Data job.

Pipeline (driver side in `run_rollouts`):
1. read and normalise the prompt sources (dspark/data/prompts.py), collapse duplicates, split;
2. plan: sort the unique prompts by id and cut them into fixed chunks; the plan's fingerprint
   (prompts + generation settings) is stored in `_plan.json`, so a rerun with the same config
   resumes and a rerun with a different one is refused (or wiped with `overwrite: true`);
3. stream the prompts of the uncommitted chunks through `map_batches` on an actor pool of target
   replicas (`ActorPoolStrategy`); each actor runs `RolloutEngine` on its batch;
4. as soon as every row of a chunk is back, write its shard(s) and then its commit marker.
   A chunk counts as done only when its marker exists, so a kill at any point loses at most the
   chunks in flight; their half-written leftovers carry the same deterministic names and are
   overwritten on the rerun. The final dataset therefore holds every prompt_id exactly once;
5. write `manifest.json` from the commit markers.

The target side (chat template, generation, the Ray Data callable) is dspark/data/rollout_engine.py;
the on-disk format is dspark/data/schema.py, written and read by dspark/io/storage/rollout_store.py.

Backends (`backend`): `engine` (default) generates with dspark.decoding.generator.BatchGenerator, continuous
batching over the serving engine's ragged KV store; `transformers` runs HF `generate` on fixed
left-padded batches (kept for comparison); `vllm` hands generation to Ray Data's vLLM processor
(pipelines/generate_vllm.py; GPU clusters only, untested here).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Callable, Literal

from pydantic import Field, field_validator

from dspark.config import StrictModel, config_to_dict
from dspark.decoding.generator import GeneratorConfig
from dspark.io import storage
from dspark.data import schema
from dspark.models.precision import AUTO_DESCRIPTION, DtypeSetting
from pipelines import generate_vllm
from pipelines.actor_pool import (DEFAULT_START_TIMEOUT_S, START_TIMEOUT_DESCRIPTION, WorkerAsk, data_pool,
                                  target_actor_spec)
from dspark.data.prompts import LoadResult, PromptSource, load_prompts
from dspark.data.rollout_engine import RolloutActor, SamplingConfig
from dspark.data.schema import Plan, add_counts
from dspark.io.storage.rollout_store import commit_chunk, path_in, prepare_output, read_commits, write_parquet
from pipelines.generate_vllm import VllmConfig

FAIL_AFTER_ENV = "DSPARK_FAIL_AFTER_CHUNKS"  # test hook: raise after this many chunk commits


class ComputeConfig(StrictModel):
    replicas: int = Field(1, description="target replicas (Ray actors)")
    batch_size: int = Field(64, description="Prompts handed to a replica at a time: one fixed HF generate batch "
                                            "(transformers), the pool the engine keeps up to engine.max_batch "
                                            "of decoding (engine).")
    num_cpus: float = Field(1.0, description="per replica")
    num_gpus: float = Field(0.0, description="per replica; > 0 puts the target on CUDA")
    dtype: DtypeSetting = Field(
        "auto", description="target weights dtype, resolved on each replica's device; " + AUTO_DESCRIPTION
        + "; null reads as auto. Backend vllm hands auto to vLLM's own dtype auto")
    torch_threads: int | None = Field(None, description="default: max(1, int(num_cpus))")
    start_timeout_s: float = Field(DEFAULT_START_TIMEOUT_S, gt=0, description=START_TIMEOUT_DESCRIPTION)

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype(cls, v):
        return "auto" if v is None else v  # null (the old default) is auto

    @property
    def device(self) -> str:
        return "cuda" if self.num_gpus > 0 else "cpu"


class RolloutConfig(StrictModel):
    target: str = Field("tiny", description='"tiny" | "smollm2-135m" | model dir | s3:// dir | hub name')
    sources: list[PromptSource] = Field(description="prompt sources (JSONL, Parquet, datasets save, a jobs.synthesize output; local or s3://)")
    output: str = Field(description="local dir or s3://bucket/prefix (layout: dspark/data/schema.py)")
    holdout_fraction: float = Field(0.05, description="share of prompts (by id hash) in the `holdout` split, for calibration")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="how the target answers")
    max_context_tokens: int | None = Field(None, description="default: the target's max positions")
    chunk_size: int = Field(256, description="prompts per committed shard")
    overwrite: bool = Field(False, description="if the output holds a different plan: delete it (else refuse)")
    backend: Literal["engine", "transformers", "vllm"] = Field(
        "engine", description="engine: continuous batching (dspark.decoding.generator, the serving engine's "
        "target-only path); transformers: HF generate on fixed batches of compute.batch_size; vllm: Ray "
        "Data's vLLM batch processor (needs vllm and GPUs; untested in this project).")
    compute: ComputeConfig = Field(default_factory=ComputeConfig, description="the actor pool of target replicas")
    engine: GeneratorConfig = Field(default_factory=GeneratorConfig,
                                    description="backend engine: continuous-batching settings per replica "
                                                "(each replica keeps up to compute.batch_size prompts in hand).")
    vllm: VllmConfig = Field(default_factory=VllmConfig, description="backend vllm: engine and processor settings.")

    @field_validator("sources")
    @classmethod
    def _sources(cls, v: list) -> list:
        if not v:
            raise ValueError("give at least one prompt source")
        return v

    @field_validator("chunk_size")
    @classmethod
    def _chunk(cls, v: int) -> int:
        if v < 1:
            raise ValueError("chunk_size must be >= 1")
        return v


def make_plan(cfg: RolloutConfig, loaded: LoadResult) -> Plan:
    prompts = sorted(loaded.prompts, key=lambda p: p.prompt_id)
    chunks = [prompts[i:i + cfg.chunk_size] for i in range(0, len(prompts), cfg.chunk_size)]
    digest = hashlib.sha256()
    settings = {"target": cfg.target, "sampling": cfg.sampling.model_dump(), "chunk_size": cfg.chunk_size,
                "max_context_tokens": cfg.max_context_tokens, "backend": cfg.backend}
    digest.update(json.dumps(settings, sort_keys=True).encode())
    for p in prompts:
        digest.update(f"{p.prompt_id}|{p.source}|{p.domain}|{p.split}\n".encode())
    return Plan(chunks, digest.hexdigest()[:24])


def build_manifest(cfg: RolloutConfig, plan: Plan, loaded: LoadResult, commits: dict[int, dict]) -> dict:
    errors_by_reason = dict(Counter(e["reason"] for e in loaded.errors))
    rows_by_split, finish = {}, {}
    for marker in commits.values():
        add_counts(errors_by_reason, marker["errors_by_reason"])
        add_counts(rows_by_split, marker["rows_by_split"])
        add_counts(finish, marker["finish_reasons"])
    ordered = [commits[c] for c in sorted(commits)]
    rows_out = sum(m["rows"] for m in ordered)
    generated = sum(m["generated_tokens"] for m in ordered)
    return {
        "format": "dspark-rollouts/1",
        "complete": len(commits) == len(plan.chunks),
        "target": cfg.target,
        "sampling": cfg.sampling.model_dump(),
        "plan": plan.describe(),
        "counts": {"records_read": loaded.records_read, "unique_prompts": len(loaded.prompts),
                   "duplicates": loaded.duplicates, "rows_out": rows_out, "rows_by_split": rows_by_split,
                   "errors": sum(errors_by_reason.values()), "load_errors": len(loaded.errors),
                   "generation_errors": sum(m["errors"] for m in ordered)},
        "errors_by_reason": errors_by_reason,
        "finish_reasons": finish,
        "tokens": {"prompt": sum(m["prompt_tokens"] for m in ordered), "generated": generated,
                   "mean_generated_per_row": generated / rows_out if rows_out else 0.0},
        "shards": [m["files"]["data"] for m in ordered],
        "error_files": ["errors/load.parquet"] + [m["files"]["errors"] for m in ordered if "errors" in m["files"]],
        "config": config_to_dict(cfg),
        "written_at": time.time(),
    }


# ---------------------------------------------------------------- the Ray Data stage
@dataclass
class RunStats:
    """What this invocation did (the manifest describes the whole dataset)."""

    chunks_total: int = 0
    chunks_skipped: int = 0  # already committed by an earlier run
    chunks_done: int = 0
    rows_done: int = 0
    errors: int = 0
    generated_tokens: int = 0
    wall_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def metrics(self) -> dict:
        return {"chunks_done": self.chunks_done, "rows_done": self.rows_done, "errors_done": self.errors,
                "generated_tokens": self.generated_tokens, "tokens_per_s": self.tokens_per_s}


def rollout_actor_spec(cfg: RolloutConfig) -> dict:
    return target_actor_spec(cfg, cfg.sampling, backend=cfg.backend, engine=cfg.engine.model_dump())


def _fail_after() -> int | None:
    value = os.environ.get(FAIL_AFTER_ENV)
    return int(value) if value else None


def uses_vllm(cfg, actor: type) -> bool:
    return actor is RolloutActor and getattr(cfg, "backend", None) == "vllm"


def generation_stage(cfg: RolloutConfig, ds, rows: list[dict], actor: type, spec: dict | None, pool: dict):
    """Prompt rows -> result rows: an actor pool of `actor` replicas (RolloutActor: the engine or
    transformers backend; jobs.synthesize: its Magpie actor) in the reserved `pool`, or Ray Data's
    vLLM processor (rollouts with backend vllm)."""
    if uses_vllm(cfg, actor):
        return generate_vllm.vllm_stage(cfg, ds, max(len(r["turns"]) for r in rows))
    return ds.map_batches(  # every actor takes (spec, local_copy): an s3:// target is copied to its node
        actor, fn_constructor_kwargs={"spec": spec or rollout_actor_spec(cfg), "local_copy": storage.local_copy},
        batch_size=cfg.compute.batch_size,
        batch_format="pyarrow", **pool, num_cpus=cfg.compute.num_cpus, num_gpus=cfg.compute.num_gpus or None)


def generate_chunks(cfg: RolloutConfig, plan: Plan, pending: list[int], out: str, stats: RunStats,
                    on_chunk: Callable[[RunStats], None] | None = None, progress: bool = True, *,
                    actor: type = RolloutActor, spec: dict | None = None,
                    commit: Callable[[str, int, list[dict]], dict] = commit_chunk, desc: str = "rollouts") -> None:
    """Stream the pending chunks through the actor pool; commit each chunk when it is complete.
    `actor(spec)` maps a pyarrow batch of plan rows to result rows carrying their `chunk`;
    `commit(out, chunk, results)` writes a chunk and returns its marker (with rows, errors,
    generated_tokens). jobs.synthesize reuses this loop with its own actor and commit. The pool's
    resources are reserved first (pipelines.actor_pool.data_pool): replicas that cannot start within
    compute.start_timeout_s fail the run, naming what holds the cluster."""
    c = cfg.compute
    ask = WorkerAsk(f"{desc} replicas", c.replicas, c.num_cpus, c.num_gpus,
                    "compute.replicas / compute.num_cpus / compute.num_gpus")
    with (contextlib.nullcontext({}) if uses_vllm(cfg, actor) else data_pool(ask, c.start_timeout_s)) as pool:
        _stream_chunks(cfg, plan, pending, out, stats, on_chunk, progress, actor, spec, commit, desc, pool)


def _stream_chunks(cfg, plan, pending, out, stats, on_chunk, progress, actor, spec, commit, desc, pool: dict) -> None:
    import ray.data
    from tqdm import tqdm

    rows = [dict(p.as_row(), chunk=c) for c in pending for p in plan.chunks[c]]
    expected = {c: len(plan.chunks[c]) for c in pending}
    ctx = ray.data.DataContext.get_current()
    saved = (ctx.execution_options.preserve_order, ctx.enable_progress_bars)
    ctx.execution_options.preserve_order = True  # chunks complete in order: small driver buffers
    ctx.enable_progress_bars = progress  # Ray Data's operator bars, and ours (prompts, chunks, tok/s)
    fail_after = _fail_after()
    buffers: dict[int, list[dict]] = defaultdict(list)
    start = time.perf_counter()
    try:
        blocks = max(1, min(1000, -(-len(rows) // cfg.compute.batch_size)))
        ds = generation_stage(cfg, ray.data.from_items(rows, override_num_blocks=blocks), rows, actor, spec, pool)
        with tqdm(total=len(rows), desc=desc, unit="prompt", disable=not progress) as bar:
            for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None):
                for result in batch.to_pylist():
                    buffers[result["chunk"]].append(result)
                bar.update(batch.num_rows)
                for chunk in [c for c, got in buffers.items() if len(got) == expected[c]]:
                    marker = commit(out, chunk, buffers.pop(chunk))
                    stats.chunks_done += 1
                    stats.rows_done += marker["rows"]
                    stats.errors += marker["errors"]
                    stats.generated_tokens += marker["generated_tokens"]
                    stats.wall_s = time.perf_counter() - start
                    bar.set_postfix(chunks=f"{stats.chunks_done + stats.chunks_skipped}/{stats.chunks_total}",
                                    tok_s=f"{stats.tokens_per_s:.1f}")
                    if on_chunk:
                        on_chunk(stats)
                    if fail_after is not None and stats.chunks_done >= fail_after:
                        raise RuntimeError(f"injected failure after {stats.chunks_done} chunk(s) ({FAIL_AFTER_ENV})")
    finally:
        ctx.execution_options.preserve_order, ctx.enable_progress_bars = saved
        stats.wall_s = time.perf_counter() - start
    if buffers or stats.chunks_done != len(pending):
        raise RuntimeError(f"the pipeline ended with {len(pending) - stats.chunks_done} chunk(s) incomplete; "
                           f"rerun the same command to finish them")


@dataclass
class RolloutResult:
    manifest: dict
    stats: RunStats
    load: LoadResult = field(repr=False, default=None)


def run_rollouts(cfg: RolloutConfig, on_chunk: Callable[[RunStats], None] | None = None,
                 progress: bool = True, on_start: Callable[[str], None] | None = None) -> RolloutResult:
    """Generate (or finish generating) the rollout dataset described by `cfg`; see the module doc.
    `on_start(output)` runs once the output holds this plan (e.g. to save the config there);
    `on_chunk(stats)` after every committed chunk."""
    out = cfg.output.rstrip("/")
    storage.check_writable(out)  # fail fast, before reading or generating anything
    if cfg.backend == "vllm":
        generate_vllm.require_vllm()
    loaded = load_prompts(cfg.sources, cfg.holdout_fraction, files=storage)
    plan = make_plan(cfg, loaded)
    prepare_output(out, plan, cfg.overwrite)
    if on_start:
        on_start(out)
    write_parquet(path_in(out, "errors", "load.parquet"), loaded.errors, schema.ERROR_SCHEMA)
    commits = read_commits(out)
    pending = [c for c in range(len(plan.chunks)) if c not in commits]
    stats = RunStats(chunks_total=len(plan.chunks), chunks_skipped=len(plan.chunks) - len(pending))
    if pending:
        generate_chunks(cfg, plan, pending, out, stats, on_chunk, progress)
    manifest = build_manifest(cfg, plan, loaded, read_commits(out))
    storage.write_text(path_in(out, "manifest.json"), json.dumps(manifest, indent=2))
    return RolloutResult(manifest, stats, loaded)
