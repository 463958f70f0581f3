"""Phase `draft-trees`: what verifying a tree of drafts per round, instead of one chain, would buy decoding.

A tree "2x2" gives the anchor 2 distinct children drawn from q_1 and each of them 2 from q_2 given its
path, then one chain below (DSpark's Markov head runs once per leaf over the one backbone pass); the
target scores every node in one forward and acceptance walks down the tree by recursive rejection
sampling, lossless like one chain (dspark.eval.acceptance_estimate's module doc). Decoding's first
position is where a round loses most (acceptance ≈ 0.45 there for the committed CPU drafter), and a
batch-1 CPU target verifies a few more tokens for little. This phase measures both halves on this
machine and multiplies them (the serving engine decodes trees with `draft_tree`; `benchmarks/decode_speed.py
--engine --tree 2` measures them there):

- τ: the renewal estimate of decoding's τ for each tree on the held-out rows (every anchor; at a decode
  run's setting with --gamma/--answer-tokens/--benchmarks), each paired with one chain on the same prompts;
- cost, medians over interleaved repetitions at 256 positions of context, target and drafter on this CPU in
  the profile's dtype resolved there (auto, as serving: bfloat16 where bf16 is native, else float32)
  on 2 threads (a profile's cost_threads; as `benchmarks/decode_speed.py --dtypes bfloat16 --threads 2` runs them
  on a CPU with avx512_bf16/AMX): one target step
  (1 token), the verify forward of the tree's 1 + Σ_k Π_{j≤k} n_j tokens, and drafting the tree (one
  backbone pass and `sample_tree`, as `tree_speculative_generate` drafts);
- projected batch-1 speedup over target-only = τ · target step / (drafting + verify). It leaves out the
  engine's per-round bookkeeping, so read the one-chain row against a measured decode (1.22–1.31× for the
  committed drafter at γ 3) and the trees relative to it.

    python -m recipes.learning_curve draft-trees --drafters DRAFTER [--trees 2 3 4 2x2 3x2]
        [--gamma 3 --answer-tokens 64 --benchmarks gsm8k humaneval mt-bench]
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from recipes.learning_curve.profiles import CurveProfile, log

DEFAULT_TREES = ("2", "3", "4", "2x2", "3x2")
COST_CONTEXT, COST_WARMUP = 256, 3  # a profile may set cost_reps (default 30) and cost_threads (default 2)


def parse_tree(text: str) -> tuple[int, ...]:
    """'3x2' -> (3, 2): children per node at depths 1, 2 (one below); '1' = one chain."""
    from dspark.decoding.tree_specdec import parse_branching

    try:
        counts = parse_branching(text)
    except ValueError as err:
        raise SystemExit(f"draft-trees: {err}") from None
    while len(counts) > 1 and counts[-1] == 1:
        counts = counts[:-1]
    return counts


def tree_nodes(branching: tuple[int, ...], gamma: int) -> tuple[int, int]:
    """(verify tokens = 1 + Σ_k Π_{j≤k} n_j over k = 1..γ, leaves = Π n_j) of a tree."""
    width, nodes = 1, 0
    for k in range(gamma):
        width *= branching[k] if k < len(branching) else 1
        nodes += width
    return 1 + nodes, width


def cmd_draft_trees(args, prof: CurveProfile) -> dict:
    from recipes.learning_curve.measure import (drafter_label, estimate_loaded, one_drafter_renewal_setting,
                                                setting_file)

    trees = {"1": (1,)}
    for text in args.trees or DEFAULT_TREES:
        trees.setdefault("x".join(map(str, parse_tree(text))), parse_tree(text))
    out, target, source, drafter, held, p_cache, prof = one_drafter_renewal_setting(args, prof, "draft-trees")
    gamma = args.gamma or drafter.config.block_size
    for name, branching in trees.items():
        if len(branching) > gamma:
            raise SystemExit(f"draft-trees: tree {name} is deeper than γ = {gamma}")
    results = {}
    for name, branching in trees.items():
        results[name] = estimate_loaded(drafter, target, prof, held, p_cache, gamma, branching=branching)
        log(f"tree {name}: decoding's τ (renewal) {results[name]['renewal']['decoded_tau']:.3f}, "
            f"per-anchor τ {results[name]['alpha']['expected_tau']:.3f}")
    cost = measure_costs(prof, source, trees, gamma)
    rows = {name: tree_row(results[name], results["1"], name == "1", name, tree_nodes(b, gamma), cost)
            for name, b in trees.items()}
    report = {"drafter": drafter_label(source), "held_out_rows": len(held[0]),
              "setting": {"gamma": gamma, "answer_tokens": args.answer_tokens, "benchmarks": args.benchmarks,
                          "anchor_stride": 1},
              "cost": cost, "trees": rows,
              "best_projected": max(rows, key=lambda name: rows[name]["projected_speedup_vs_target"])}
    path = out / setting_file("draft-trees", args)
    path.write_text(json.dumps(report, indent=1))
    for name, r in rows.items():
        gain = r["decoded_tau_estimate"] - rows["1"]["decoded_tau_estimate"]
        log(f"tree {name}: τ {r['decoded_tau_estimate']:.3f} ({gain:+.3f}); verify {r['verify_tokens']} tokens "
            f"{r['verify_ms']:.1f} ms, drafting {r['draft_ms']:.1f} ms -> projected "
            f"{r['projected_speedup_vs_target']:.2f}x over target-only")
    log(f"-> {path}")
    return report


def tree_row(result: dict, chain: dict, is_chain: bool, name: str, shape: tuple[int, int], cost: dict) -> dict:
    """One tree: decoding's τ (renewal) with its paired difference to one chain, and the projection."""
    from recipes.learning_curve.measure import decoded_estimate

    est = decoded_estimate(result, chain, is_chain)
    vs_chain = est.pop("decoded_vs_baseline")
    tokens, leaves = shape
    verify_ms, draft_ms = cost["verify_ms"][str(tokens)], cost["draft_ms"][name]
    tau = est["decoded_tau_estimate"]
    return {**est, "expected_tau": result["alpha"]["expected_tau"], "vs_one_chain": vs_chain,
            "verify_tokens": tokens, "leaves": leaves, "verify_ms": verify_ms, "draft_ms": draft_ms,
            "projected_speedup_vs_target": tau * cost["target_step_ms"] / (draft_ms + verify_ms)}


