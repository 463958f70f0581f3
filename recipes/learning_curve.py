"""Learning curve of the DSpark drafter on one machine: rollouts -> nested training points -> expected τ,
plus equal-budget baselines, a report (JSON + plot) and the inputs of `dspark plan`. Single process, no Ray.

    python -m recipes.learning_curve rollouts  [--profile cpu|gpu] [--out DIR]   # train + held-out rollouts
    python -m recipes.learning_curve train     [--profile cpu|gpu] [--out DIR]   # every training point
    python -m recipes.learning_curve evaluate  [--profile cpu|gpu] [--out DIR]   # expected τ per point
    python -m recipes.learning_curve baselines [--profile cpu|gpu] [--out DIR]   # 4 algos, real τ + speed
    python -m recipes.learning_curve epochs    [--profile cpu|gpu] [--out DIR] --epochs 2 6  # the largest point, more passes
    python -m recipes.learning_curve report    [--profile cpu|gpu] [--out DIR]   # JSON + plot

Every phase is resumable from its output folder (DIR, default /work/learn-runs/<profile>): rollouts commit a
Parquet shard per chunk in the rollout-store format (dspark/io/rollout_store.py) and skip committed
chunks; a training point with a saved drafter is skipped; an evaluation with a result file is skipped.
Progress goes to stdout (one line per chunk / log interval).

Data: prompts = every data/train file (first user turn), decontaminated against data/eval with the
synthesis job's EvalIndex rule (13-gram, boilerplate-aware; dspark.data.prompt_filters); `passes` samples per
prompt, each pass with its own seed and prompt ids suffixed `~p<k>` (so every answer has its own row
seed). Held-out: the first turn of every data/eval prompt, one answer each, for the expected-τ estimate.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_DRAFTER = {"block_size": 7, "num_layers": 2, "num_context_layers": 3, "rank": 64, "anchors_per_seq": 512,
            "position_weight": "reference", "loss_norm": "token", "draft_vocab_size": 8192}
PROFILES = {
    # cpu: 2 shared cores, smollm2-135m. gpu: the same pipeline with bigger sizes (one accelerator).
    # anchors_per_seq 512 >= every eligible position of a 384-token row: dense anchors.
    # On the shared 2-core machine (load average 20-40 during this run) the sizes are fractions of
    # whatever the rollout phase committed: 4 points, each 3x the previous (27x span).
    "cpu": {"target": "smollm2-135m", "device": "cpu", "device_label": "2 CPU cores (shared)", "dtype": "float32",
            "threads": 1, "passes": 8, "chunk_prompts": 24, "max_new_tokens": 128, "max_batch": 24,
            "point_tokens": [], "point_fractions": [1 / 27, 1 / 9, 1 / 3, 1.0],
            "drafter": {**_DRAFTER, "anchors_per_seq": 32}, "epochs": 1, "batch_size": 8,
            "lr": 1e-3, "max_len": 384, "eval_max_len": 384, "eval_rows": 100, "anchor_stride": 4, "seed": 0,
            "log_every": 5,
            "cache_rows_per_shard": 32, "cache_batch": 4, "decode_prompts": 1, "decode_max_new_tokens": 40},
    "gpu": {"target": "smollm2-135m", "device": "cuda", "device_label": "1 GPU", "dtype": "bfloat16", "threads": 8,
            "passes": 64, "chunk_prompts": 2048, "max_new_tokens": 512, "max_batch": 512,
            "point_tokens": [100_000, 400_000, 1_600_000, 6_400_000, 25_600_000],
            "drafter": {**_DRAFTER, "num_layers": 5, "anchors_per_seq": 1024}, "epochs": 4, "batch_size": 32,
            "lr": 6e-4, "max_len": 1024, "eval_max_len": 1024, "seed": 0, "log_every": 50,
            "cache_rows_per_shard": 1024, "cache_batch": 32, "decode_prompts": 20, "decode_max_new_tokens": 256},
    # tiny: the built-in tiny target, seconds per phase (tests/integration/test_learning_curve.py)
    "tiny": {"target": "tiny", "device": "cpu", "device_label": "cpu (test)", "dtype": "float32", "threads": 1,
             "passes": 2, "chunk_prompts": 4, "max_new_tokens": 12, "max_batch": 8,
             "point_tokens": [20, 60], "drafter": {**_DRAFTER, "block_size": 3, "num_layers": 1, "rank": 8,
                                                   "num_context_layers": 2, "draft_vocab_size": 64},
             "epochs": 1, "batch_size": 2, "lr": 1e-3, "max_len": 320, "eval_max_len": 320, "seed": 0,
             "log_every": 1, "cache_rows_per_shard": 3, "cache_batch": 2, "decode_prompts": 1,
             "decode_max_new_tokens": 8},
}
TRAIN_FILES = ["data/train/math.jsonl", "data/train/code.jsonl", "data/train/chat.jsonl"]
EVAL_DIR = "data/eval"


def log(msg: str) -> None:
    print(f"[learning_curve {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------- prompts
def train_prompts(decontam_ngram: int = 13, max_ngram_prompts: int = 3) -> tuple[list, list]:
    """(kept, dropped) first-turn prompts of data/train; dropped = overlap with any data/eval prompt."""
    from dspark.data.prompt_filters import build_eval_index
    from dspark.data.prompts import PromptSource, load_prompts

    texts = {str(f): f.read_text(encoding="utf-8") for f in sorted((REPO / EVAL_DIR).glob("*.jsonl"))}
    index = build_eval_index(texts, decontam_ngram, max_ngram_prompts)  # every eval file, as jobs.synthesize
    sources = [PromptSource(uri=str(REPO / f), domain=Path(f).stem, user_turns="first") for f in TRAIN_FILES]
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


def rollout_plan(prompts: list, passes: int, chunk_prompts: int, settings: dict):
    """Chunks in commit order: pass 0 over every prompt (in a fixed shuffled order), then pass 1, ... (so
    any committed prefix mixes the domains and covers all prompts before repeating any). Prompt ids get
    `~p<k>` suffixes."""
    from dataclasses import replace

    from dspark.data.schema import Plan

    import random

    prompts = sorted(prompts, key=lambda p: p.prompt_id)
    random.Random(0).shuffle(prompts)  # domains interleaved: any committed prefix mixes math, code and chat
    chunks = []
    for k in range(passes):
        rows = [replace(p, prompt_id=f"{p.prompt_id}~p{k}") for p in prompts]
        chunks += [rows[i:i + chunk_prompts] for i in range(0, len(rows), chunk_prompts)]
    fp = _fingerprint({"ids": [p.prompt_id for p in prompts], "passes": passes, "chunk": chunk_prompts, **settings})
    return Plan(chunks, fp)


def generate_rollouts(out: str, prompts: list, prof: dict, passes: int, seed: int) -> dict:
    """Generate every uncommitted chunk of the plan into `out` (rollout-store format); returns the manifest."""
    import torch

    from dspark.models import builtin as models_builtin
    from dspark.decoding.generator import GeneratorConfig
    from dspark.models.target import load_target
    from dspark.data.rollout_engine import RolloutEngine, SamplingConfig
    from dspark.io.rollout_store import commit_chunk, prepare_output, read_commits

    sampling = SamplingConfig(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=prof["max_new_tokens"], seed=seed)
    settings = {"target": prof["target"], "sampling": sampling.model_dump()}
    plan = rollout_plan(prompts, passes, prof["chunk_prompts"], settings)
    prepare_output(out, plan, overwrite=False)
    done = read_commits(out)
    todo = [k for k in range(len(plan.chunks)) if k not in done]
    log(f"{out}: {len(plan.chunks)} chunks ({plan.describe()['num_prompts']} rows), {len(done)} committed, "
        f"{len(todo)} to go")
    if todo:
        torch.set_num_threads(prof["threads"])
        if prof["target"] in models_builtin.BUILTIN:
            models_builtin.prepare(prof["target"])
        target = load_target(prof["target"], dtype=getattr(torch, prof["dtype"]), device=prof["device"])
        engine = RolloutEngine(target, sampling, backend="engine",
                               engine=GeneratorConfig(max_batch=prof["max_batch"]))
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
    from dspark.io.rollout_store import path_in, read_commits

    commits = read_commits(out)
    counts: dict = {}
    for m in commits.values():
        add_counts(counts, {"rows": m["rows"], "errors": m["errors"], "prompt_tokens": m["prompt_tokens"],
                            "generated_tokens": m["generated_tokens"]})
    manifest = {**plan.describe(), "committed_chunks": len(commits), **counts,
                "complete": len(commits) == len(plan.chunks)}
    storage.write_text(path_in(out, "manifest.json"), json.dumps(manifest, indent=2))
    return manifest


def cmd_rollouts(args, prof: dict) -> None:
    kept, dropped = train_prompts()
    kept = kept[:args.limit_prompts] if args.limit_prompts else kept
    log(f"train prompts: {len(kept)} kept, {len(dropped)} dropped as overlapping data/eval "
        f"({dict(Counter(p.domain for p, _ in dropped))})")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "decontamination.json").write_text(json.dumps(
        {"kept": len(kept), "kept_by_domain": dict(Counter(p.domain for p in kept)),
         "dropped": [{"prompt_id": p.prompt_id, "domain": p.domain, "why": why} for p, why in dropped]}, indent=1))
    if args.which in ("eval", "both"):
        held_out = eval_prompts()
        held_out = held_out[:args.limit_prompts] if args.limit_prompts else held_out
        log(f"held-out: {generate_rollouts(str(Path(args.out) / 'rollouts-eval'), held_out, prof, 1, 1)}")
    if args.which in ("train", "both"):
        passes = args.passes or prof["passes"]
        log(f"train: {generate_rollouts(str(Path(args.out) / 'rollouts-train'), kept, prof, passes, 0)}")


# ---------------------------------------------------------------- shared: target, rows, caches
_TARGETS: dict = {}  # one load per process (the after-rollouts run chains phases)


def load_target_of(prof: dict):
    key = (prof["target"], prof["device"], prof["dtype"])
    if key not in _TARGETS:
        _TARGETS[key] = _load_target(prof)
    return _TARGETS[key]


def _load_target(prof: dict):
    import torch

    from dspark.models import builtin as models_builtin
    from dspark.models.target import load_target

    torch.set_num_threads(prof["threads"])
    if prof["target"] in models_builtin.BUILTIN:
        models_builtin.prepare(prof["target"])
    return load_target(prof["target"], dtype=getattr(torch, prof["dtype"]), device=prof["device"])


def committed_rows(folder: Path) -> list[dict]:
    """Rows of the committed chunks, in commit-plan order (pass 0 first), as dicts."""
    from dspark.io.rollout_store import read_rollouts

    table = read_rollouts(str(folder))
    cols = ["prompt_id", "domain", "input_ids", "loss_mask", "num_generated_tokens"]
    return table.select(cols).to_pylist() if table.num_rows else []


def layer_ids_of(target, prof: dict) -> list[int]:
    return list(target.default_layer_ids(prof["drafter"]["num_context_layers"]))


def ensure_cache(target, prof: dict, rows: list[dict], folder: Path, max_len: int):
    """Build (resumably) and load the frozen-target feature cache of `rows`."""
    from dspark.training.feature_cache import build_cache, load_cache

    layers = layer_ids_of(target, prof)
    build_cache(target, rows, layers, str(folder), max_len, rows_per_shard=prof["cache_rows_per_shard"],
                batch_size=prof["cache_batch"], progress=log)
    cache = load_cache(str(folder), target, layers, max_len)
    if len(cache) != len(rows):
        raise RuntimeError(f"{folder}: the cache holds {len(cache)} rows but the rollouts {len(rows)}; a cache built "
                           f"from an earlier, smaller rollout set? delete it to rebuild")
    return cache


def train_cache(target, prof: dict, out: Path):
    rows = committed_rows(out / "rollouts-train")
    if not rows:
        raise SystemExit(f"no committed train rollouts under {out / 'rollouts-train'}; run the rollouts phase first")
    frozen = out / "train-rows.json"  # the training set is fixed at the first training run (nested prefixes)
    if frozen.exists():
        n = json.loads(frozen.read_text())["rows"]
        if n > len(rows):
            raise SystemExit(f"{frozen} says {n} rows but only {len(rows)} are committed")
        rows = rows[:n]
    else:
        frozen.write_text(json.dumps({"rows": len(rows), "generated_tokens": sum(r["num_generated_tokens"] for r in rows)}))
    return rows, ensure_cache(target, prof, rows, out / "features-train", prof["max_len"])


def wanted_sizes(rows: list[dict], prof: dict) -> list[int]:
    """Point sizes in rollout tokens: the profile's fixed sizes, or fractions of what was committed."""
    total = sum(r["num_generated_tokens"] for r in rows)
    return [int(f * total) for f in prof.get("point_fractions", [])] or list(prof["point_tokens"])


