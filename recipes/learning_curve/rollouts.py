"""Phase `rollouts`: decontaminated train prompts and held-out eval prompts -> target rollouts in the
rollout-store format, a Parquet shard per chunk (resumable, exactly once)."""
from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from pathlib import Path

from recipes.learning_curve.profiles import EVAL_DIR, REPO, TRAIN_FILES, CurveProfile, log, target_dtype

# ---------------------------------------------------------------- prompts
def train_prompts(decontam_ngram: int = 13, max_ngram_prompts: int = 3, uri: str | None = None) -> tuple[list, list]:
    """(kept, dropped) first-turn prompts of data/train (or of `uri`: a jobs.synthesize output, a JSONL file);
    dropped = overlap with any data/eval prompt."""
    from dspark.data.prompt_filters import build_eval_index
    from dspark.data.prompts import PromptSource, load_prompts

    texts = {str(f): f.read_text(encoding="utf-8") for f in sorted((REPO / EVAL_DIR).glob("*.jsonl"))}
    index = build_eval_index(texts, decontam_ngram, max_ngram_prompts)  # every eval file, as jobs.synthesize
    sources = ([PromptSource(uri=uri, user_turns="first")] if uri else
               [PromptSource(uri=str(REPO / f), domain=Path(f).stem, user_turns="first") for f in TRAIN_FILES])
    kept, dropped = [], []
    for p in load_prompts(sources).prompts:
        hit = next((m for m in (index.match(t) for t in p.turns) if m), None)
        (dropped if hit else kept).append((p, hit) if hit else p)
    return kept, dropped


def eval_prompts() -> list:
    """First turn of every evaluation prompt, domain = benchmark (file stem)."""
    from dspark.data.prompts import PromptSource, load_prompts

    files = sorted((REPO / EVAL_DIR).glob("*.jsonl"))
    sources = [PromptSource(uri=str(f), domain=f.stem, user_turns="first") for f in files]
    return load_prompts(sources).prompts


# ---------------------------------------------------------------- rollouts (resumable store)
def _fingerprint(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def rollout_plan(prompts: list, passes: int, chunk_prompts: int, settings: dict, first_pass: int = 0):
    """Chunks in commit order: pass `first_pass` over every prompt (in a fixed shuffled order), then the next,
    ... up to pass `passes - 1` (so any committed prefix mixes the domains and covers all prompts before
    repeating any). Prompt ids get `~p<k>` suffixes, so passes from `first_pass` on are answers no folder
    started at pass 0 and stopped before it holds (fresh data for a drafter trained on those)."""
    from dataclasses import replace

    from dspark.data.schema import Plan

    import random

    prompts = sorted(prompts, key=lambda p: p.prompt_id)
    random.Random(0).shuffle(prompts)  # domains interleaved: any committed prefix mixes math, code and chat
    chunks = []
    for k in range(first_pass, passes):
        rows = [replace(p, prompt_id=f"{p.prompt_id}~p{k}") for p in prompts]
        chunks += [rows[i:i + chunk_prompts] for i in range(0, len(rows), chunk_prompts)]
    fp = _fingerprint({"ids": [p.prompt_id for p in prompts], "passes": passes, "chunk": chunk_prompts, **settings,
                       **({"first_pass": first_pass} if first_pass else {})})  # older folders keep their fingerprint
    return Plan(chunks, fp)


def generate_rollouts(out: str, prompts: list, prof: CurveProfile, passes: int, seed: int, dtype: str = "auto",
                      first_pass: int = 0) -> dict:
    """Generate every uncommitted chunk of the plan into `out` (rollout-store format) with the target in
    `dtype` ("auto": resolved on the profile's device, `target_dtype`); returns the manifest. The resolved
    dtype, when not fp32, is part of the plan's fingerprint (a folder never mixes precisions; fp32 folders keep
    the fingerprint they had before the option existed)."""
    import torch

    from dspark.models import builtin as models_builtin
    from dspark.decoding.generator import GeneratorConfig
    from dspark.models.target import load_target
    from dspark.data.rollout_engine import RolloutEngine, SamplingConfig
    from dspark.io.storage.rollout_store import commit_chunk, prepare_output, read_commits

    dtype = target_dtype(prof, dtype)
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=prof.max_new_tokens, seed=seed)
    settings = {"target": prof.target, "sampling": sampling.model_dump(),
                **({"dtype": dtype} if dtype != "float32" else {})}
    plan = rollout_plan(prompts, passes, prof.chunk_prompts, settings, first_pass)
    prepare_output(out, plan, overwrite=False)
    done = read_commits(out)
    todo = [k for k in range(len(plan.chunks)) if k not in done]
    log(f"{out}: {len(plan.chunks)} chunks ({plan.describe()['num_prompts']} rows), {len(done)} committed, "
        f"{len(todo)} to go")
    if todo:
        torch.set_num_threads(prof.threads)
        if prof.target in models_builtin.BUILTIN:
            models_builtin.prepare(prof.target)
        target = load_target(prof.target, dtype=getattr(torch, dtype), device=prof.device)
        engine = RolloutEngine(target, sampling, backend="engine",
                               engine=GeneratorConfig(max_batch=prof.max_batch))
        total = sum(m["generated_tokens"] for m in done.values())
        for k in todo:
            t0 = time.perf_counter()
            results = engine.run([dict(p.as_row(), chunk=k) for p in plan.chunks[k]])
            marker = commit_chunk(out, k, results)
            write_manifest(out, plan)  # kept current: a run stopped between chunks still has its counts
            dt = time.perf_counter() - t0
            total += marker["generated_tokens"]
            log(f"chunk {k + 1}/{len(plan.chunks)}: {marker['rows']} rows, {marker['generated_tokens']} tokens in "
                f"{dt:.0f} s ({marker['generated_tokens'] / dt:.0f} tok/s), finish {marker['finish_reasons']}, "
                f"errors {marker['errors']}; committed total {total} tokens")
    return write_manifest(out, plan)


