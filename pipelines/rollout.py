"""Rollout generation: prompts → the target's own answers, as a resumable Ray Data job.

Pipeline (driver side in `run_rollouts`):
1. read and normalise the prompt sources (pipelines/prompts.py), collapse duplicates, split;
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

Sampling is made per prompt: every row has its own torch.Generator seeded from (seed, prompt_id,
turn), so a prompt's answer does not depend on which batch, actor or run generated it (up to
floating-point differences between batch shapes).

Backends (`backend`): `engine` (default) generates with dspark.generator.BatchGenerator, continuous
batching over the serving engine's ragged KV store; `transformers` runs HF `generate` on fixed
left-padded batches (kept for comparison); `vllm` hands generation to Ray Data's vLLM processor
(pipelines/rollout_vllm.py; GPU clusters only, untested here).
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Callable, Literal

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from pydantic import Field, field_validator

from dspark.io import storage
from dspark.config import StrictModel, config_to_dict
from dspark.generator import BatchGenerator, GeneratorConfig
from dspark.sampling import SamplingParams, to_probs
from pipelines import rollout_vllm, schema
from pipelines.actor_pool import DEFAULT_START_TIMEOUT_S, START_TIMEOUT_DESCRIPTION, WorkerAsk, data_pool
from pipelines.prompts import LoadResult, Prompt, PromptSource, error_row, load_prompts
from pipelines.rollout_vllm import VllmConfig

FAIL_AFTER_ENV = "DSPARK_FAIL_AFTER_CHUNKS"  # test hook: raise after this many chunk commits
SENTINEL = "<<DSPARK-ANSWER-7f3a>>"  # stands in for an answer when rendering the chat template


# ---------------------------------------------------------------- config
class SamplingConfig(StrictModel):
    temperature: float = 0.7  # 0 = greedy
    top_p: float = 0.9
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 256  # per assistant turn
    seed: int = 0

    @field_validator("max_new_tokens")
    @classmethod
    def _max_new(cls, v: int) -> int:
        if v < 1:
            raise ValueError("max_new_tokens must be >= 1")
        return v

    def params(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)


class ComputeConfig(StrictModel):
    replicas: int = 1  # target replicas (Ray actors)
    batch_size: int = Field(64, description="Prompts handed to a replica at a time: one fixed HF generate batch "
                                            "(transformers), the pool the engine keeps up to engine.max_batch "
                                            "of decoding (engine).")
    num_cpus: float = 1.0  # per replica
    num_gpus: float = 0.0  # per replica; > 0 puts the target on CUDA
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="Target weights dtype; default bfloat16 on CUDA (num_gpus > 0), float32 on CPU.")
    torch_threads: int | None = None  # default: max(1, int(num_cpus))
    start_timeout_s: float = Field(DEFAULT_START_TIMEOUT_S, gt=0, description=START_TIMEOUT_DESCRIPTION)

    def resolved_dtype(self) -> str:
        return self.dtype or ("bfloat16" if self.num_gpus > 0 else "float32")


class RolloutConfig(StrictModel):
    target: str = "tiny"  # "tiny" | "smollm2-135m" | model dir | s3:// dir | hub name
    sources: list[PromptSource]
    output: str  # local dir or s3://bucket/prefix (layout: pipelines/schema.py)
    holdout_fraction: float = 0.05
    sampling: SamplingConfig = SamplingConfig()
    max_context_tokens: int | None = None  # default: the target's max positions
    chunk_size: int = 256  # prompts per committed shard
    overwrite: bool = False  # if the output holds a different plan: delete it (else refuse)
    backend: Literal["engine", "transformers", "vllm"] = Field(
        "engine", description="engine: continuous batching (dspark.generator, the serving engine's "
        "target-only path); transformers: HF generate on fixed batches of compute.batch_size; vllm: Ray "
        "Data's vLLM batch processor (needs vllm and GPUs; untested in this project).")
    compute: ComputeConfig = ComputeConfig()
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


# ---------------------------------------------------------------- generation core (no Ray)
def row_seed(seed: int, prompt_id: str, turn: int) -> int:
    digest = hashlib.sha256(f"{seed}/{prompt_id}/{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _row_sampler_class():
    from transformers import LogitsProcessor

    class RowSampler(LogitsProcessor):
        """Samples each row from `to_probs(logits)` with that row's own generator and returns
        scores that make greedy decoding pick exactly the sampled token."""

        def __init__(self, sp: SamplingParams, generators: list[torch.Generator]):
            self.sp, self.generators = sp, generators

        def __call__(self, input_ids, scores):
            probs = to_probs(scores, self.sp)
            picks = [torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(self.generators)]
            out = torch.full_like(scores, float("-inf"))
            return out.scatter_(1, torch.stack(picks).to(scores.device), 0.0)

    return RowSampler


def cut_at_stop(seq: list[int], stops: set[int]) -> list[int]:
    """Generated ids up to and including the first stop token (later ids are padding)."""
    for i, tok in enumerate(seq):
        if tok in stops:
            return seq[: i + 1]
    return seq


@dataclass
class Conversation:
    """One prompt being rolled out: the exact ids so far and which of them the target generated."""

    row: dict
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    finish: list[str] = field(default_factory=list)
    error: tuple[str, str] | None = None

    def extend(self, ids: list[int], generated: bool) -> None:
        self.ids.extend(ids)
        self.mask.extend([int(generated)] * len(ids))


class ChatRollout:
    """Conversation bookkeeping of a rollout, no generation: opens user turns with the exact template
    tokens, records answers and builds result rows. Needs from `target` only its tokenizer side
    (tokenizer, chat_ids, chat_template_kwargs, eos_token_ids, name, revision, max_positions)."""

    def __init__(self, target, sampling: SamplingConfig, max_context_tokens: int | None = None):
        self.target = target
        self.sampling = sampling
        self.sp = sampling.params()
        self.stops = set(target.eos_token_ids)
        if not self.stops:
            raise ValueError(f"target {target.name} has no eos token id; cannot tell where an answer ends")
        self.limit = max_context_tokens or target.max_positions
        self.sampling_json = json.dumps(sampling.model_dump(), sort_keys=True)

    def new_conversation(self, row: dict) -> Conversation:
        return Conversation(row, messages=[{"role": "system", "content": row["system"]}] if row["system"] else [])

    def budget(self, conv: Conversation) -> int:
        """New tokens allowed for the turn being answered (rows near the context limit get fewer)."""
        return min(self.sampling.max_new_tokens, self.limit - len(conv.ids))

    # -- token plumbing
    def decode(self, ids: list[int]) -> str:
        return self.target.tokenizer.decode(ids, skip_special_tokens=False)

    def _next_prompt_ids(self, conv: Conversation, turn: int) -> list[int]:
        """Template tokens that open user turn `turn` and the next assistant answer."""
        user = {"role": "user", "content": conv.row["turns"][turn]}
        if turn == 0:
            return self.target.chat_ids(conv.messages + [user], add_generation_prompt=True)
        history = conv.messages[:-1] + [{"role": "assistant", "content": SENTINEL}, user]
        text = self.target.tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True,
                                                         **self.target.chat_template_kwargs)
        if SENTINEL not in text:
            raise ValueError("the chat template dropped an earlier assistant turn")
        suffix = text[text.rindex(SENTINEL) + len(SENTINEL):]
        last = conv.ids[-1]
        stop_text = self.decode([last]) if last in self.stops else ""
        if stop_text and suffix.startswith(stop_text):
            suffix = suffix[len(stop_text):]  # the generated stop token already closes the answer
        return self.target.tokenizer(suffix, add_special_tokens=False)["input_ids"]

    def open_turn(self, conv: Conversation, turn: int) -> None:
        try:
            prompt = self._next_prompt_ids(conv, turn)
        except ValueError as err:
            conv.error = ("template_error", f"turn {turn}: {err}")
            return
        conv.extend(prompt, generated=False)
        conv.messages.append({"role": "user", "content": conv.row["turns"][turn]})
        if len(conv.ids) >= self.limit:
            conv.error = ("prompt_too_long", f"turn {turn}: the prompt is {len(conv.ids)} tokens, the context "
                                             f"limit is {self.limit} (raise max_context_tokens or shorten the prompt)")

    def add_answer(self, conv: Conversation, new: list[int]) -> None:
        """Append one generated answer (stop token kept, if any) to a conversation."""
        stopped = bool(new) and new[-1] in self.stops
        conv.extend(new, generated=True)
        conv.finish.append("stop" if stopped else "length")
        content = new[:-1] if stopped else new
        conv.messages.append({"role": "assistant", "content": self.decode(content)})

    def result(self, conv: Conversation) -> dict:
        row = conv.row
        ok = conv.error is None
        generated = sum(conv.mask) if ok else 0
        return {
            "prompt_id": row["prompt_id"], "source": row["source"], "domain": row["domain"], "split": row["split"],
            "messages": conv.messages if ok else [], "input_ids": conv.ids if ok else [],
            "loss_mask": conv.mask if ok else [], "num_prompt_tokens": len(conv.ids) - generated if ok else 0,
            "num_generated_tokens": generated, "num_turns": len(conv.finish) if ok else 0,
            "finish_reason": ("length" if "length" in conv.finish else "stop") if ok else "",
            "turn_finish_reasons": conv.finish if ok else [], "target": self.target.name,
            "target_revision": self.target.revision, "sampling": self.sampling_json, "chunk": row.get("chunk", 0),
            "error_reason": None if ok else conv.error[0], "error_detail": None if ok else conv.error[1],
            "location": row.get("location", ""),
            "raw": None if ok else json.dumps({"system": row["system"], "turns": row["turns"]},
                                              ensure_ascii=False)[:schema.RAW_LIMIT],
        }


class RolloutEngine(ChatRollout):
    """Batched multi-turn generation on one target replica, by continuous batching (backend engine)
    or HF generate on fixed batches (backend transformers). Mutates the target's default generation
    config to a neutral one so that nothing but `to_probs` shapes the sampling."""

    def __init__(self, target, sampling: SamplingConfig, max_context_tokens: int | None = None,
                 backend: Literal["engine", "transformers"] = "engine", engine: GeneratorConfig | None = None):
        from transformers import GenerationConfig

        if backend not in ("engine", "transformers"):
            raise ValueError(f"RolloutEngine runs backend 'engine' or 'transformers', not {backend!r}")
        super().__init__(target, sampling, max_context_tokens)
        self.backend = backend
        self.generator = BatchGenerator(target, engine) if backend == "engine" else None
        target.model.generation_config = GenerationConfig(eos_token_id=sorted(self.stops),
                                                          pad_token_id=target.pad_token_id)
        self._sampler = _row_sampler_class()

    def sample(self, prompts: list[list[int]], seeds: list[int], max_new_tokens: int) -> list[list[int]]:
        """Left-padded batched generation with KV cache; each row sampled with its own seed."""
        from transformers import GenerationConfig, LogitsProcessorList

        device = self.target.device
        width = max(len(p) for p in prompts)
        pad = self.target.pad_token_id
        input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        attention = torch.zeros_like(input_ids)
        for row, ids in enumerate(prompts):
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            attention[row, width - len(ids):] = 1
        generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]
        gen_cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                                   eos_token_id=sorted(self.stops), pad_token_id=pad)
        with torch.no_grad():
            out = self.target.model.generate(
                input_ids=input_ids.to(device), attention_mask=attention.to(device), generation_config=gen_cfg,
                logits_processor=LogitsProcessorList([self._sampler(self.sp, generators)]))
        return [cut_at_stop(seq, self.stops) for seq in out[:, width:].tolist()]

    def _answer_turn(self, convs: list[Conversation], turn: int) -> None:
        budgets = [self.budget(c) for c in convs]
        seeds = [row_seed(self.sampling.seed, c.row["prompt_id"], turn) for c in convs]
        if self.generator is not None:
            results = self.generator.generate([c.ids for c in convs], self.sp, seeds, budgets, sorted(self.stops))
            answers = [tokens for tokens, _ in results]
        else:
            answers = self._sample_by_budget([c.ids for c in convs], seeds, budgets)
        for conv, new in zip(convs, answers):
            self.add_answer(conv, new)

    def _sample_by_budget(self, prompts: list[list[int]], seeds: list[int], budgets: list[int]) -> list[list[int]]:
        """HF generate once per distinct token budget (a fixed batch shares max_new_tokens)."""
        groups = defaultdict(list)
        for i, budget in enumerate(budgets):
            groups[budget].append(i)
        answers: list[list[int]] = [[] for _ in prompts]
        for budget, rows in groups.items():
            for i, new in zip(rows, self.sample([prompts[i] for i in rows], [seeds[i] for i in rows], budget)):
                answers[i] = new
        return answers

    def run(self, rows: list[dict]) -> list[dict]:
        """Rows with prompt_id, source, domain, split, system, turns, chunk (+ location) ->
        RESULT_SCHEMA rows, one per input row, in input order."""
        convs = [self.new_conversation(row) for row in rows]
        for turn in range(max((len(c.row["turns"]) for c in convs), default=0)):
            active = [c for c in convs if c.error is None and turn < len(c.row["turns"])]
            for conv in active:
                self.open_turn(conv, turn)
            active = [c for c in active if c.error is None]
            if active:
                self._answer_turn(active, turn)
        return [self.result(c) for c in convs]



def results_table(results: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(results, schema=schema.RESULT_SCHEMA)


class RolloutActor:
    """A Ray Data actor: one target replica generating for whole batches."""

    def __init__(self, spec: dict):
        from dspark.target import load_target

        torch.set_num_threads(spec["threads"])
        target = load_target(spec["target"], dtype=getattr(torch, spec["dtype"]), device=spec["device"])
        self.engine = RolloutEngine(target, SamplingConfig(**spec["sampling"]), spec["max_context_tokens"],
                                    spec["backend"], GeneratorConfig(**spec["engine"]))

    def __call__(self, batch: pa.Table) -> pa.Table:
        return results_table(self.engine.run(batch.to_pylist()))


# ---------------------------------------------------------------- plan, commits, manifest
@dataclass
class Plan:
    chunks: list[list[Prompt]]
    fingerprint: str

    def describe(self) -> dict:
        return {"fingerprint": self.fingerprint, "num_chunks": len(self.chunks),
                "num_prompts": sum(len(c) for c in self.chunks)}


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


def _uri(out: str, *parts: str) -> str:
    return storage.join(out, *parts)


def _write_parquet(uri: str, rows: list[dict], table_schema: pa.Schema) -> None:
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=table_schema), buf)
    storage.write_bytes(uri, buf.getvalue())


def prepare_output(out: str, plan: Plan, overwrite: bool) -> None:
    """Store the plan, or check that the output already holds this same plan."""
    plan_uri = _uri(out, "_plan.json")
    if storage.exists(plan_uri):
        stored = json.loads(storage.read_text(plan_uri))
        if stored.get("fingerprint") == plan.fingerprint:
            return
        if not overwrite:
            raise ValueError(f"{out} already holds rollouts of a different plan (the prompts or the generation "
                             f"settings changed). Use a new `output`, or set overwrite=true to delete and regenerate.")
        for uri in storage.list_files(out):
            storage.delete(uri)
    storage.write_text(plan_uri, json.dumps(plan.describe(), indent=2))


def read_commits(out: str) -> dict[int, dict]:
    """Committed chunks -> their markers. Unreadable (half-written) markers do not count."""
    commits = {}
    try:
        files = storage.list_files(_uri(out, "_commits"))
    except FileNotFoundError:
        return commits
    for uri in files:
        if not uri.endswith(".json"):
            continue
        try:
            marker = json.loads(storage.read_text(uri))
            commits[int(marker["chunk"])] = marker
        except (ValueError, KeyError, TypeError):
            continue
    return commits


def commit_chunk(out: str, chunk: int, results: list[dict]) -> dict:
    """Write the chunk's shard(s), then its marker (the commit point). Returns the marker."""
    name = schema.shard_name(chunk)
    good = sorted((r for r in results if r["error_reason"] is None), key=lambda r: r["prompt_id"])
    bad = [error_row(r["source"], r["location"], r["error_reason"], r["error_detail"], r["raw"],
                     prompt_id=r["prompt_id"])
           for r in results if r["error_reason"] is not None]
    files = {"data": f"data/{name}.parquet"}
    _write_parquet(_uri(out, files["data"]), good, schema.ROLLOUT_SCHEMA)
    if bad:
        files["errors"] = f"errors/{name}.parquet"
        _write_parquet(_uri(out, files["errors"]), bad, schema.ERROR_SCHEMA)
    marker = {
        "chunk": chunk, "rows": len(good), "errors": len(bad),
        "errors_by_reason": dict(Counter(r["reason"] for r in bad)),
        "rows_by_split": dict(Counter(r["split"] for r in good)),
        "finish_reasons": dict(Counter(r["finish_reason"] for r in good)),
        "prompt_tokens": sum(r["num_prompt_tokens"] for r in good),
        "generated_tokens": sum(r["num_generated_tokens"] for r in good),
        "files": files, "committed_at": time.time(),
    }
    storage.write_text(_uri(out, "_commits", f"{name}.json"), json.dumps(marker))
    return marker