def point_sizes(rows: list[dict], wanted: list[int]) -> list[tuple[int, int]]:
    """(rollout tokens, rows) per point: the shortest prefix holding >= each wanted size; sizes beyond
    the data are replaced by one point with every row (the largest point = all committed rollouts)."""
    cum, total, out = [], 0, []
    for r in rows:
        total += r["num_generated_tokens"]
        cum.append(total)
    for size in sorted(wanted):
        n = next((i + 1 for i, c in enumerate(cum) if c >= size), None)
        if n is None:
            break
        out.append((cum[n - 1], n))
    if not out or out[-1][1] < len(rows):
        out.append((total, len(rows)))
    return out


# ---------------------------------------------------------------- training (resumable per point)
ALGOS = {
    # the paper's comparison (DESIGN §6): DSpark = parallel block + Markov head + confidence, L_ce + L_tv;
    # DFlash = parallel block, CE only (reference recipe); DFlash+TV = DSpark's loss without the head;
    # Eagle3 = autoregressive, dense training-time test, soft labels, 0.8^(k-1) step weights.
    "dspark": {"algo": "dspark", "head": "markov", "confidence_head": True, "loss_ce": 0.1, "loss_tv": 0.9},
    "dflash": {"algo": "dflash", "loss_ce": 1.0, "loss_tv": 0.0},
    "dflash_tv": {"algo": "dflash", "loss_ce": 0.1, "loss_tv": 0.9},
    "eagle3": {"algo": "eagle3", "dense_ttt": True, "ce_target": "soft", "position_weight": "geometric",
               "position_decay": 0.8, "loss_ce": 1.0, "loss_tv": 0.0},
}


