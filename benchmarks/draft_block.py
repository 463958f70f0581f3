"""A DSpark drafting pass for R requests (`propose_batch`, Markov head, each request its own seeded stream as in
the engine), with the block's random draws made two ways, interleaved in one run:

- `per_position`: each drafted position draws from every request's stream (one generator call per request
  and position, an index built on the host when some requests stop earlier) — how drafting drew until now;
- `up_front`: the whole block's uniforms drawn before drafting (`BlockDraws`: one call per request), so a
  position is one `inverse_cdf` over all rows with no host work.

    python benchmarks/draft_block.py                          # SmolLM2-135M, γ 4, rows 1/16/64
    python benchmarks/draft_block.py --target tiny --reps 5   # seconds

JSON (the last stdout line; --out writes it too): per row count, the median wall ms of one pass each way,
per_position / up_front (> 1 = up front faster), and `ops_per_pass` each way (operators dispatched, counted
with torch.profiler). On a CPU both ways give every request the same tokens (checked on every repeat:
`same_tokens`); a CUDA stream's one call of n draws gives other values than n single calls (`same_tokens`
null: same distribution, not comparable token by token).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.output import emit  # noqa: E402
from dspark.decoding.sampling import SamplingParams  # noqa: E402
from dspark.drafters import DrafterConfig, build_drafter  # noqa: E402
from dspark.drafters.base import BlockDraws  # noqa: E402

MODES = ("per_position", "up_front")


@contextmanager
def drawing(mode: str):
    """`per_position`: BlockDraws draws the streams position by position (as before)."""
    BlockDraws.up_front = mode == "up_front"
    try:
        yield
    finally:
        BlockDraws.up_front = True


def requests(target, drafter, rows: int, context: int):
    ids = torch.randint(0, target.vocab_size, (rows, context + 1), generator=torch.Generator().manual_seed(rows))
    with torch.no_grad():
        feats = target.forward(ids[:, :context], layer_ids=drafter.layer_ids, logits_at=None).features
    states = []
    for r in range(rows):
        state = drafter.new_state()
        drafter.extend_context(state, feats[r], ids[r, :context])
        states.append(state)
    return states, [int(a) for a in ids[:, context]]


def one_pass(drafter, states, anchors, gamma: int, seed: int):
    streams = [torch.Generator(device=drafter.device).manual_seed(seed + r) for r in range(len(states))]
    return drafter.propose_batch(states, anchors, gamma, SamplingParams(temperature=1.0), streams)


def synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def ops_per_pass(drafter, states, anchors, gamma: int, mode: str) -> int:
    with drawing(mode), profile(activities=[ProfilerActivity.CPU]) as prof:
        one_pass(drafter, states, anchors, gamma, 0)
    return sum(1 for e in prof.events() if e.name.startswith("aten::"))


def measure(drafter, target, rows: int, args) -> dict:
    states, anchors = requests(target, drafter, rows, args.context)
    times, same_values = {m: [] for m in MODES}, torch.device(drafter.device).type == "cpu"
    for rep in range(args.warmup + args.reps):
        tokens = {}
        for mode in MODES if rep % 2 == 0 else MODES[::-1]:  # alternate which goes first
            with drawing(mode):
                synchronize(drafter.device)
                t0 = time.perf_counter()
                out = one_pass(drafter, states, anchors, args.gamma, 1000 * rep)
                synchronize(drafter.device)
                elapsed = (time.perf_counter() - t0) * 1e3
            tokens[mode] = [p.tokens.tolist() for p in out]
            if rep >= args.warmup:
                times[mode].append(elapsed)
        if same_values:  # a CPU stream: one call of n draws = n single draws; a CUDA stream's values differ
            assert tokens["per_position"] == tokens["up_front"], "the two ways drew different tokens"
    ms = {m: round(statistics.median(t), 3) for m, t in times.items()}
    return {"rows": rows, "ms_per_pass": ms, "per_position_over_up_front": round(ms["per_position"] / ms["up_front"], 3),
            "ops_per_pass": {m: ops_per_pass(drafter, states, anchors, args.gamma, m) for m in MODES},
            "same_tokens": True if same_values else None}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m", help="tiny | smollm2-135m | model dir")
    ap.add_argument("--rows", default="1,16,64", help="request counts, comma-separated")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--context", type=int, default=32, help="verified positions per request's drafter state")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def main(argv=None, target=None) -> dict:
    """target: an already loaded target (the GPU recipe's, on its device) instead of --target."""
    args = parse_args(argv)
    if target is None:
        from dspark.models.target import load_target

        target = load_target(args.target)
    torch.manual_seed(0)
    cfg = DrafterConfig(algo="dspark", head="markov", block_size=args.gamma, num_layers=1, num_context_layers=2,
                        rank=32)
    drafter = build_drafter(cfg, target).eval()
    result = {"benchmark": "draft_block", "target": target.name, "vocab": target.vocab_size,
              "device": str(drafter.device), "threads": torch.get_num_threads(), "gamma": args.gamma,
              "reps": args.reps, "rows": [measure(drafter, target, int(r), args) for r in args.rows.split(",")]}
    for row in result["rows"]:
        print(f"rows {row['rows']:>3}: per_position {row['ms_per_pass']['per_position']:.2f} ms, up_front "
              f"{row['ms_per_pass']['up_front']:.2f} ms ({row['per_position_over_up_front']:.2f}x); ops "
              f"{row['ops_per_pass']['per_position']} -> {row['ops_per_pass']['up_front']}", flush=True)
    return emit(result, args.out)


if __name__ == "__main__":
    main()