def write_manifest(out: str, plan) -> dict:
    from dspark.io import storage
    from dspark.data.schema import add_counts
    from dspark.io.storage.rollout_store import path_in, read_commits

    commits = read_commits(out)
    counts: dict = {}
    for m in commits.values():
        add_counts(counts, {"rows": m["rows"], "errors": m["errors"], "prompt_tokens": m["prompt_tokens"],
                            "generated_tokens": m["generated_tokens"]})
    manifest = {**plan.describe(), "committed_chunks": len(commits), **counts,
                "complete": len(commits) == len(plan.chunks)}
    storage.write_text(path_in(out, "manifest.json"), json.dumps(manifest, indent=2))
    return manifest


def extra_folder(out: Path, name: str) -> Path:
    """Where an extra training prompt set's rollouts go (training reads rollouts-train, then these by name)."""
    return out / f"rollouts-train-{name}"


def cmd_rollouts(args, prof: CurveProfile) -> None:
    """Held-out and train rollouts; with --extra-prompts URI --extra-name NAME, the train rollouts of another
    prompt set (a jobs.synthesize output, a JSONL file; decontaminated by the same rule) into
    rollouts-train-NAME, which every later training phase adds after rollouts-train."""
    if args.extra_prompts and (not args.extra_name or args.which != "train"):
        raise SystemExit("--extra-prompts needs --extra-name NAME and --which train")
    kept, dropped = train_prompts(uri=args.extra_prompts)
    kept = kept[:args.limit_prompts] if args.limit_prompts else kept
    what = f"{args.extra_prompts} prompts" if args.extra_prompts else "train prompts"
    log(f"{what}: {len(kept)} kept, {len(dropped)} dropped as overlapping data/eval "
        f"({dict(Counter(p.domain for p, _ in dropped))})")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    suffix = f"-{args.extra_name}" if args.extra_prompts else ""
    (Path(args.out) / f"decontamination{suffix}.json").write_text(json.dumps(
        {"source": args.extra_prompts or TRAIN_FILES, "kept": len(kept),
         "kept_by_domain": dict(Counter(p.domain for p in kept)),
         "dropped": [{"prompt_id": p.prompt_id, "domain": p.domain, "why": why} for p, why in dropped]}, indent=1))
    if args.which in ("eval", "both"):
        held_out = eval_prompts()
        held_out = held_out[:args.limit_prompts] if args.limit_prompts else held_out
        log(f"held-out: {generate_rollouts(str(Path(args.out) / 'rollouts-eval'), held_out, prof, 1, 1, prof.dtype)}")
    if args.which in ("train", "both"):
        passes = args.passes or prof.passes
        if not 0 <= args.first_pass < passes:
            raise SystemExit(f"--first-pass {args.first_pass}: must be in [0, passes={passes})")
        dtype = prof.data_dtype or prof.dtype
        folder = extra_folder(Path(args.out), args.extra_name) if args.extra_prompts else Path(args.out) / "rollouts-train"
        log(f"train: {generate_rollouts(str(folder), kept, prof, passes, 0, dtype, args.first_pass)}")