def drafter_config(prof: dict, algo: str):
    from dspark.drafters import DrafterConfig

    cfg = {**prof["drafter"], **ALGOS[algo]}
    if ALGOS[algo]["algo"] != "dspark":
        cfg.pop("head", None), cfg.pop("rank", None), cfg.pop("confidence_head", None)
    if ALGOS[algo]["algo"] == "eagle3":
        cfg.pop("num_layers", None)
        cfg["ttt_steps"] = cfg["block_size"]
    return DrafterConfig(**cfg)


def draft_ids_of(cache, n_rows: int, vocab: int, size: int | None):
    from dspark.drafters.draft_vocab import count_token_frequencies, coverage, top_token_ids

    if not size:
        return None, None
    counts = count_token_frequencies(zip(cache.input_ids[:n_rows], cache.loss_mask[:n_rows]), vocab, "cache")
    ids = top_token_ids(counts, size, vocab)
    return ids, coverage(counts, ids)


def train_one(target, prof: dict, cache, n_rows: int, algo: str, folder: Path) -> dict:
    """Train one drafter on the first n_rows cached rows (`epochs` passes); skip if already saved."""
    import random

    import numpy as np
    import torch

    from dspark.drafters import build_drafter, save_drafter
    from dspark.training.batching import bucketed_batches
    from dspark.training.config import OptimSection
    from dspark.training.feature_cache import cached_step, collate_cached
    from dspark.training.loop import LocalTrainer, flops_rates

    done = folder / "train.json"
    if done.exists() and (folder / "drafter" / "config.json").exists():
        log(f"{folder}: trained already, skipping")
        return json.loads(done.read_text())
    cfg = drafter_config(prof, algo)
    ids, cov = draft_ids_of(cache, n_rows, int(target.vocab_size), cfg.draft_vocab_size)
    torch.manual_seed(prof["seed"])
    drafter = build_drafter(cfg, target, draft_ids=ids)
    optim = OptimSection(lr=prof["lr"], warmup_ratio=0.04, schedule="cosine", grad_clip=1.0)
    trainer = LocalTrainer(algo, target, drafter, optim, precision="fp32")
    batch = min(prof["batch_size"], n_rows)
    per_epoch = n_rows // batch
    steps = per_epoch * prof["epochs"]
    trainer.set_schedule(steps)
    lengths = [min(len(x), prof["max_len"]) for x in cache.input_ids[:n_rows]]
    log(f"{folder.parent.name}/{algo}: {n_rows} rows, {steps} steps of {batch} ({prof['epochs']} epochs), draft vocab "
        f"{cfg.draft_vocab_size} (coverage {cov if cov is None else round(cov, 4)})")
    t0, tokens, flops, step, curve, last = time.perf_counter(), 0.0, 0.0, 0, [], []
    for epoch in range(prof["epochs"]):
        order = list(range(n_rows))
        random.Random(prof["seed"] * 7919 + epoch).shuffle(order)
        for rows in bucketed_batches(order, lengths, batch, window=8, seed=prof["seed"] + epoch):
            b = collate_cached(cache, rows, target.pad_token_id, target.device)
            m = cached_step(trainer, b, seed=prof["seed"] * 1_000_003 + step)
            step += 1
            tokens, flops = tokens + m["tokens"], flops + m["flops"]
            last = (last + [m])[-20:]
            if step % prof["log_every"] == 0 or step == steps:
                dt = time.perf_counter() - t0
                row = {"step": step, "loss": m["loss"], "tokens_per_s": tokens / dt,
                       **{k: float(np.mean([x[k] for x in last if k in x])) for k in ("loss", "token_acc") if k in m}}
                curve.append(row)
                log(f"  {algo} step {step}/{steps} loss {row['loss']:.3f} acc {row.get('token_acc', 0):.3f} "
                    f"{row['tokens_per_s']:.0f} tok/s, {dt:.0f} s")
    wall = time.perf_counter() - t0
    save_drafter(drafter, str(folder / "drafter"))
    rates = flops_rates(flops, wall, target.device, "fp32")
    result = {"algo": algo, "rows": n_rows, "rollout_tokens": int(sum(m for m in cache.generated_tokens()[:n_rows])),
              "trained_tokens": tokens, "steps": steps, "epochs": prof["epochs"], "batch_size": batch,
              "anchors_per_seq": cfg.anchors_per_seq, "draft_vocab_size": cfg.draft_vocab_size,
              "draft_vocab_coverage": cov, "wall_s": wall, "cpu_minutes": wall / 60 * prof["threads"],
              "tokens_per_s": tokens / wall, "drafter_tflops_per_s": rates["model_tflops_per_s"],
              "mfu": rates["mfu"], "final_metrics": {k: float(np.mean([x[k] for x in last]))
                                                     for k in last[-1] if isinstance(last[-1][k], float)},
              "curve": curve, "drafter_config": cfg.model_dump()}
    done.write_text(json.dumps(result, indent=1))
    return result


