"""One engine step's random draws with a torch.Generator per request (before) against a CounterStream per request
(the engine's now): the drafted block's uniforms (`block_uniforms`, γ per request) and the rejection step's
(`batched_accept.acceptance_uniforms`: γ accept uniforms and one next-token uniform per request), interleaved
per repeat.

    python benchmarks/request_streams.py                      # rows 1, 4, 16, 64, γ = 4, on the CPU
    python benchmarks/request_streams.py --device cuda --out benchmarks/results/request_streams/h200.json

JSON (the last stdout line; --out writes it too): per row count and way, `aten_ops` (top-level aten calls of one
step's draws, torch.profiler: what the host dispatches; on a GPU each is at least one kernel launch) and the
median `us` of one step's draws, and `us_ratio` = generator / counter (> 1: counter streams faster).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.output import emit  # noqa: E402
from dspark.decoding.batched_accept import acceptance_uniforms  # noqa: E402
from dspark.decoding.counter_random import CounterStream  # noqa: E402
from dspark.decoding.sampling import block_uniforms  # noqa: E402


def streams(way: str, rows: int, device: str) -> list:
    if way == "generator":
        return [torch.Generator(device=device).manual_seed(r) for r in range(rows)]
    return [CounterStream(r, device) for r in range(rows)]


def step_draws(per_request: list, gamma: int, device: str) -> None:
    gammas = [gamma] * len(per_request)
    block_uniforms(per_request, gammas, device)
    acceptance_uniforms(per_request, gammas, device)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def aten_ops(per_request: list, gamma: int, device: str) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step_draws(per_request, gamma, device)
    return sum(1 for e in prof.events() if e.name.startswith("aten::")
               and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))


def measure(rows: int, args) -> dict:
    ways = {way: streams(way, rows, args.device) for way in ("generator", "counter")}
    times = {way: [] for way in ways}
    for _ in range(args.repeats):
        for way, per_request in ways.items():  # interleaved: the machine's drift hits both ways alike
            t0 = time.perf_counter()
            step_draws(per_request, args.gamma, args.device)
            times[way].append((time.perf_counter() - t0) * 1e6)
    row = {way: {"aten_ops": aten_ops(per_request, args.gamma, args.device),
                 "us": round(statistics.median(times[way]), 1)} for way, per_request in ways.items()}
    row["us_ratio"] = round(row["generator"]["us"] / row["counter"]["us"], 3)
    return row


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,4,16,64", help="requests per step, comma-separated")
    parser.add_argument("--gamma", type=int, default=4, help="drafts per request")
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    result = {"device": args.device, "gamma": args.gamma, "repeats": args.repeats,
              "rows": {int(r): measure(int(r), args) for r in args.rows.split(",")}}
    return emit(result, args.out)


if __name__ == "__main__":
    main()
