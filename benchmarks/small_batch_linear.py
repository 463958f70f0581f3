"""F.linear vs dspark.models.small_batch_linear on CPU, side by side in one process: each linear shape
of the target at 1..64 rows, then batch-1 decoding through the engine (target-only and fixed-γ
speculative rounds) and rollout-style continuous batching at 32 rows, with the linears routed either
way, turns interleaved.

    python benchmarks/small_batch_linear.py [--target smollm2-135m] [--drafter DIR] [--gamma 3]

The last stdout line is one JSON object (ratios are measured side by side; absolute times drift).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--drafter", default=str(REPO_ROOT / "benchmarks/results/learning_curve/drafter-cpu-mix2"))
    ap.add_argument("--gamma", type=int, default=3, help="drafts per speculative round")
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--turns", type=int, default=8, help="engine: interleaved turns per variant")
    ap.add_argument("--steps", type=int, default=6, help="engine: steps per turn")
    ap.add_argument("--threads", type=int, default=2)
    return ap.parse_args(argv)


def timed(fn, reps: int) -> float:
    for _ in range(2):
        fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def shapes_table(target, rows: list[int]) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from dspark.models.small_batch_linear import small_batch_linear

    weights = {tuple(m.weight.shape): m.weight for m in target.model.modules() if isinstance(m, torch.nn.Linear)}
    out = []
    with torch.no_grad():
        for shape, w in sorted(weights.items()):
            reps = max(3, int(2e8 // w.numel() // 8))
            for n in rows:
                x = torch.randn(n, shape[1])
                a, b = [], []
                for _ in range(3):  # ABAB: drift hits both
                    a.append(timed(lambda: F.linear(x, w), reps))
                    b.append(timed(lambda: small_batch_linear(x, w), reps))
                out.append({"out_in": list(shape), "rows": n, "f_linear_ms": 1e3 * min(a),
                            "small_batch_ms": 1e3 * min(b), "speedup": min(a) / min(b)})
                print(f"[small_batch_linear] {shape} rows {n}: {1e3 * min(a):.3f} -> {1e3 * min(b):.3f} ms",
                      file=sys.stderr, flush=True)
    return out


def routable_linears(*models) -> dict:
    """The linears production may route through small_batch_linear (`routable`, whatever this machine's measurement
    chose) -> the class it chose at load, to restore after the A/B."""
    from dspark.models.small_batch_linear import routable

    return {m: type(m) for model in models for m in model.modules() if routable(m)}


def route(linears: dict, fast: bool | None) -> None:
    """Those linears through small_batch_linear (fast), plain F.linear (not fast), or as loaded (None)."""
    from torch import nn

    from dspark.models.small_batch_linear import SmallBatchLinear

    for m, loaded in linears.items():
        m.__class__ = loaded if fast is None else SmallBatchLinear if fast else nn.Linear


def engine_ab(target, drafter, gamma: int, turns: int, steps: int) -> dict:
    from dspark.decoding.engine import Engine, EngineConfig
    from dspark.decoding.sampling import SamplingParams
    from dspark.decoding.scheduler import SchedulerConfig
    from benchmarks.engine_ab import prompt_ids

    linears = routable_linears(target.model, drafter)
    prompt, sampling = prompt_ids(target, 1, 48)[0], SamplingParams(temperature=1.0)

    def engine(mode: str) -> Engine:
        cfg = EngineConfig(scheduler=SchedulerConfig(mode=mode, **({"gamma": gamma} if mode == "fixed" else {})),
                           max_batch=1, max_waiting=2)
        return Engine(target, None if mode == "off" else drafter, cfg)

    variants = [(mode, fast) for mode in ("off", "fixed") for fast in (False, True)]
    engines = {v: engine(v[0]) for v in variants}
    acc = {v: [0.0, 0, 0] for v in variants}  # seconds, tokens, steps
    for turn in range(turns + 1):  # turn 0 warms up
        for v in (variants if turn % 2 == 0 else variants[::-1]):
            route(linears, v[1])
            e = engines[v]
            for _ in range(steps):
                if not e.active and not e.waiting:
                    e.submit(prompt, sampling, 400, stop_ids=[])
                t0 = time.perf_counter()
                report = e.step()
                if turn and not report.admitted:
                    acc[v][0] += time.perf_counter() - t0
                    acc[v][1] += report.emitted
                    acc[v][2] += 1
    route(linears, None)
    for e in engines.values():
        e.stop()
    rows = {f"{mode}{'_small_batch' if fast else '_f_linear'}": {"tokens_per_s": tok / s, "ms_per_step": 1e3 * s / n,
                                                                "tokens_per_step": tok / n, "steps": n}
            for (mode, fast), (s, tok, n) in acc.items()}
    base = rows["off_f_linear"]["tokens_per_s"]
    for r in rows.values():
        r["vs_target_only_f_linear"] = r["tokens_per_s"] / base
    return {"gamma": gamma, "variants": rows,
            "spec_round_in_target_steps": {k: rows[f"fixed_{k}"]["ms_per_step"] / rows[f"off_{k}"]["ms_per_step"]
                                           for k in ("f_linear", "small_batch")}}


def generator_ab(target, batch: int, new_tokens: int, turns: int) -> dict:
    """Rollout-style continuous batching (dspark.decoding.generator) at `batch` rows, routed either way."""
    from dspark.decoding.generator import BatchGenerator, GeneratorConfig
    from dspark.decoding.sampling import SamplingParams
    from benchmarks.engine_ab import prompt_ids

    routed = routable_linears(target.model)
    prompts, sampling = prompt_ids(target, batch, 40), SamplingParams(temperature=0.7, top_p=0.9)
    gen, rates = BatchGenerator(target, GeneratorConfig(max_batch=batch)), {False: [], True: []}
    for turn in range(turns):
        for fast in ((True, False) if turn % 2 == 0 else (False, True)):
            route(routed, fast)
            t0 = time.perf_counter()
            out = gen.generate(prompts, sampling, list(range(batch)), new_tokens)
            rates[fast].append(sum(len(tokens) for tokens, _ in out) / (time.perf_counter() - t0))
    route(routed, None)
    return {"batch": batch, "new_tokens": new_tokens, "tokens_per_s_f_linear": rates[False],
            "tokens_per_s_small_batch": rates[True], "ratio": sum(rates[True]) / sum(rates[False])}


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    from dspark.drafters import load_drafter
    from dspark.models.target import load_target

    torch.set_num_threads(args.threads)
    target = load_target(args.target)
    drafter = load_drafter(args.drafter, target=target)
    result = {"benchmark": "small_batch_linear", "target": args.target, "device": "cpu", "threads": args.threads,
              "drafter": args.drafter, "shapes": shapes_table(target, [int(r) for r in args.rows.split(",")]),
              "engine_batch1": engine_ab(target, drafter, args.gamma, args.turns, args.steps),
              "generator": generator_ab(target, 32, 16, 2)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