def cmd_train(args, prof: dict) -> None:
    out = Path(args.out)
    target = load_target_of(prof)
    rows, cache = train_cache(target, prof, out)
    sizes = point_sizes(rows, wanted_sizes(rows, prof))
    log(f"points (rollout tokens, rows): {sizes}")
    for tokens, n in sizes:
        train_one(target, prof, cache, n, "dspark", out / "points" / f"{tokens:09d}" / "dspark")


def cmd_baselines(args, prof: dict) -> None:
    out = Path(args.out)
    target = load_target_of(prof)
    rows, cache = train_cache(target, prof, out)
    tokens, n = point_sizes(rows, wanted_sizes(rows, prof))[-1]
    for algo in ("dflash_tv", "dflash", "eagle3"):
        train_one(target, prof, cache, n, algo, out / "points" / f"{tokens:09d}" / algo)


def cmd_epochs(args, prof: dict) -> None:
    """DSpark at the largest point trained for each of `--epochs` passes over the same rows (each its own
    cosine schedule, from scratch), into epochs/e<N>/dspark, then its expected τ: what more passes over
    the same data buy, beside what more data buys (the points)."""
    out = Path(args.out)
    target = load_target_of(prof)
    rows, cache = train_cache(target, prof, out)
    _, n = point_sizes(rows, wanted_sizes(rows, prof))[-1]
    for epochs in args.epochs or []:
        train_one(target, {**prof, "epochs": epochs}, cache, n, "dspark", out / "epochs" / f"e{epochs:02d}" / "dspark")
    estimate_folders(target, prof, out, epoch_drafters(out))