def measure_costs(prof: CurveProfile, source: Path, trees: dict[str, tuple[int, ...]], gamma: int) -> dict:
    """Medians (ms) of one target step, the verify forward of each tree's size and drafting each tree (one
    backbone pass + `sample_tree`: `draft_tree`, what `tree_speculative_generate` runs), each measured once in every
    repetition (the module doc); the target cache is cropped back after each forward."""
    import torch

    from dspark.decoding.sampling import SamplingParams
    from dspark.drafters import load_drafter
    from dspark.models.precision import resolve_dtype
    from dspark.models.target import load_target

    threads, reps = torch.get_num_threads(), prof.cost_reps
    torch.set_num_threads(prof.cost_threads)
    try:
        # the profile's dtype resolved on this CPU, where the costs are measured (auto: what serving runs here)
        dtype = getattr(torch, resolve_dtype(prof.dtype, "cpu"))
        target = load_target(prof.target, dtype=dtype)
        drafter = load_drafter(str(source), target).to(dtype).eval()
        sizes = sorted({tree_nodes(b, gamma)[0] for b in trees.values()})
        ids = torch.randint(0, target.vocab_size, (COST_CONTEXT + max(sizes),), generator=torch.Generator().manual_seed(0))
        context = ids[:COST_CONTEXT]
        with torch.no_grad():
            prefill = target.forward(context[None], cache=target.new_cache(), use_cache=True,
                                     layer_ids=drafter.layer_ids, logits_at="last")
            cache, state = prefill.cache, drafter.new_state()
            drafter.extend_context(state, prefill.features[0], context)
        anchor, gen, sp = int(context[-1]), torch.Generator().manual_seed(1), SamplingParams(temperature=1.0)

        def verify(tokens: int):  # the cost of a forward does not depend on the tree mask's shape
            target.forward(ids[COST_CONTEXT - 1: COST_CONTEXT - 1 + tokens][None], cache=cache, use_cache=True,
                           logits_at="all")
            target.crop_cache(cache, COST_CONTEXT)

        timed = {"target_step": lambda: verify(1)}
        timed.update({f"verify{t}": (lambda t=t: verify(t)) for t in sizes})
        timed.update({f"draft:{name}": (lambda b=b: drafter.draft_tree(state, anchor, gamma, b, sp, gen))
                      for name, b in trees.items()})
        times = {name: [] for name in timed}
        with torch.no_grad():
            for rep in range(COST_WARMUP + reps):
                for name, fn in timed.items():  # side by side: every quantity once per repetition
                    start = time.perf_counter()
                    fn()
                    if rep >= COST_WARMUP:
                        times[name].append(time.perf_counter() - start)
        ms = {name: 1000 * statistics.median(v) for name, v in times.items()}
        used = torch.get_num_threads()
    finally:
        torch.set_num_threads(threads)
    return {"context": COST_CONTEXT, "reps": reps, "threads": used, "dtype": str(dtype).removeprefix("torch."),
            "target_step_ms": ms["target_step"], "verify_ms": {str(t): ms[f"verify{t}"] for t in sizes},
            "draft_ms": {name: ms[f"draft:{name}"] for name in trees}}
