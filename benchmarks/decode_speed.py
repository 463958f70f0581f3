"""Batch-1 decode speed: target-only vs speculative decoding with each drafter, side by side.

    python benchmarks/decode_speed.py --target tiny --quick
    python benchmarks/decode_speed.py --target smollm2-135m --drafter models:/smollm2-135m-dspark-drafter@champion \
        --drafter /path/to/dflash_ckpt --prompts 3 --max-new-tokens 128
    python benchmarks/decode_speed.py --target smollm2-135m --algo dspark --algo eagle3   # untrained drafters

Every mode decodes the same prompts (the first turn of the first `--prompts` lines of each
`--datasets` file, chat template applied) with the same per-prompt seed. Reported per mode:
tokens/s (all new tokens over all wall time, prefill included), speedup over target-only, τ
(accepted + 1 per round, with its 95 % prompt-bootstrap interval; `tau_emitted` leaves out drafts accepted
past the token budget, the figure `compare --answer-tokens`' renewal estimate predicts), position-wise
conditional acceptance, mean draft / verify seconds per round, and the speedup's 95 % interval from
resampling prompts (paired: a resampled prompt brings every mode's run of it). Modes take turns prompt
by prompt, in an order that rotates, so a slow spell of a noisy machine lands on every mode alike; each
drafter after the first of its dtype is also compared with that first one (`vs_first_drafter`, with
its interval): is the new drafter faster than the committed one? `--drafter` takes any drafter reference (local dir, s3://, runs:/, models:/) and may repeat;
without one, untrained drafters are built for each `--algo` (τ ≈ 1: a floor, not a result).
`--scheduler dynamic` verifies the Algorithm-1 prefix (R = 1) on an SPS table profiled at start.
`--tree 4` (repeatable) adds a mode per DSpark drafter that verifies a tree of drafts per round
(dspark.decoding.tree_specdec; "4": four distinct first tokens, each with its own chain; "4x2": two under
each): τ is then tokens per target forward, as for a chain.
`--engine` runs every mode through the serving engine (dspark.decoding.engine, one request at a time:
max_batch 1, the ragged KV slots, lazy drafter catch-up, trees as EngineConfig.draft_tree, seeded requests
on their generator stream) instead of the batch-1 decoders: the speed a served request gets.
The last stdout line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from dspark.eval import metrics  # noqa: E402
from dspark.eval.acceptance_estimate import bootstrap_ratio  # noqa: E402
from dspark.eval.benchmark_files import parse_benchmark  # noqa: E402
from dspark.decoding.sampling import SamplingParams  # noqa: E402
from dspark.decoding.scheduler import PrefixScheduler, SchedulerConfig, profile_sps, target_verify_fn  # noqa: E402
from dspark.decoding.specdec import speculative_generate, target_generate  # noqa: E402
from dspark.decoding.tree_specdec import parse_branching, tree_speculative_generate  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="tiny", help="tiny | smollm2-135m | model dir | s3:// | hub name")
    ap.add_argument("--drafter", action="append", default=[], help="trained drafter reference (repeatable)")
    ap.add_argument("--algo", action="append", default=[], choices=["dspark", "dflash", "eagle3"],
                    help="untrained drafter to build (repeatable; default all three when no --drafter)")
    ap.add_argument("--drafter-layers", type=int, default=None, help="layers of untrained drafters")
    ap.add_argument("--data-dir", default=str(REPO_ROOT / "data" / "eval"), help="eval JSONL dir (default: the repo's data/eval)")
    ap.add_argument("--datasets", default="gsm8k,humaneval,mt-bench", help="comma-separated JSONL stems")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per dataset")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--gamma", type=gamma_list, default=None,
                    help="drafts per round (default: drafter block size); several, e.g. 3,5,7: one mode per drafter "
                         "and value, named <drafter>:g<γ>, decoded side by side")
    ap.add_argument("--tree", action="append", type=tree_spec, default=[],
                    help="also decode with a draft tree per round (DSpark drafters; repeatable): children per node at "
                         "each depth, e.g. 4 or 2x2; one mode per drafter and tree, named <drafter>:t<tree> "
                         "(dspark.decoding.tree_specdec)")
    ap.add_argument("--scheduler", choices=["fixed", "dynamic"], default="fixed")
    ap.add_argument("--engine", action="store_true",
                    help="decode every mode through the serving engine at max_batch 1 (see the module doc)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--dtypes", default="float32",
                    help="comma-separated target dtypes (float32, bfloat16): every mode runs once per dtype, the "
                         "drafters cast to it; the first is the speedup reference, `speedup_vs_fastest_target` "
                         "compares with the fastest target-only (on a CPU with avx512_bf16, bf16 target-only "
                         "decoding can beat fp32)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="1 prompt per dataset, 24 new tokens, tiny target")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.max_new_tokens = 1, min(args.max_new_tokens, 24)
    if not args.drafter and not args.algo:
        args.algo = ["dspark", "dflash", "eagle3"]
    return args


def gamma_list(text: str) -> list[int]:
    """'3' -> [3]; '3,5,7' -> [3, 5, 7] (each at least 1)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give whole numbers, e.g. 3 or 3,5,7") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every γ must be at least 1")
    return values