# ---------------------------------------------------------------- expected τ (teacher-forced estimate)
def trained_drafters(out: Path) -> list[Path]:
    return sorted(p for p in (out / "points").glob("*/*") if (p / "train.json").exists())


def epoch_drafters(out: Path) -> list[Path]:
    return sorted(p for p in (out / "epochs").glob("e*/dspark") if (p / "train.json").exists())


def epoch_mode(folder: Path) -> str:
    """Decode-mode name of an epochs-series drafter folder (epochs/e05/dspark -> dspark_e05)."""
    return f"dspark_{folder.parent.name}"


def cmd_evaluate(args, prof: dict) -> None:
    target = load_target_of(prof)
    estimate_folders(target, prof, Path(args.out), trained_drafters(Path(args.out)))


def estimate_folders(target, prof: dict, out: Path, folders: list[Path]) -> None:
    """Expected τ of each drafter folder on the held-out rollouts (estimate.json beside it; skipped if there)."""
    from dspark.drafters import load_drafter
    from dspark.eval.acceptance_estimate import estimate
    from dspark.decoding.sampling import SamplingParams
    from dspark.models.target import TargetOutput

    rows = committed_rows(out / "rollouts-eval")
    rows = interleave(rows, "domain")[:prof.get("eval_rows") or len(rows)]
    cache = ensure_cache(target, prof, rows, out / "features-eval", prof["eval_max_len"])
    outs = [TargetOutput(features=f[None], final_hidden=h[None], logits=None, cache=None)
            for f, h in zip(cache.features, cache.final)]
    sp = SamplingParams(temperature=1.0, top_p=1.0, top_k=0)
    p_cache: dict = {}  # the target's distributions per held-out row, shared by every drafter
    for folder in folders:
        dest = folder / "estimate.json"
        if dest.exists():
            continue
        t0 = time.perf_counter()
        drafter = load_drafter(str(folder / "drafter"), target)
        gamma = drafter.config.block_size
        stride = prof.get("anchor_stride", 1)
        result = estimate(drafter, target, rows, gamma, sp, max_len=prof["eval_max_len"], target_outs=outs,
                          anchor_stride=stride, p_cache=p_cache)
        result["gamma"], result["wall_s"], result["anchor_stride"] = gamma, time.perf_counter() - t0, stride
        dest.write_text(json.dumps(result, indent=1))
        log(f"{folder.parent.name}/{folder.name}: expected τ {result['alpha']['expected_tau']} "
            f"{result['alpha']['expected_tau_ci95']} (alpha), {result['iw']['expected_tau']} (iw) "
            f"in {result['wall_s']:.0f} s")


