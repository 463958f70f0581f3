"""Rollout throughput: sequential `generate` vs the batched HF path vs the continuous-batching engine.

    python -m benchmarks.rollout_throughput [--target smollm2-135m] [--num-prompts 64] [--max-new-tokens 128]
        [--device cpu|cuda] [--threads 2] [--max-batch 64] [--sequential-prompts N]

Same prompts (first user turns of data/train math, code and chat, spread over each file so lengths
vary) and the same sampling parameters for the three generators, all in this process, no Ray:
  sequential  one prompt at a time through `Target.generate` (HF generate, batch 1, KV cache);
  hf_batched  `RolloutEngine(backend="transformers")`: HF generate on fixed left-padded batches of
              --batch-size (the rollout job's previous path);
  engine      `RolloutEngine(backend="engine")`: dspark.decoding.generator continuous batching, up to
              --max-batch sequences decoding together, finished ones replaced at once.
Each generator loads its own copy of the target. Steady state = generated tokens / generation wall
time (model loading excluded); end to end = generated tokens / (loading + generation).
`--sequential-prompts N` times the sequential loop on the first N prompts only (a rate; use it on GPU
runs with many prompts). The last stdout line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SOURCES = ["data/train/math.jsonl", "data/train/code.jsonl", "data/train/chat.jsonl"]
METHODS = ("sequential", "hf_batched", "engine")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8, help="hf_batched: prompts per generate call")
    p.add_argument("--max-batch", type=int, default=64, help="engine: sequences decoding together")
    p.add_argument("--sequential-prompts", type=int, default=None, help="time sequential on the first N only")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 where the device computes it natively (CUDA with bf16; a CPU with "
                        "avx512_bf16 or AMX), else float32 (dspark.models.precision)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--sources", nargs="+", default=DEFAULT_SOURCES)
    return p.parse_args(argv)


def pick_prompts(args) -> list:
    """An even mix of the sources, each taken evenly spaced through its file (mixed lengths)."""
    from dspark.data.prompts import PromptSource, load_prompts

    per_source = -(-args.num_prompts // len(args.sources))
    picked = []
    for src in args.sources:
        domain = Path(src).stem
        prompts = load_prompts([PromptSource(uri=str(REPO / src), domain=domain)], holdout_fraction=0.0).prompts
        step = max(1, len(prompts) // per_source)
        picked += prompts[::step][:per_source]
    picked = sorted(picked, key=lambda p: p.prompt_id)[: args.num_prompts]  # stable, domains interleaved
    for p in picked:
        p.turns = p.turns[:1]  # single-turn: the same work for every method
    return picked


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _dtype(args) -> str:
    from dspark.models.precision import resolve_dtype

    return resolve_dtype(args.dtype, args.device)


def _load_measured_target(args):
    import torch

    from dspark.models.target import load_target

    dtype = _dtype(args)
    t0 = time.perf_counter()
    target = load_target(args.target, dtype=getattr(torch, dtype), device=args.device)
    _sync(args.device)
    return target, time.perf_counter() - t0, dtype


def run_sequential(args, prompts) -> dict:
    target, load_s, _ = _load_measured_target(args)
    prompts = prompts[: args.sequential_prompts] if args.sequential_prompts else prompts
    tokens, start = 0, time.perf_counter()
    for i, p in enumerate(prompts):
        ids = target.chat_ids([{"role": "user", "content": p.turns[0]}])
        tokens += len(target.generate([ids], max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                      top_p=args.top_p, seed=args.seed + i)[0])
    _sync(args.device)
    return _figures(tokens, time.perf_counter() - start, load_s, len(prompts))


def run_rollout_engine(args, prompts, backend: str) -> dict:
    from dspark.decoding.generator import GeneratorConfig
    from dspark.data.rollout_engine import RolloutEngine, SamplingConfig

    target, load_s, _ = _load_measured_target(args)
    sampling = SamplingConfig(temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
                              seed=args.seed)
    engine = RolloutEngine(target, sampling, backend=backend, engine=GeneratorConfig(max_batch=args.max_batch))
    rows = [dict(p.as_row(), chunk=0) for p in prompts]
    size = args.batch_size if backend == "transformers" else len(rows)  # engine: all prompts in hand
    start = time.perf_counter()
    results = [r for i in range(0, len(rows), size) for r in engine.run(rows[i:i + size])]
    _sync(args.device)
    wall = time.perf_counter() - start
    errors = [r["error_reason"] for r in results if r["error_reason"]]
    if errors:
        raise RuntimeError(f"{backend}: {len(errors)} prompt(s) failed: {Counter(errors)}")
    return _figures(sum(r["num_generated_tokens"] for r in results), wall, load_s, len(rows))


def _figures(tokens: int, wall: float, load_s: float, prompts: int) -> dict:
    return {"prompts": prompts, "tokens": tokens, "wall_s": round(wall, 2), "load_s": round(load_s, 2),
            "tokens_per_s": round(tokens / wall, 2), "tokens_per_s_end_to_end": round(tokens / (wall + load_s), 2)}


def _ratios(runs: dict, key: str) -> dict:
    base = runs.get("sequential", {}).get(key)
    return {m: round(r[key] / base, 2) for m, r in runs.items() if m != "sequential" and base}


def main(argv=None) -> dict:
    import torch

    from dspark.models import builtin as models_builtin

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.target in models_builtin.BUILTIN:
        models_builtin.prepare(args.target)  # build/unpack once, so no method's load time includes it
    prompts = pick_prompts(args)
    print(f"[rollout_throughput] {len(prompts)} prompts ({dict(Counter(p.domain for p in prompts))}), target "
          f"{args.target}, {args.max_new_tokens} new tokens, device {args.device}", flush=True)
    runners = {"sequential": lambda: run_sequential(args, prompts),
               "hf_batched": lambda: run_rollout_engine(args, prompts, "transformers"),
               "engine": lambda: run_rollout_engine(args, prompts, "engine")}
    runs = {}
    for method in args.methods:
        runs[method] = runners[method]()
        print(f"[rollout_throughput] {method}: {runs[method]}", flush=True)
    report = {
        "benchmark": "rollout_throughput", "target": args.target, "device": args.device,
        "dtype": _dtype(args),
        "threads": args.threads, "num_prompts": len(prompts), "domains": dict(Counter(p.domain for p in prompts)),
        "max_new_tokens": args.max_new_tokens, "sampling": {"temperature": args.temperature, "top_p": args.top_p},
        "hf_batch_size": args.batch_size, "engine_max_batch": args.max_batch, "runs": runs,
        "tokens_per_s": {m: r["tokens_per_s"] for m, r in runs.items()},  # steady state
        "speedup_vs_sequential": _ratios(runs, "tokens_per_s"),
        "end_to_end": {"tokens_per_s": {m: r["tokens_per_s_end_to_end"] for m, r in runs.items()},
                       "speedup_vs_sequential": _ratios(runs, "tokens_per_s_end_to_end")},
    }
    print(json.dumps(report), flush=True)
    return report


if __name__ == "__main__":
    main()
