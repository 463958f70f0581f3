"""Rollout throughput: a plain sequential `generate` loop vs the Ray Data pipeline, same prompts.

    python -m benchmarks.rollout_throughput [--target smollm2-135m] [--num-prompts 16] [--max-new-tokens 32]

(a) one prompt at a time through `Target.generate` (batch 1, KV cache), in this process;
(b) `pipelines.rollout.run_rollouts` on a local Ray (or $RAY_ADDRESS): an actor pool of target
    replicas generating batches with left padding.
Both use the same prompts and sampling parameters; each side's tokens/s is its generated tokens
over its wall time. (a) excludes model loading; (b) is end to end (actor start-up and model
loading included, Ray start-up excluded), so the ratio understates steady-state batching gains.
The last stdout line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SOURCES = ["data/train/math.jsonl", "data/train/code.jsonl", "data/train/chat.jsonl"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--cpus-per-replica", type=float, default=2.0)
    p.add_argument("--start-timeout-s", type=float, default=120.0,
                   help="fail (naming what holds the cluster) if the replicas are not placed by then")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sources", nargs="+", default=DEFAULT_SOURCES)
    return p.parse_args(argv)


def pick_prompts(args) -> list:
    """First turns of an even mix of the sources (single-turn prompts, same for both sides)."""
    from pipelines.prompts import PromptSource, load_prompts

    per_source = -(-args.num_prompts // len(args.sources))
    sources = [PromptSource(uri=str(REPO / s), limit=per_source) for s in args.sources]
    prompts = load_prompts(sources).prompts
    for p in prompts:
        p.turns = p.turns[:1]
    return prompts[: args.num_prompts]


def run_sequential(args, prompts) -> dict:
    import torch

    from dspark.target import load_target

    target = load_target(args.target)
    torch.set_num_threads(max(1, int(args.cpus_per_replica)))
    tokens, start = 0, time.perf_counter()
    for i, p in enumerate(prompts):
        ids = target.chat_ids([{"role": "user", "content": p.turns[0]}])
        new = target.generate([ids], max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              top_p=args.top_p, seed=args.seed + i)[0]
        tokens += len(new)
    wall = time.perf_counter() - start
    return {"tokens": tokens, "wall_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 2)}


def run_pipeline(args, prompts) -> dict:
    from jobs.common import RayConfig, init_ray
    from pipelines.prompts import write_jsonl
    from pipelines.rollout import RolloutConfig, run_rollouts

    init_ray(RayConfig(num_cpus=max(2, int(args.cpus_per_replica * args.replicas))))
    with tempfile.TemporaryDirectory(prefix="dspark-bench-") as tmp:
        write_jsonl([{"turns": p.turns} for p in prompts], f"{tmp}/prompts.jsonl")
        cfg = RolloutConfig.model_validate({
            "target": args.target, "sources": [{"uri": f"{tmp}/prompts.jsonl"}], "output": f"{tmp}/out",
            "holdout_fraction": 0.0, "chunk_size": len(prompts),
            "sampling": {"temperature": args.temperature, "top_p": args.top_p,
                         "max_new_tokens": args.max_new_tokens, "seed": args.seed},
            "compute": {"replicas": args.replicas, "batch_size": args.batch_size, "num_cpus": args.cpus_per_replica,
                         "start_timeout_s": args.start_timeout_s}})
        result = run_rollouts(cfg, progress=False)
    stats = result.stats
    return {"tokens": stats.generated_tokens, "wall_s": round(stats.wall_s, 2),
            "tokens_per_s": round(stats.tokens_per_s, 2), "rows": stats.rows_done, "errors": stats.errors}


def main(argv=None) -> dict:
    args = parse_args(argv)
    prompts = pick_prompts(args)
    print(f"[rollout_throughput] {len(prompts)} prompts, target {args.target}, max_new_tokens {args.max_new_tokens}",
          flush=True)
    sequential = run_sequential(args, prompts)
    print(f"[rollout_throughput] sequential: {sequential}", flush=True)
    pipeline = run_pipeline(args, prompts)
    print(f"[rollout_throughput] pipeline:   {pipeline}", flush=True)
    report = {"benchmark": "rollout_throughput", "target": args.target, "num_prompts": len(prompts),
              "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size, "replicas": args.replicas,
              "cpus_per_replica": args.cpus_per_replica, "sequential": sequential, "pipeline": pipeline,
              "speedup": round(pipeline["tokens_per_s"] / sequential["tokens_per_s"], 2)}
    print(json.dumps(report), flush=True)
    return report


if __name__ == "__main__":
    main()