def interleave(rows: list[dict], key: str) -> list[dict]:
    """Round-robin over the groups of `key` (each in its own order): a prefix is balanced across groups."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r[key], []).append(r)
    out, queues = [], [list(g) for _, g in sorted(groups.items())]
    while any(queues):
        for q in queues:
            if q:
                out.append(q.pop(0))
    return out


# ---------------------------------------------------------------- real decoding: τ and batch-1 speed
def decode_prompts(prof: dict) -> list[tuple[str, int, str]]:
    """(benchmark, index, first user turn): the first `decode_prompts` lines of each eval file."""
    from dspark.eval.benchmark_files import parse_benchmark

    picked = []
    for f in sorted((REPO / EVAL_DIR).glob("*.jsonl")):
        convs = parse_benchmark(f.read_text(), str(f))
        picked += [(f.stem, i, turns[0]) for i, turns in enumerate(convs[:prof["decode_prompts"]])]
    return picked


# Verify-length variants of the DSpark drafter decoded beside the fixed-γ baselines (same drafter): the
# γ that pays on a given machine depends on the verify cost (on 2 CPU cores a verify pass of 8 tokens
# costs ~1.5 target steps), and the confidence head can cut a block where survival drops.
DSPARK_VARIANTS = {"dspark_g3": {"mode": "fixed", "gamma": 3},
                   "dspark_thr": {"mode": "threshold", "threshold": 0.4, "threshold_on": "prefix"}}
DECODE_TEMPERATURES = (1.0, 0.0)


def decode_modes(largest: Path) -> dict:
    """mode -> (drafter folder or None, SchedulerConfig kwargs): the largest point's drafters, DSpark's
    variants, and each drafter of the epochs series (`dspark_eNN`, fixed γ and confidence threshold)."""
    modes = {"target": (None, {"mode": "off"})}
    modes |= {a: (largest / a / "drafter", {"mode": "fixed"}) for a in ALGOS if (largest / a / "drafter").exists()}
    if "dspark" in modes:
        modes |= {name: (largest / "dspark" / "drafter", sched) for name, sched in DSPARK_VARIANTS.items()}
    for folder in epoch_drafters(largest.parent.parent):
        name = epoch_mode(folder)
        modes |= {name: (folder / "drafter", {"mode": "fixed"}),
                  name + "_thr": (folder / "drafter", DSPARK_VARIANTS["dspark_thr"])}
    return modes


def cmd_decode(args, prof: dict) -> None:
    """Batch-1 decoding through the engine (max_batch 1), at temperature 1 and 0, prompt-major: for each
    prompt every mode runs back to back, so load changes on a shared machine hit all modes alike.
    Results append to decode/results.jsonl; (prompt, mode, temperature) triples already there are skipped."""
    import torch

    from dspark.drafters import load_drafter
    from dspark.decoding.engine import Engine, EngineConfig
    from dspark.eval.evaluation import prompt_seed
    from dspark.decoding.sampling import SamplingParams
    from dspark.decoding.scheduler import SchedulerConfig

    out = Path(args.out)
    target = load_target_of(prof)
    largest = sorted((out / "points").glob("*"))[-1]
    engines, drafters = {}, {}
    for mode, (path, sched) in decode_modes(largest).items():
        if path is not None and path not in drafters:
            drafters[path] = load_drafter(str(path), target)
        drafter = None if path is None else drafters[path]
        engines[mode] = Engine(target, drafter, EngineConfig(scheduler=SchedulerConfig(**sched), max_batch=1, seed=0))
    dest = out / "decode" / "results.jsonl"
    dest.parent.mkdir(parents=True, exist_ok=True)
    done = {(r["benchmark"], r["index"], r["mode"], r.get("temperature", 1.0))
            for r in map(json.loads, dest.read_text().splitlines())} if dest.exists() else set()
    for bench, index, text in decode_prompts(prof):
        ids = target.chat_ids([{"role": "user", "content": text}])
        for temperature in DECODE_TEMPERATURES:
            sp = SamplingParams(temperature=temperature, top_p=1.0, top_k=0)
            for mode, engine in engines.items():
                if (bench, index, mode, temperature) in done:
                    continue
                t0 = time.perf_counter()
                req = engine.generate([ids], sp, prof["decode_max_new_tokens"],
                                      seeds=[prompt_seed(0, bench, index)])[0]
                wall = time.perf_counter() - t0
                st = req.stats
                rec = {"benchmark": bench, "index": index, "mode": mode, "temperature": temperature,
                       "tokens": len(req.tokens), "wall_s": wall, "rounds": st.rounds, "accepted": st.accepted,
                       "proposed": st.proposed, "finish_reason": req.finish_reason, "error": req.error}
                with dest.open("a") as fh:
                    fh.write(json.dumps(rec) + "\n")
                log(f"decode {bench}[{index}] t={temperature:g} {mode}: {rec['tokens']} tokens in {wall:.1f} s"
                    + (f", τ {(st.accepted + st.rounds) / max(st.rounds, 1):.2f}" if mode != "target" else ""))
    del torch


# ---------------------------------------------------------------- report
def summarize_decode(records: list[dict], temperature: float = 1.0) -> dict:
    """Per mode at one temperature: τ pooled over prompts (accepted + rounds) / rounds with a prompt
    bootstrap CI, per benchmark τ, tokens/s over all prompts, speedup vs target-only on the same prompts."""
    import numpy as np

    from dspark.eval.acceptance_estimate import bootstrap_ratio

    by_mode: dict[str, list[dict]] = {}
    for r in records:
        if r.get("temperature", 1.0) == temperature:
            by_mode.setdefault(r["mode"], []).append(r)
    common = set.intersection(*[{(r["benchmark"], r["index"]) for r in rs} for rs in by_mode.values()]) \
        if by_mode else set()

    def speed(rs):
        rs = [r for r in rs if (r["benchmark"], r["index"]) in common]
        return sum(r["tokens"] for r in rs) / max(sum(r["wall_s"] for r in rs), 1e-9), len(rs)

    base, _ = speed(by_mode.get("target", []))
    out = {}
    for mode, rs in by_mode.items():
        tps, n = speed(rs)
        entry = {"prompts": n, "tokens_per_s_batch1": tps, "speedup_batch1": tps / base if base else None}
        if mode != "target":
            num = np.array([r["accepted"] + r["rounds"] for r in rs], float)
            den = np.array([r["rounds"] for r in rs], float)
            entry["tau"] = float(num.sum() / max(den.sum(), 1))
            entry["tau_ci95"] = list(bootstrap_ratio(num, den))
            entry["tau_per_benchmark"] = {
                b: float(sum(r["accepted"] + r["rounds"] for r in rs if r["benchmark"] == b)
                         / max(1, sum(r["rounds"] for r in rs if r["benchmark"] == b)))
                for b in sorted({r["benchmark"] for r in rs})}
        out[mode] = entry
    return out


def fit_curve(points: list[dict]) -> dict | None:
    """Log-linear fit τ = a + b·ln(tokens) over the points (least squares; 2+ points)."""
    import numpy as np

    pts = [(p["rollout_tokens"], p["expected_tau"]) for p in points if p.get("expected_tau")]
    if len(pts) < 2:
        return None
    x, y = np.log([t for t, _ in pts]), np.array([v for _, v in pts])
    b, a = np.polyfit(x, y, 1)
    return {"form": "tau = a + b * ln(rollout_tokens)", "a": float(a), "b": float(b), "points": len(pts)}


def cmd_report(args, prof: dict) -> dict:
    out = Path(args.out)
    points, baselines = [], {}
    folders = trained_drafters(out)
    largest = max((f.parent.name for f in folders), default=None)
    for folder in folders:
        train = json.loads((folder / "train.json").read_text())
        est_path = folder / "estimate.json"
        est = json.loads(est_path.read_text()) if est_path.exists() else {}
        entry = {"algo": train["algo"], "rollout_tokens": train["rollout_tokens"], "rows": train["rows"],
                 "expected_tau": est.get("alpha", {}).get("expected_tau"),
                 "expected_tau_ci95": est.get("alpha", {}).get("expected_tau_ci95"),
                 "expected_tau_iw": est.get("iw", {}).get("expected_tau"),
                 "expected_tau_iw_ci95": est.get("iw", {}).get("expected_tau_ci95"),
                 "acceptance_per_position": est.get("alpha", {}).get("acceptance_per_position"),
                 "expected_tau_per_benchmark": {g: v["expected_tau"] for g, v in est.get("alpha", {}).get("per_group", {}).items()},
                 "training": {k: train[k] for k in ("steps", "epochs", "batch_size", "trained_tokens", "wall_s",
                                                    "cpu_minutes", "tokens_per_s", "drafter_tflops_per_s", "mfu",
                                                    "anchors_per_seq", "draft_vocab_size", "draft_vocab_coverage")}}
        if train["algo"] == "dspark":
            points.append(entry)
        if folder.parent.name == largest:
            baselines[train["algo"]] = entry
    decode_path = out / "decode" / "results.jsonl"
    records = [json.loads(x) for x in decode_path.read_text().splitlines()] if decode_path.exists() else []
    decode = summarize_decode(records, 1.0)
    decode_by_temperature = {f"t{t:g}": summarize_decode(records, t) for t in DECODE_TEMPERATURES}
    for algo, entry in baselines.items():
        d = decode.get(algo, {})
        entry.update(tau=d.get("tau"), tau_ci95=d.get("tau_ci95"), tau_per_benchmark=d.get("tau_per_benchmark"),
                     speedup_batch1=d.get("speedup_batch1"), tokens_per_s_batch1=d.get("tokens_per_s_batch1"),
                     decode_prompts=d.get("prompts"))
    points.sort(key=lambda p: p["rollout_tokens"])
    epochs_series = [epoch_entry(f) for f in epoch_drafters(out)]
    for entry in epochs_series:  # real decoding of the same drafter, where the decode phase ran it
        for suffix in ("", "_thr"):
            d = decode.get(entry["mode"] + suffix, {})
            entry["decoded" + suffix] = {k: d.get(k) for k in ("tau", "tau_ci95", "speedup_batch1", "prompts")}
    rollout_manifest = out / "rollouts-train" / "manifest.json"
    report = {
        "benchmark": "learning_curve", "profile": args.profile, "device": prof["device_label"],
        "device_kind": prof["device"],  # what `dspark plan` matches against rollout-throughput JSONs
        "target": prof["target"], "temperature": 1.0, "gamma": prof["drafter"]["block_size"],
        "points_mode": f"same epochs ({prof['epochs']}) per point, nested prefixes of the rollouts",
        "estimator": "teacher-forced expected tau: 1 + sum_k prod_{j<=k} alpha_j, alpha = sum_x min(p, q) "
                     "(dspark/eval/acceptance_estimate.py); ci95 = prompt bootstrap",
        "points": points, "baselines": baselines,
        "epochs_series": epochs_series,  # the largest point trained for more passes (phase `epochs`)
        "target_only": decode.get("target"), "fit": fit_curve(points),
        "decode": {"modes": {m: {"drafter": None if p is None else p.parent.name, "scheduler": sched}
                             for m, (p, sched) in decode_modes(out / "points" / largest).items()}
                   if largest else {}, "by_temperature": decode_by_temperature},
        "rollouts": json.loads(rollout_manifest.read_text()) if rollout_manifest.exists() else None,
        "rollout_log": prof.get("rollout_tokens_per_s_note"),
        "decode_settings": {"prompts_per_benchmark": prof["decode_prompts"],
                            "max_new_tokens": prof["decode_max_new_tokens"], "batch": 1,
                            "scheduler": "fixed (baselines); see decode.modes for the DSpark variants",
                            "temperatures": list(DECODE_TEMPERATURES)},
    }
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    best = best_dspark(out, largest, points, epochs_series)
    if best is not None:  # the committed drafter: the best expected τ at the largest point (any epochs)
        report["drafter"] = {**export_bf16(best, results / f"drafter-{args.profile}"),
                             "source": str(best.relative_to(out))}
    (results / f"{args.profile}.json").write_text(json.dumps(report, indent=1))
    plot(report, results / f"{args.profile}.png")
    print(json.dumps({k: report[k] for k in ("device", "points", "baselines", "fit")}, default=str))
    return report


def best_dspark(out: Path, largest: str | None, points: list[dict], epochs_series: list[dict]) -> Path | None:
    """The DSpark drafter folder with the highest expected τ among the largest point and its epochs series."""
    if not largest or not (out / "points" / largest / "dspark" / "drafter").exists():
        return None
    best, best_tau = out / "points" / largest / "dspark" / "drafter", (points[-1]["expected_tau"] if points else 0) or 0
    for e in epochs_series:
        if (e["expected_tau"] or 0) > best_tau:
            best_tau, best = e["expected_tau"], out / e["folder"] / "dspark" / "drafter"
    return best


def epoch_entry(folder: Path) -> dict:
    """One drafter of the epochs series: passes over the largest point's rows -> expected τ."""
    train = json.loads((folder / "train.json").read_text())
    est = json.loads((folder / "estimate.json").read_text()).get("alpha", {}) if (folder / "estimate.json").exists() else {}
    return {"epochs": train["epochs"], "rollout_tokens": train["rollout_tokens"], "steps": train["steps"],
            "trained_tokens": train["trained_tokens"], "wall_s": train["wall_s"], "tokens_per_s": train["tokens_per_s"],
            "expected_tau": est.get("expected_tau"), "expected_tau_ci95": est.get("expected_tau_ci95"),
            "acceptance_per_position": est.get("acceptance_per_position"),
            "final_loss": train.get("final_metrics", {}).get("loss"), "folder": f"epochs/{folder.parent.name}",
            "mode": epoch_mode(folder)}