def tree_spec(text: str) -> tuple[int, ...]:
    """'2x2' -> (2, 2): children per node at depths 1, 2 of a draft tree."""
    try:
        return parse_branching(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def eval_prompt_ids(target, data_dir: str, datasets: str, per_dataset: int) -> list[tuple[str, list[int]]]:
    base = data_dir
    if not os.path.isdir(base):
        raise SystemExit(f"eval data directory {base} not found; pass --data-dir")
    prompts = []
    for name in [s.strip() for s in datasets.split(",") if s.strip()]:
        path = Path(base) / f"{name}.jsonl"
        if not path.exists():
            raise SystemExit(f"{path} not found; pick --datasets from {sorted(p.stem for p in Path(base).glob('*.jsonl'))}")
        for i, turns in enumerate(parse_benchmark(path.read_text(), str(path))[:per_dataset]):
            prompts.append((f"{name}/{i}", target.chat_ids([{"role": "user", "content": turns[0]}])))
    return prompts


def load_drafters(args, target) -> dict:
    from dspark.io.drafter_source import load_drafter_ref
    from dspark.drafters import DrafterConfig, build_drafter

    drafters = {}
    for ref, name in zip(args.drafter, distinct_names(args.drafter)):
        drafter = load_drafter_ref(ref, target).eval()
        drafters[f"{drafter.config.algo}:{name}"] = drafter
    for algo in args.algo:
        extra = {"num_layers": args.drafter_layers} if args.drafter_layers else {}  # eagle3 keeps its one layer
        torch.manual_seed(args.seed)
        drafters[f"{algo}:untrained"] = build_drafter(DrafterConfig(algo=algo, **extra), target).eval()
    return drafters


def distinct_names(refs: list[str]) -> list[str]:
    """Each drafter's folder name, or its last k path parts for the smallest k that no other ref shares
    (two ".../e01-L1-.../dspark/drafter" refs are named from their run folders, not "drafter")."""
    parts = [Path(ref.rstrip("/")).parts for ref in refs]

    def name(mine: tuple) -> str:
        k = 1
        while k < len(mine) and sum(p[-k:] == mine[-k:] for p in parts) > 1:
            k += 1
        return "/".join(mine[-k:])

    return [name(p) for p in parts]


def engine_decoder(target, drafter, sp: SamplingParams, max_new_tokens: int, stops, gamma: int | None,
                   tree: tuple[int, ...] | None, scheduler: str):
    """A mode's decode(ids, generator) -> GenerationResult through an Engine of its own (max_batch 1); the
    rounds come from the engine's step reports (one request: one round per step that verified)."""
    from dspark.decoding.engine import Engine, EngineConfig
    from dspark.decoding.specdec import GenerationResult, RoundStats

    mode = "off" if drafter is None else (scheduler if drafter.has_confidences else "fixed")
    engine = Engine(target, drafter, EngineConfig(scheduler=SchedulerConfig(mode=mode), gamma=gamma, max_batch=1,
                                                  draft_tree=list(tree) if tree else None, seeded_sampling="stream"))
    rounds: list = []

    def record(rep) -> None:
        if rep.rows and rep.drafted:
            rounds.append(RoundStats(proposed=rep.proposed, verified=rep.verified, accepted=rep.accepted,
                                     outcomes=[True] * rep.accepted + ([False] if rep.accepted < rep.verified else []),
                                     emitted=rep.emitted, draft_s=rep.draft_s, verify_s=rep.verify_s))

    engine.step_listeners.append(record)

    def decode(ids, gen):
        rounds.clear()
        seed = int(torch.randint(2 ** 62, (1,), generator=gen))
        t0 = time.perf_counter()
        req = engine.generate([ids], sp, max_new_tokens, stops, seeds=[seed])[0]
        if req.error:
            raise RuntimeError(f"engine request failed: {req.error}")
        return GenerationResult(list(req.tokens), list(rounds), req.finish_reason, time.perf_counter() - t0, len(ids))

    return decode


def batch1_decoder(target, drafter, sp: SamplingParams, max_new_tokens: int, stops, gamma: int | None,
                   tree: tuple[int, ...] | None, verify_len):
    """A mode's decode(ids, generator) through the batch-1 decoders: a chain (`speculative_generate`, with
    the scheduler's verify_len hook) or a tree of drafts (`tree_speculative_generate`)."""
    if tree is None:
        return lambda ids, gen: speculative_generate(target, drafter, ids, sp, max_new_tokens, stops,
                                                     verify_len=verify_len, generator=gen, gamma=gamma)
    return lambda ids, gen: tree_speculative_generate(target, drafter, ids, sp, max_new_tokens, tree, stops,
                                                      generator=gen, gamma=gamma)


def decode_interleaved(prompts, modes: dict) -> dict:
    """Each mode's GenerationResult per prompt. Prompt i is decoded by every mode in turn, the order rotated by
    i, each with the same seed (1000 + i): drift in machine speed is shared by all modes instead of falling on
    whichever ran last."""
    from tqdm.auto import tqdm

    names = list(modes)
    results = {name: [] for name in names}
    for i, (_, ids) in enumerate(tqdm(prompts, desc="decode (every mode per prompt)", unit="prompt", file=sys.stderr)):
        for name in names[i % len(names):] + names[:i % len(names)]:
            results[name].append(modes[name](ids, torch.Generator(device="cpu").manual_seed(1000 + i)))
    return results


def dtype_suffix(mode: str) -> str:
    """'' for the first dtype's modes, '@bfloat16' etc. for the others (see `main`; a drafter reference such
    as models:/name@champion keeps its own '@')."""
    tail = mode.rsplit("@", 1)[-1]
    return "@" + tail if "@" in mode and tail in ("float32", "bfloat16") else ""


def ratio_text(vs: dict | None) -> str | None:
    """'1.036 [0.996, 1.076]' for a `vs_first_drafter` entry (None: the table shows a dash)."""
    return None if vs is None else "{:.3f} [{:.3f}, {:.3f}]".format(vs["ratio"], *vs["ci95"])


def paired_speed_ratio(results, base_results, resamples: int = 2000, seed: int = 0) -> list[float]:
    """95 % interval of (tok/s of `results`) / (tok/s of `base_results`), prompts resampled with replacement,
    each resampled prompt carrying both sides' runs of it."""
    tok = np.array([[len(r.token_ids), len(b.token_ids)] for r, b in zip(results, base_results)], dtype=float)
    wall = np.array([[r.wall_s, b.wall_s] for r, b in zip(results, base_results)], dtype=float)
    idx = np.random.default_rng(seed).integers(0, len(tok), size=(resamples, len(tok)))
    t, w = tok[idx].sum(1), np.maximum(wall[idx].sum(1), 1e-12)  # (resamples, 2)
    ratios = (t[:, 0] / w[:, 0]) / np.maximum(t[:, 1] / w[:, 1], 1e-12)
    return [float(x) for x in np.percentile(ratios, [2.5, 97.5])]


def mode_summary(results) -> dict:
    s = metrics.summarize_results(results)
    rounds = [r for res in results for r in res.rounds]
    n = max(len(rounds), 1)
    tau_sums = [sum(r.accepted + 1 for r in res.rounds) for res in results]
    tau_ci = bootstrap_ratio(tau_sums, [len(res.rounds) for res in results]) if rounds else None
    return {"tokens": s["tokens"], "wall_s": round(s["wall_s"], 4), "tokens_per_s": s["tokens_per_s"],
            "tau": s["tau"], "tau_ci95": list(tau_ci) if tau_ci else None, "tau_emitted": s["tau_emitted"],
            "mean_verified": s["mean_verified"], "cond_accept": s["cond_accept"],
            "draft_s_per_round": sum(r.draft_s for r in rounds) / n,
            "verify_s_per_round": sum(r.verify_s for r in rounds) / n, "rounds": s["rounds"]}


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from dspark.io import storage
    from dspark.models.target import load_target

    t0 = time.perf_counter()
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    unknown = [d for d in dtypes if d not in ("float32", "bfloat16")]
    if unknown:
        raise SystemExit(f"--dtypes: unknown {unknown}; use float32 and/or bfloat16")
    sp = SamplingParams(temperature=args.temperature)
    modes, verify_len, sps_points = {}, None, None
    for i, dtype in enumerate(dtypes):
        suffix = "" if i == 0 else f"@{dtype}"
        target = load_target(args.target, device=args.device, local_copy=storage.local_copy,
                             dtype=getattr(torch, dtype))
        drafters = {name: d.to(getattr(torch, dtype)) for name, d in load_drafters(args, target).items()}
        if i == 0:
            prompts = eval_prompt_ids(target, args.data_dir, args.datasets, args.prompts)
            print(f"target {target.name} ({target.num_layers} layers, vocab {target.vocab_size}) on {args.device}; "
                  f"{len(prompts)} prompts x {args.max_new_tokens} new tokens; dtypes {dtypes}; modes: target, "
                  f"{', '.join(drafters)}" + (f" at γ {args.gamma}" if args.gamma else "")
                  + (f"; trees {['x'.join(map(str, t)) for t in args.tree]}" if args.tree else ""), flush=True)
        stops = target.eos_token_ids
        hook = None
        if args.scheduler == "dynamic":
            block = max(d.config.block_size for d in drafters.values())
            sps = profile_sps(target_verify_fn(target, context_len=128), list(range(1, max(args.gamma or [block]) + 2)))
            sps_points = sps_points or sps.to_dict()
            hook = PrefixScheduler(SchedulerConfig(mode="dynamic"), sps).verify_len_hook()
        if args.engine:
            modes["target" + suffix] = engine_decoder(target, None, sp, args.max_new_tokens, stops, None, None, "off")
        else:
            modes["target" + suffix] = (lambda t, st: lambda ids, gen: target_generate(
                t, ids, sp, args.max_new_tokens, st, gen))(target, stops)
        for name, drafter in drafters.items():
            h = hook if drafter.has_confidences else None
            for gamma in args.gamma or [None]:
                tag = f":g{gamma}" if len(args.gamma or []) > 1 else ""
                trees = args.tree if hasattr(drafter, "draft_tree") else []
                for tree, label in [(None, tag), *((t, f"{tag}:t{'x'.join(map(str, t))}") for t in trees)]:
                    modes[name + label + suffix] = (
                        engine_decoder(target, drafter, sp, args.max_new_tokens, stops, gamma, tree, args.scheduler)
                        if args.engine else batch1_decoder(target, drafter, sp, args.max_new_tokens, stops, gamma,
                                                           tree, h))

    warm = prompts[:1]
    for decode in modes.values():  # one short warm-up per mode: allocator, kernels, lazy imports
        decode(warm[0][1], torch.Generator().manual_seed(0))

    results = decode_interleaved(prompts, modes)
    summaries = {name: mode_summary(res) for name, res in results.items()}
    for name, s in summaries.items():
        print(f"  {name:24s} {s['tokens_per_s']:8.2f} tok/s  tau {s['tau'] or 1:.2f}", flush=True)
    base = summaries["target"]["tokens_per_s"]
    fastest = max(v["tokens_per_s"] for k, v in summaries.items() if k.split("@")[0] == "target")
    first_drafter = {}  # dtype suffix -> the first drafter mode of that dtype
    for k in summaries:
        if not k.startswith("target"):
            first_drafter.setdefault(dtype_suffix(k), k)
    rows = []
    for name, s in summaries.items():
        s["speedup"] = s["tokens_per_s"] / base if base else None
        s["speedup_ci95"] = paired_speed_ratio(results[name], results["target"])
        first = first_drafter.get(dtype_suffix(name))
        if not name.startswith("target") and name != first:
            s["vs_first_drafter"] = {"drafter": first, "ratio": s["tokens_per_s"] / summaries[first]["tokens_per_s"],
                                     "ci95": paired_speed_ratio(results[name], results[first])}
        s["speedup_vs_fastest_target"] = s["tokens_per_s"] / fastest if fastest else None
        rows.append({"mode": name, "tok/s": s["tokens_per_s"], "speedup": s["speedup"],
                     "speedup 95%": "[{:.2f}, {:.2f}]".format(*s["speedup_ci95"]),
                     "vs fastest target": s["speedup_vs_fastest_target"],
                     "tau": s["tau"] if not name.startswith("target") else 1.0,
                     "tau 95%": None if name.startswith("target") or not s["tau_ci95"]
                     else "[{:.2f}, {:.2f}]".format(*s["tau_ci95"]),
                     "verified/round": s["mean_verified"],
                     "draft ms/round": 1e3 * s["draft_s_per_round"], "verify ms/round": 1e3 * s["verify_s_per_round"],
                     "vs first drafter": ratio_text(s.get("vs_first_drafter"))})
    print("\n" + metrics.markdown_table(rows, floatfmt=".2f"))
    spec = {k: v for k, v in summaries.items() if not k.startswith("target")}
    print("\nposition-wise conditional acceptance\n" + metrics.markdown_table(metrics.position_rows(spec)))
    report = {"benchmark": "decode_speed", "target": target.name, "device": args.device,
              "threads": torch.get_num_threads(), "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "temperature": args.temperature,
              "gamma": args.gamma[0] if args.gamma and len(args.gamma) == 1 else args.gamma,
              "scheduler": args.scheduler, "dtypes": dtypes, "through": "engine" if args.engine else "specdec",
              "sps": sps_points, "modes": summaries, "elapsed_s": round(time.perf_counter() - t0, 2)}
    print(json.dumps(report, default=float))
    return report


if __name__ == "__main__":
    main()
