"""The serving engine's target step: the decoding core (eager, optionally compiled) against the ragged store it
used before (`decode_core: dynamic`), side by side in one run.

    python benchmarks/engine_core.py                 # smollm2-135m + the committed CPU drafter, c = 1, 4, 16
    python benchmarks/engine_core.py --target tiny --drafter untrained --concurrency 1,4 --max-new-tokens 8 --out /dev/null

For each concurrency c: `Engine.generate` over 2·c prompts (the eval prompts cycled) with at most c active, the
scheduler `--mode` (dynamic: the load-aware verify lengths, so rows of one step have different lengths — the
case where the core pads and the ragged store does not), every mode's engine built once (one SPS table, profiled
on the first, given to all), modes taking turns round by round (order rotating). tok/s = emitted tokens over
wall time, prefills included. Also τ per mode (the same drafter and scheduler: a sanity check that the modes
decode alike, not a speed figure). Last stdout line: JSON (also benchmarks/results/engine_core/<cpu>.json).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.decode_core import DEFAULT_DRAFTER, device_label, load_drafter, write_result  # noqa: E402
from benchmarks.decode_speed import eval_prompt_ids  # noqa: E402
from dspark.decoding.engine import Engine, EngineConfig  # noqa: E402
from dspark.decoding.sampling import SamplingParams  # noqa: E402
from dspark.decoding.scheduler import SchedulerConfig  # noqa: E402
from dspark.models.precision import torch_dtype  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--drafter", default=DEFAULT_DRAFTER, help="drafter reference, or untrained")
    ap.add_argument("--mode", default="dynamic", help="scheduler mode")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--modes", default="dynamic,eager", help="decode_core modes (add compiled to include it)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--data-dir", default=str(REPO_ROOT / "data" / "eval"))
    ap.add_argument("--datasets", default="gsm8k,humaneval,mt-bench")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per dataset")
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def engines(target, drafter, modes: list[str], rows: int, sched: str, table: dict | None) -> dict:
    built = {}
    for mode in modes:
        cfg = EngineConfig(scheduler=SchedulerConfig(mode=sched), decode_core=mode, max_batch=rows,
                           max_waiting=4 * rows, sps_table=table)
        built[mode] = Engine(target, drafter, cfg)
        table = table or (dict(built[mode].sps.points) if built[mode].sps else None)
    return built


def main(argv=None) -> dict:
    args = parse_args(argv)
    from dspark.models.target import load_target

    dtype = torch_dtype("auto", "cpu")
    target = load_target(args.target, device="cpu", dtype=dtype)
    drafter = load_drafter(args.drafter, target).to(dtype)
    prompts = [ids for _, ids in eval_prompt_ids(target, args.data_dir, args.datasets, args.prompts)]
    modes, sp = args.modes.split(","), SamplingParams(temperature=1.0)
    table, rows_out = None, {}
    for c in [int(x) for x in args.concurrency.split(",")]:
        batch = (prompts * (2 * c // len(prompts) + 1))[: 2 * c]
        built = engines(target, drafter, modes, c, args.mode, table)
        table = table or next((dict(e.sps.points) for e in built.values() if e.sps), None)
        for e in built.values():  # warm-up (the compiled mode compiles here)
            e.generate(batch[:c], sp, max_new_tokens=8, stop_ids=[])
        tokens, seconds, taus = {m: 0 for m in modes}, {m: 0.0 for m in modes}, {m: [] for m in modes}
        for r in range(args.rounds):
            for m in modes[r % len(modes):] + modes[: r % len(modes)]:
                t0 = time.perf_counter()
                reqs = built[m].generate(batch, sp, max_new_tokens=args.max_new_tokens, stop_ids=[],
                                         seeds=[1000 * r + i for i in range(len(batch))])
                seconds[m] += time.perf_counter() - t0
                tokens[m] += sum(len(q.tokens) for q in reqs)
                taus[m] += [q.stats.spec_decode()["mean_accepted_length"] or 1.0 for q in reqs]
        rows_out[str(c)] = {"tok_per_s": {m: round(tokens[m] / seconds[m], 1) for m in modes},
                            "tau": {m: round(sum(t) / len(t), 3) for m, t in taus.items()}}
        if "dynamic" in modes:
            rows_out[str(c)]["core_over_ragged"] = {m: round(tokens[m] / seconds[m] / (tokens["dynamic"] / seconds["dynamic"]), 3)
                                                   for m in modes if m != "dynamic"}
        print(c, json.dumps(rows_out[str(c)]), flush=True)
    result = {"benchmark": "engine_core", "device": device_label("cpu"), "target": target.name,
              "dtype": str(dtype).removeprefix("torch."), "scheduler": args.mode, "prompts": len(prompts),
              "max_new_tokens": args.max_new_tokens, "rounds": args.rounds, "by_concurrency": rows_out}
    write_result(result, "engine_core", result["device"], args.out)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