def export_bf16(src: Path, dest: Path) -> dict:
    """The drafter as a bf16 checkpoint (its own weights + draft-vocabulary maps; the frozen target's
    embedding and LM head are never saved), loadable by path with dspark.drafters.load_drafter."""
    import torch

    from dspark.drafters import load_drafter, save_drafter

    drafter = load_drafter(str(src)).to(torch.bfloat16)
    save_drafter(drafter, str(dest))
    size = sum(f.stat().st_size for f in dest.iterdir())
    return {"path": str(dest.relative_to(REPO)) if dest.is_relative_to(REPO) else str(dest), "bytes": size,
            "params": sum(p.numel() for p in drafter.parameters())}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    pts = [p for p in report["points"] if p["expected_tau"] is not None]
    if pts:
        x = [p["rollout_tokens"] for p in pts]
        y = [p["expected_tau"] for p in pts]
        err = [[v - p["expected_tau_ci95"][0] for v, p in zip(y, pts)], [p["expected_tau_ci95"][1] - v for v, p in zip(y, pts)]]
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label="DSpark expected τ (95% CI)")
    markers = {"dflash": "s", "dflash_tv": "^", "eagle3": "D", "dspark": "*"}
    for algo, b in report["baselines"].items():
        if b.get("tau") is not None:
            lo, hi = b["tau_ci95"]
            ax.errorbar([b["rollout_tokens"] * (1.04 + 0.04 * list(markers).index(algo))], [b["tau"]],
                        yerr=[[b["tau"] - lo], [hi - b["tau"]]], marker=markers[algo], linestyle="none", capsize=3,
                        label=f"{algo} real τ (decoding)")
    fit = report.get("fit")
    if fit and pts:
        import numpy as np

        xs = np.geomspace(min(x), max(x) * 4, 50)
        ax.plot(xs, fit["a"] + fit["b"] * np.log(xs), "k:", lw=1, label="log-linear fit (dotted past data)")
    ax.set_xscale("log")
    ax.set_xlabel("rollout tokens (generated, training set)")
    ax.set_ylabel("τ (tokens per target step), temperature 1")
    ax.set_title(f"{report['target']} on {report['device']}: learning curve")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---------------------------------------------------------------- CLI