def _add_counts(total: dict, part: dict) -> None:
    for key, value in part.items():
        total[key] = total.get(key, 0) + value


def build_manifest(cfg: RolloutConfig, plan: Plan, loaded: LoadResult, commits: dict[int, dict]) -> dict:
    errors_by_reason = dict(Counter(e["reason"] for e in loaded.errors))
    rows_by_split, finish = {}, {}
    for marker in commits.values():
        _add_counts(errors_by_reason, marker["errors_by_reason"])
        _add_counts(rows_by_split, marker["rows_by_split"])
        _add_counts(finish, marker["finish_reasons"])
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


def actor_spec(cfg: RolloutConfig) -> dict:
    c = cfg.compute
    return {"target": cfg.target, "dtype": c.resolved_dtype(), "device": "cuda" if c.num_gpus > 0 else "cpu",
            "threads": c.torch_threads or max(1, int(c.num_cpus)), "sampling": cfg.sampling.model_dump(),
            "max_context_tokens": cfg.max_context_tokens, "backend": cfg.backend, "engine": cfg.engine.model_dump()}


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
        return rollout_vllm.vllm_stage(cfg, ds, max(len(r["turns"]) for r in rows))
    return ds.map_batches(
        actor, fn_constructor_kwargs={"spec": spec or actor_spec(cfg)}, batch_size=cfg.compute.batch_size,
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
    ctx.enable_progress_bars = False  # one bar, ours
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
        rollout_vllm.require_vllm()
    loaded = load_prompts(cfg.sources, cfg.holdout_fraction)
    plan = make_plan(cfg, loaded)
    prepare_output(out, plan, cfg.overwrite)
    if on_start:
        on_start(out)
    _write_parquet(_uri(out, "errors", "load.parquet"), loaded.errors, schema.ERROR_SCHEMA)
    commits = read_commits(out)
    pending = [c for c in range(len(plan.chunks)) if c not in commits]
    stats = RunStats(chunks_total=len(plan.chunks), chunks_skipped=len(plan.chunks) - len(pending))
    if pending:
        generate_chunks(cfg, plan, pending, out, stats, on_chunk, progress)
    manifest = build_manifest(cfg, plan, loaded, read_commits(out))
    storage.write_text(_uri(out, "manifest.json"), json.dumps(manifest, indent=2))
    return RolloutResult(manifest, stats, loaded)


def read_rollouts(output_uri: str) -> pa.Table:
    """All committed rollout rows of a finished (or partial) output, via its commit markers."""
    out = output_uri.rstrip("/")
    tables = []
    for chunk, marker in sorted(read_commits(out).items()):
        fs, path = storage.pyarrow_fs(_uri(out, marker["files"]["data"]))
        tables.append(pq.read_table(path, filesystem=fs, schema=schema.ROLLOUT_SCHEMA))
    return pa.concat_tables(tables) if tables else schema.ROLLOUT_SCHEMA.empty_table()


def read_errors(output_uri: str) -> pa.Table:
    out = output_uri.rstrip("/")
    uris = [_uri(out, "errors", "load.parquet")] + [
        _uri(out, m["files"]["errors"]) for _, m in sorted(read_commits(out).items()) if "errors" in m["files"]]
    tables = []
    for uri in uris:
        if storage.exists(uri):
            fs, path = storage.pyarrow_fs(uri)
            tables.append(pq.read_table(path, filesystem=fs, schema=schema.ERROR_SCHEMA))
    return pa.concat_tables(tables) if tables else schema.ERROR_SCHEMA.empty_table()
