"""The engine's rejection step, row by row (`accept_drafts` per request) against batched (`accept_rows`: every
chain row at once, one host copy), on the same rows and generators, interleaved.

    python benchmarks/accept_rows.py                         # SmolLM2's vocabulary (49152), γ = 3, rows 1..64
    python benchmarks/accept_rows.py --vocab 151936 --gamma 4 --device cuda

JSON (the last stdout line; --out writes it too): per row count, the median wall ms of one step's acceptance
each way, their ratio (row_by_row / batched, > 1 = batched faster), `default_on_this_device` (what `accept_rows`
picks here: row by row on a CPU, batched elsewhere), and `host_reads` each way: the device-to-host
reads one step makes (row by row: `int()` of the accepted count and of the next token per row; batched: one
`.tolist()`), which on a GPU each wait for the device. Both give the same tokens (checked on every repeat).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dspark.decoding.batched_accept import accept_rows  # noqa: E402
from dspark.decoding.sampling import accept_drafts  # noqa: E402


def make_rows(rows: int, gamma: int, vocab: int, device: str, seed: int) -> list[tuple]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rows):
        p = torch.softmax(torch.randn(gamma + 1, vocab, generator=g) * 3, -1)
        q = torch.softmax(p[:gamma].log() + torch.randn(gamma, vocab, generator=g), -1)
        x = torch.multinomial(q, 1, generator=g)[:, 0]
        out.append((x.to(device), q.to(device), p.to(device)))
    return out


def generators(rows: int, device: str, seed: int) -> list[torch.Generator]:
    return [torch.Generator(device=device).manual_seed(seed + r) for r in range(rows)]


def timed(fn) -> tuple[float, object]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    result = fn()
    return (time.perf_counter() - t0) * 1e3, result


def measure(rows: int, args) -> dict:
    data = make_rows(rows, args.gamma, args.vocab, args.device, rows)
    xs, qs, ps = zip(*data)
    one_by_one, batched = [], []
    for repeat in range(args.repeats):
        seed = 1000 * repeat
        ms_a, alone = timed(lambda: [accept_drafts(x, q, p, g) for (x, q, p), g
                                     in zip(data, generators(rows, args.device, seed))])
        ms_b, together = timed(lambda: accept_rows(xs, qs, ps, generators(rows, args.device, seed), batched=True))
        if [tuple(a) for a in alone] != together:
            raise SystemExit(f"rows {rows}: batched tokens differ from row by row")
        one_by_one.append(ms_a)
        batched.append(ms_b)
    a, b = statistics.median(one_by_one), statistics.median(batched)
    return {"rows": rows, "row_by_row_ms": round(a, 3), "batched_ms": round(b, 3), "ratio": round(a / b, 2),
            "host_reads": {"row_by_row": 2 * rows, "batched": 1}}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,16,64", help="comma-separated row counts (requests in a step)")
    ap.add_argument("--gamma", type=int, default=3, help="drafts verified per row")
    ap.add_argument("--vocab", type=int, default=49152, help="vocabulary size (SmolLM2: 49152)")
    ap.add_argument("--repeats", type=int, default=15, help="timed steps per row count, each way (interleaved)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args(argv)
    default = "batched" if torch.device(args.device).type != "cpu" else "row_by_row"
    report = {"device": args.device, "default_on_this_device": default, "gamma": args.gamma, "vocab": args.vocab,
              "threads": torch.get_num_threads(), "rows": [measure(int(r), args) for r in args.rows.split(",")]}
    line = json.dumps(report)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(line)
    return report


if __name__ == "__main__":
    main()