PHASES = {"rollouts": cmd_rollouts, "train": cmd_train, "baselines": cmd_baselines, "evaluate": cmd_evaluate,
          "decode": cmd_decode, "epochs": cmd_epochs, "report": cmd_report}
# `after-rollouts`: everything after the rollouts in ONE process (imports and the target load once), the
# curve first (train, evaluate), then real decoding of what exists (DSpark at the largest point: the
# estimator's check), then the baselines and their decoding; a stop at any point leaves valid results.
AFTER_ROLLOUTS = ["train", "evaluate", "report", "decode", "report", "baselines", "evaluate", "decode", "report"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("phase", choices=[*PHASES, "after-rollouts", "all"])
    p.add_argument("--profile", choices=sorted(PROFILES), default="cpu")
    p.add_argument("--out", default=None, help="output folder (default /work/learn-runs/<profile>)")
    p.add_argument("--which", choices=["eval", "train", "both"], default="both", help="rollouts: which set")
    p.add_argument("--passes", type=int, default=None, help="rollouts: samples per train prompt")
    p.add_argument("--limit-prompts", type=int, default=None, help="rollouts: first N train prompts only")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: the profile's)")
    p.add_argument("--epochs", type=int, nargs="+", default=None, help="epochs: passes per run (one drafter each)")
    p.add_argument("--results", default=str(REPO / "benchmarks" / "results" / "learning_curve"),
                   help="report: where <profile>.json and .png go")
    args = p.parse_args(argv)
    args.out = args.out or f"/work/learn-runs/{args.profile}"
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    prof = PROFILES[args.profile]
    if args.threads:
        prof = {**prof, "threads": args.threads}
    phases = {"all": ["rollouts", *AFTER_ROLLOUTS], "after-rollouts": AFTER_ROLLOUTS}.get(args.phase, [args.phase])
    for phase in phases:
        log(f"phase {phase}")
        PHASES[phase](args, prof)


if __name__ == "__main__":
    main()
