"""A drafting round (`propose_batch` of a block per request, then `extend_contexts` with the verified positions)
with the drafter's passes eager and captured over the drafter's slot store, any number of requests (block drafters:
dspark.drafters.block_capture + chain_capture; Eagle3: eagle3_capture), side by side in one run.

    python benchmarks/draft_step.py                                     # smollm2-135m, the committed CPU drafter
    python benchmarks/draft_step.py --target tiny --drafter untrained   # a minute
    python benchmarks/draft_step.py --drafter untrained-eagle3          # a fresh Eagle3 on SmolLM2
    python benchmarks/draft_step.py --requests 4                        # 4 requests drafted together (the engine)

Rows of the JSON (the last stdout line; also benchmarks/results/draft_step/<device>.json with the defaults):
- ops_per_round: operators one round dispatches, counted with torch.profiler (`aten`: every aten call, nested too;
  `top_level`: those not inside another), for `propose` and `extend_context` (`--accepted` + 1 new positions per
  request; `--requests` requests, each over the same prompt's context);
  a captured graph's fused kernels are not aten calls, what it still dispatches is counted;
- host_ms_per_round: wall ms of one round, median of `--repeats`, the two ways taking turns round by round;
- the state is cropped back after every round, so each round drafts over the same context (the prompt's);
- compile_s: the captured way's first rounds (its graphs are built there).
On a GPU a dispatched operator costs ~36 µs of host time (the H200 recipe's profile), so the op ratio is what the
capture buys there; GPU timings are not measured here.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.decode_core import (DEFAULT_DRAFTER, count_ops, device_label, drafter_or_untrained,  # noqa: E402
                                    model_args, write_result)
from benchmarks.decode_speed import eval_prompt_ids  # noqa: E402
from dspark.decoding.kv_sequence import open_sequence  # noqa: E402
from dspark.decoding.sampling import SamplingParams  # noqa: E402
from dspark.decoding.specdec import drafter_layer_ids  # noqa: E402
from dspark.models.precision import torch_dtype  # noqa: E402

WAYS = ("eager", "captured")


def parse_args(argv=None) -> argparse.Namespace:
    ap = model_args(__doc__.split("\n")[0], "drafter reference, or untrained[-<algo>] (a fresh DSpark, or that algo)")
    ap.add_argument("--dataset", default="mt-bench", help="the prompt's dataset (its first prompt)")
    ap.add_argument("--accepted", type=int, default=1, help="drafts accepted per round (extend_context adds +1)")
    ap.add_argument("--requests", type=int, default=1, help="requests drafted together (as the engine batches them)")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def prompt_context(target, drafter, ids: list[int]) -> torch.Tensor:
    """The prompt's target features [T, m*d] (an eager prefill)."""
    out = open_sequence(target, "eager").extend(ids, drafter_layer_ids(drafter), logits="last")
    return out.features[0]


def new_states(drafter, captured: bool, features: torch.Tensor, ids: list[int], requests: int) -> list:
    states = []
    for _ in range(requests):
        state = drafter.new_state()
        state.captured = captured
        drafter.extend_context(state, features, torch.tensor(ids, device=features.device))
        states.append(state)
    return states


def crop(states, length: int) -> None:
    for state in states:
        for buf in state.kv:
            buf.crop(length)
        state.length = length


def propose(drafter, states, anchor: int, seed: int):
    n = len(states)
    return drafter.propose_batch(states, [anchor] * n, drafter.config.block_size, [SamplingParams(temperature=1.0)] * n,
                                 [torch.Generator().manual_seed(seed + r) for r in range(n)])


def one_round(drafter, states, anchor: int, new_features: torch.Tensor, new_ids: torch.Tensor, seed: int) -> None:
    """propose a block per request, add the verified positions, crop back to where the round started."""
    length = states[0].length
    propose(drafter, states, anchor, seed)
    drafter.extend_contexts(states, [new_features] * len(states), [new_ids] * len(states))
    crop(states, length)


def round_ops(drafter, states, anchor, new_features, new_ids) -> dict:
    """Ops of propose and of extend_context in one round (counted separately, then summed)."""
    length = states[0].length
    proposed = count_ops(lambda _: propose(drafter, states, anchor, 0), None)
    extend = count_ops(lambda _: drafter.extend_contexts(states, [new_features] * len(states),
                                                         [new_ids] * len(states)), None)
    crop(states, length)
    total = {k: proposed[k] + extend[k] for k in proposed}
    return {"propose": proposed, "extend_context": extend, "round": total}


def main(argv=None) -> dict:
    args = parse_args(argv)
    from dspark.io import storage
    from dspark.models.target import load_target

    dtype = torch_dtype(args.dtype, args.device)
    target = load_target(args.target, device=args.device, dtype=dtype, local_copy=storage.local_copy)
    drafter = drafter_or_untrained(args.drafter, target).to(dtype)
    (_, ids), = eval_prompt_ids(target, args.data_dir, args.dataset, 1)
    features = prompt_context(target, drafter, ids)
    n_new = args.accepted + 1
    new_features, new_ids = features[:n_new], torch.tensor(ids[:n_new], device=features.device)
    states = {way: new_states(drafter, way == "captured", features, ids, args.requests) for way in WAYS}
    print(f"target {target.name} {dtype} on {args.device}; drafter {drafter.algo} γ {drafter.config.block_size}, "
          f"{drafter.config.num_layers} layer(s); context {len(ids)}; {args.requests} request(s)", flush=True)
    compile_s = {}
    for way in WAYS:
        t0 = time.perf_counter()
        for r in range(args.warmup):
            one_round(drafter, states[way], ids[-1], new_features, new_ids, r)
        compile_s[way] = round(time.perf_counter() - t0, 1)
    ops = {way: round_ops(drafter, states[way], ids[-1], new_features, new_ids) for way in WAYS}
    times = {way: [] for way in WAYS}
    for r in range(args.repeats):
        for way in (WAYS if r % 2 == 0 else WAYS[::-1]):
            t0 = time.perf_counter()
            one_round(drafter, states[way], ids[-1], new_features, new_ids, 100 + r)
            times[way].append(time.perf_counter() - t0)
    ms = {way: round(1000 * statistics.median(times[way]), 3) for way in WAYS}
    result = {
        "device": device_label(args.device), "target": target.name,
        "drafter": args.drafter.removeprefix(str(REPO_ROOT) + "/"),
        "algo": drafter.algo, "drafter_layers": drafter.config.num_layers, "gamma": drafter.config.block_size,
        "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__, "context": len(ids),
        "requests": args.requests, "new_positions_per_round": n_new, "ops_per_round": ops, "host_ms_per_round": ms, "compile_s": compile_s,
        **{f"round_{name}_eager_over_captured":
           round(ops["eager"]["round"][kind] / max(1, ops["captured"]["round"][kind]), 1)
           for name, kind in (("ops", "aten"), ("top_level", "top_level"))},
        "captured_speedup_host": round(ms["eager"] / ms["captured"], 3),
        "captured_failed": bool(drafter.__dict__.get("_block_capture_failed")
                                or drafter.__dict__.get("_chain_capture_failed")),
    }
    if args.device == "cpu" and args.out is None and args.target == "smollm2-135m" and args.drafter == DEFAULT_DRAFTER:
        suffix = f"_{args.requests}requests" if args.requests > 1 else ""
        write_result(result, "draft_step", result["device"] + suffix)
    elif args.out:
        write_result(result, "draft_step", result["device"], args.out)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
