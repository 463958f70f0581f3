"""The engine stepped in a background thread, as a Serve replica runs it, with and without releasing the
building thread's OpenMP pool (dspark.models.openmp_pool): tokens/s and CPU use, side by side.

    python benchmarks/engine_thread.py --drafter DIR [--modes off,dynamic] [--requests 12] [--repeats 2]

Each variant (mode × pool released or kept) runs in its own process, like a replica: the main thread
loads the target and the drafter and builds the engine (the dynamic engine profiles its SPS table
there), `engine.start()` steps it in a background thread, and `--users` threads send `--requests`
requests of `--max-tokens` tokens back to back (closed loop, temperature 1, `--prompt-len`-token
prompts). "kept" replaces the release with a no-op, which is how the engine ran before. The variants
take turns, the order reversed every repeat (ABBA), so drifting background load hits all alike.
Reported per variant: tokens/s over the wall time, and the process's CPU seconds per wall second (2.0
= both cores busy on a 2-core machine). The last stdout line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--drafter", required=True, help="local drafter directory (for the modes that draft)")
    ap.add_argument("--modes", default="off,dynamic")
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--requests", type=int, default=12, help="requests per variant run")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2, help="runs of every variant (ABBA order)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # "mode:released|kept": one variant run
    return ap.parse_args(argv)


def child(args) -> dict:
    """One variant, in this process: build in the main thread, step in the engine's thread."""
    import threading

    import torch

    import dspark.decoding.request_batch as request_batch
    from benchmarks.engine_ab import prompt_ids
    from dspark.decoding.engine import Engine, EngineConfig
    from dspark.decoding.sampling import SamplingParams
    from dspark.decoding.scheduler import SchedulerConfig
    from dspark.drafters import load_drafter
    from dspark.models.target import load_target

    mode, pool = args.child.split(":")
    if pool == "kept":
        request_batch.release_openmp_pool = lambda: 0
    torch.set_num_threads(args.threads)
    target = load_target(args.target)
    drafter = None if mode == "off" else load_drafter(args.drafter, target=target)
    cfg = EngineConfig(scheduler=SchedulerConfig(mode=mode, draft_gate=mode == "dynamic"), gamma=args.gamma,
                       max_batch=args.users, max_waiting=4 * args.users,
                       sps_batch_sizes=[b for b in (1, 2, 4, 8, 16, 32) if b <= 8 * args.users])
    engine = Engine(target, drafter, cfg)
    prompts, sampling, lock, issued = prompt_ids(target, args.requests, args.prompt_len), SamplingParams(temperature=1.0), threading.Lock(), [0]

    def user() -> None:
        while True:
            with lock:
                if issued[0] >= args.requests:
                    return
                i, issued[0] = issued[0], issued[0] + 1
            engine.submit(prompts[i % len(prompts)], sampling, args.max_tokens, stop_ids=[]).done.wait()

    engine.start()
    cpu0, t0 = sum(os.times()[:2]), time.perf_counter()
    users = [threading.Thread(target=user) for _ in range(args.users)]
    for t in users:
        t.start()
    for t in users:
        t.join()
    wall, cpu = time.perf_counter() - t0, sum(os.times()[:2]) - cpu0
    engine.stop()
    t = engine.totals
    return {"mode": mode, "openmp_pool": pool, "wall_s": round(wall, 3), "cpu_per_wall": round(cpu / wall, 3),
            "tokens": t["generated_tokens"], "tokens_per_s": t["generated_tokens"] / wall,
            "prefill_s": round(t["prefill_s"], 3), "verify_s": round(t["verify_s"], 3),
            "draft_s": round(t["draft_s"], 3), "steps": t["steps"], "draft_skipped_steps": t["draft_skipped_steps"]}


def run_variant(args, variant: str) -> dict:
    cmd = [sys.executable, __file__, "--child", variant, "--target", args.target, "--drafter", args.drafter,
           "--users", str(args.users), "--requests", str(args.requests), "--max-tokens", str(args.max_tokens),
           "--prompt-len", str(args.prompt_len), "--gamma", str(args.gamma), "--threads", str(args.threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO_ROOT)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"[engine_thread] {row['mode']:>8} pool {row['openmp_pool']:>8}: {row['tokens_per_s']:6.2f} tok/s  "
          f"CPU {row['cpu_per_wall']:.2f} per wall s", file=sys.stderr, flush=True)
    return row


def summarize(args, rows: list[dict]) -> dict:
    by: dict[tuple, list[dict]] = {}
    for r in rows:
        by.setdefault((r["mode"], r["openmp_pool"]), []).append(r)
    variants = {f"{m}/{p}": {"tokens_per_s": sum(r["tokens"] for r in rs) / sum(r["wall_s"] for r in rs),
                             "cpu_per_wall": sum(r["cpu_per_wall"] for r in rs) / len(rs), "runs": len(rs)}
                for (m, p), rs in by.items()}
    pairs = {f"{m}: released/kept": (f"{m}/released", f"{m}/kept") for m in args.modes.split(",") if m}
    pairs |= {f"dynamic/off ({p})": (f"dynamic/{p}", f"off/{p}") for p in ("released", "kept")}
    ratios = {name: variants[a]["tokens_per_s"] / variants[b]["tokens_per_s"]
              for name, (a, b) in pairs.items() if a in variants and b in variants}
    return {"benchmark": "engine_thread", "target": args.target, "drafter": args.drafter, "users": args.users,
            "requests": args.requests, "max_tokens": args.max_tokens, "prompt_len": args.prompt_len,
            "gamma": args.gamma, "threads": args.threads, "repeats": args.repeats, "variants": variants,
            "ratios": ratios, "runs": rows, "command": "python " + " ".join(["benchmarks/engine_thread.py", *sys.argv[1:]])}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    order = [f"{m}:{p}" for m in args.modes.split(",") if m for p in ("released", "kept")]
    rows = []
    for k in range(args.repeats):
        for variant in (order if k % 2 == 0 else order[::-1]):
            rows.append(run_variant(args, variant))
    report = summarize(args, rows)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
