"""Phases `evaluate` and `decode`: expected τ in one teacher-forced pass per held-out row, and real
speculative decoding (τ and batch-1 speed against target-only) for the drafters that exist."""
from __future__ import annotations

import json
import time
from pathlib import Path

from recipes.learning_curve.profiles import EVAL_DIR, REPO, CurveProfile, log
from recipes.learning_curve.shared import (
    ALGOS, capacity_drafters, committed_rows, ensure_cache, epoch_drafters, epoch_mode, load_target_of,
    owner_of, trained_drafters)


# ---------------------------------------------------------------- expected τ (teacher-forced estimate)
def cmd_evaluate(args, prof: CurveProfile) -> None:
    target = load_target_of(prof)
    estimate_folders(target, prof, Path(args.out), trained_drafters(Path(args.out)))


def held_out(target, prof: CurveProfile, out: Path):
    """(rows, cached target outputs, sampling) of the held-out set every expected τ is measured on."""
    from dspark.decoding.sampling import SamplingParams
    from dspark.models.target import TargetOutput

    rows = committed_rows(out / "rollouts-eval")
    rows = interleave(rows, "domain")[:prof.eval_rows or len(rows)]
    cache = ensure_cache(target, prof, rows, out / "features-eval", prof.eval_max_len)
    outs = [TargetOutput(features=f[None], final_hidden=h[None], logits=None, cache=None)
            for f, h in zip(cache.features, cache.final)]
    return rows, outs, SamplingParams(temperature=1.0, top_p=1.0, top_k=0)


def decode_setting(held: tuple, benchmarks: list[str] | None, answer_tokens: int | None) -> tuple:
    """The held-out set cut to what a decode run measures: only the rows of `benchmarks`, and each row cut to
    its first answer turn's first `answer_tokens` tokens (a decode with max_new_tokens N drafts only there;
    the cached target outputs are causal, so their prefix is the cut row's)."""
    from dspark.models.target import TargetOutput

    rows, outs, sp = held
    kept = [i for i, r in enumerate(rows) if not benchmarks or r["domain"] in benchmarks]
    if not kept:
        raise SystemExit(f"compare --benchmarks {benchmarks}: no held-out rows; they have "
                         f"{sorted({r['domain'] for r in rows})}")
    cut_rows, cut_outs = [], []
    for i in kept:
        row, out = rows[i], outs[i]
        n = len(row["input_ids"])
        if answer_tokens:  # the first answer turn only (what a decode run generates), at most N tokens of it
            mask = list(row["loss_mask"])
            start = mask.index(1) if 1 in mask else n
            end = next((j for j in range(start, n) if not mask[j]), n)
            n = min(end, start + answer_tokens)
        cut_rows.append({**row, "input_ids": list(row["input_ids"])[:n], "loss_mask": list(row["loss_mask"])[:n]})
        cut_outs.append(TargetOutput(features=out.features[:, :n], final_hidden=out.final_hidden[:, :n],
                                     logits=None, cache=None))
    return cut_rows, cut_outs, sp


def one_drafter_renewal_setting(args, prof: CurveProfile, phase: str) -> tuple:
    """(out, target, source folder, loaded drafter, held-out rows at the decode setting, p_cache, profile with
    every anchor) for a phase that sweeps one drafter with the renewal estimate (draft temperature, trees)."""
    from dspark.drafters import load_drafter

    if not args.drafters or len(args.drafters) != 1:
        raise SystemExit(f"{phase}: give --drafters DRAFTER (one saved drafter folder)")
    out, target, source = Path(args.out), load_target_of(prof), Path(args.drafters[0])
    held = held_out(target, prof, out)
    if args.benchmarks or args.answer_tokens:
        held = decode_setting(held, args.benchmarks, args.answer_tokens)
    prof = prof.model_copy(update={"anchor_stride": 1})  # the renewal estimate needs every anchor
    return out, target, source, load_drafter(str(source), target), held, {}, prof


def estimate_drafter(drafter_dir: Path, target, prof: CurveProfile, held: tuple, p_cache: dict,
                     gamma: int | None = None) -> dict:
    """Expected τ of one saved drafter on the held-out set (`held_out`), both estimators, at `gamma`
    drafts per round (default: the drafter's block size)."""
    from dspark.drafters import load_drafter

    t0 = time.perf_counter()
    result = estimate_loaded(load_drafter(str(drafter_dir), target), target, prof, held, p_cache, gamma, str(drafter_dir))
    result["wall_s"] = time.perf_counter() - t0
    return result


def estimate_loaded(drafter, target, prof: CurveProfile, held: tuple, p_cache: dict, gamma: int | None = None,
                    name: str = "the drafter", branching: tuple[int, ...] = ()) -> dict:
    """`estimate_drafter` for a drafter already loaded (e.g. one whose draft temperature is being swept);
    `branching`: rounds that verify a draft tree (dspark.eval.acceptance_estimate's module doc)."""
    from dspark.eval.acceptance_estimate import estimate

    rows, outs, sp = held
    t0 = time.perf_counter()
    gamma, stride = gamma or drafter.config.block_size, prof.anchor_stride
    most = min(drafter.config.block_size, drafter.config.train_steps)
    if gamma > most:
        raise SystemExit(f"--gamma {gamma}: {name} drafts (and is trained on) at most {most} per round")
    result = estimate(drafter, target, rows, gamma, sp, max_len=prof.eval_max_len, target_outs=outs,
                      anchor_stride=stride, p_cache=p_cache, branching=branching)
    result["gamma"], result["wall_s"], result["anchor_stride"] = gamma, time.perf_counter() - t0, stride
    return result


def estimate_folders(target, prof: CurveProfile, out: Path, folders: list[Path]) -> None:
    """Expected τ of each drafter folder on the held-out rollouts (estimate.json beside it; skipped if there)."""
    todo = [f for f in folders if not (f / "estimate.json").exists()]
    if not todo:
        return
    held, p_cache = held_out(target, prof, out), {}  # p_cache: the target's distributions, shared by every drafter
    for folder in todo:
        result = estimate_drafter(folder / "drafter", target, prof, held, p_cache)
        (folder / "estimate.json").write_text(json.dumps(result, indent=1))
        log(f"{folder.parent.name}/{folder.name}: expected τ {result['alpha']['expected_tau']} "
            f"{result['alpha']['expected_tau_ci95']} (alpha), {result['iw']['expected_tau']} (iw) "
            f"in {result['wall_s']:.0f} s")


def compare_file(args) -> str:
    """compare.json, or compare-g3-a64-gsm8k+mt-bench.json for a run at a decode's setting."""
    return setting_file("compare", args)


def setting_file(stem: str, args) -> str:
    """<stem>.json, or <stem>-g3-a64-gsm8k+mt-bench.json for a run at a decode's setting (--gamma,
    --answer-tokens, --benchmarks)."""
    parts = [f"g{args.gamma}" if args.gamma else "", f"a{args.answer_tokens}" if args.answer_tokens else "",
             "+".join(args.benchmarks or [])]
    return "-".join([stem, *filter(None, parts)]) + ".json"


def cmd_compare(args, prof: CurveProfile) -> dict:
    """Expected τ of saved drafters (--drafters PATH ...: any drafter folders, e.g. from other run folders)
    on this run's held-out rows, and each one's paired difference to the first (the same prompts resampled
    jointly: a far narrower interval than comparing two τ intervals); written to compare.json and drawn
    in compare.png (--labels: the names the figure and the JSON give the drafters).
    --gamma, --answer-tokens and --benchmarks estimate at a decode run's setting instead (its γ, its
    max_new_tokens, its benchmarks), the figure to hold a decoded τ against; with --answer-tokens every
    anchor of the cut answers is used (no `anchor_stride` subsample)."""
    from dspark.eval.acceptance_estimate import paired_difference
    from recipes.learning_curve.compare_plot import plot_compare

    if not args.drafters or len(args.drafters) < 2:
        raise SystemExit("compare: give --drafters BASELINE OTHER [...] (saved drafter folders)")
    if args.labels and len(args.labels) != len(args.drafters):
        raise SystemExit(f"compare: --labels names {len(args.labels)} drafters, --drafters gives {len(args.drafters)}")
    out, target = Path(args.out), load_target_of(prof)
    held, p_cache, results = held_out(target, prof, out), {}, {}
    if args.benchmarks or args.answer_tokens:
        held = decode_setting(held, args.benchmarks, args.answer_tokens)
    if args.answer_tokens:  # every anchor of the cut answers, as a decode drafts at each: cheap at this length
        prof = prof.model_copy(update={"anchor_stride": 1})
    for path in args.drafters:
        if not (Path(path) / "config.json").exists():
            raise SystemExit(f"compare: no saved drafter at {path}")
        results[path] = estimate_drafter(Path(path), target, prof, held, p_cache, gamma=args.gamma)
    base = args.drafters[0]
    domain_of = {r["prompt_id"]: r["domain"] for r in held[0]}
    report = {"held_out": str(out / "rollouts-eval"), "held_out_rows": len(held[0]), "baseline": base,
              "setting": {"gamma": {p: r["gamma"] for p, r in results.items()}, "answer_tokens": args.answer_tokens,
                          "benchmarks": args.benchmarks, "anchor_stride": results[base]["anchor_stride"]},
              "drafters": {
        path: {"label": drafter_label(Path(path)), "trained": training_summary(Path(path)),
               "expected_tau": r["alpha"]["expected_tau"], "expected_tau_ci95": r["alpha"]["expected_tau_ci95"],
               "expected_tau_per_benchmark": {g: v["expected_tau"] for g, v in r["alpha"]["per_group"].items()},
               "vs_baseline": None if path == base else
               paired_difference(r["alpha"]["per_prompt"], results[base]["alpha"]["per_prompt"]),
               "vs_baseline_per_benchmark": None if path == base else
               paired_by_group(r["alpha"]["per_prompt"], results[base]["alpha"]["per_prompt"], domain_of),
               **decoded_estimate(r, results[base], path == base)}
        for path, r in results.items()}}
    labels = args.labels or [r["label"] for r in report["drafters"].values()]
    for path, label in zip(args.drafters, labels):
        report["drafters"][path]["label"] = label
    (out / compare_file(args)).write_text(json.dumps(report, indent=1))
    plot_compare(report, labels, (out / compare_file(args)).with_suffix(".png"))
    for path, r in report["drafters"].items():
        d, dec = r["vs_baseline"], r.get("decoded_tau_estimate")
        log(f"compare {path}: expected τ {r['expected_tau']:.3f}"
            + ("" if d is None else f", {d['difference']:+.3f} {[round(x, 3) for x in d['ci95']]} vs the baseline")
            + ("" if dec is None else f"; decoding's τ (renewal) {dec:.3f} "
               f"{[round(x, 3) for x in r['decoded_tau_estimate_ci95']]}"))
    return report


def decoded_estimate(result: dict, base: dict, is_base: bool) -> dict:
    """The renewal estimate of decoding's τ (what decode_speed measures; present when every anchor was
    used) with its paired difference to the baseline's (None when the baseline has none: an Eagle3 drafter
    is estimated at every anchor even where a DSpark baseline was subsampled); {} without it."""
    from dspark.eval.acceptance_estimate import paired_difference

    if "renewal" not in result:
        return {}
    r = result["renewal"]
    return {"decoded_tau_estimate": r["decoded_tau"], "decoded_tau_estimate_ci95": r["decoded_tau_ci95"],
            "decoded_tau_estimate_per_benchmark": {g: v["decoded_tau"] for g, v in r["per_group"].items()},
            "decoded_vs_baseline": None if is_base or "renewal" not in base else
            paired_difference(r["per_prompt"], base["renewal"]["per_prompt"])}


def drafter_label(drafter: Path) -> str:
    """A name for a drafter folder that outlives this machine: its path in the repository (a committed
    drafter), else <run folder>/<series>/<name> of the training run that saved it, else the path."""
    path = drafter.resolve()
    if path.is_relative_to(REPO):
        return str(path.relative_to(REPO))
    owner = owner_of(path)
    return "/".join(owner.parts[-3:]) if owner is not None else str(path)


def training_summary(drafter: Path) -> dict | None:
    """What a drafter saved by a training run was trained on (its train.json), None for other folders."""
    owner = owner_of(drafter)
    record = owner / "dspark" / "train.json" if owner is not None else None
    if record is None or not record.exists():
        return None
    saved = json.loads(record.read_text())
    init = saved.get("init_from")
    return {**{k: saved.get(k) for k in ("rows", "rollout_tokens", "trained_tokens", "steps", "epochs", "lr",
                                         "wall_s", "draft_vocab_coverage")},
            "init_from": drafter_label(Path(init)) if init and Path(init).exists() else init}


def paired_by_group(a: dict, b: dict, group_of: dict) -> dict:
    """`paired_difference` of two per-prompt estimates within each group (benchmark) of `group_of`."""
    from dspark.eval.acceptance_estimate import paired_difference

    groups = sorted({group_of[k] for k in set(a) & set(b) if k in group_of})
    return {g: paired_difference({k: v for k, v in a.items() if group_of.get(k) == g},
                                 {k: v for k, v in b.items() if group_of.get(k) == g}) for g in groups}


def interleave(rows: list[dict], key: str) -> list[dict]:
    """Round-robin over the groups of `key` (each in its own order): a prefix is balanced across groups."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r[key], []).append(r)
    out, queues = [], [list(g) for _, g in sorted(groups.items())]
    while any(queues):
        for q in queues:
            if q:
                out.append(q.pop(0))
    return out


# ---------------------------------------------------------------- real decoding: τ and batch-1 speed
def decode_prompts(prof: CurveProfile) -> list[tuple[str, int, str]]:
    """(benchmark, index, first user turn): the first `decode_prompts` lines of each eval file."""
    from dspark.eval.benchmark_files import parse_benchmark

    picked = []
    for f in sorted((REPO / EVAL_DIR).glob("*.jsonl")):
        convs = parse_benchmark(f.read_text(), str(f))
        picked += [(f.stem, i, turns[0]) for i, turns in enumerate(convs[:prof.decode_prompts])]
    return picked


# Verify-length variants of the DSpark drafter decoded beside the fixed-γ baselines (same drafter): the
# γ that pays on a given machine depends on the verify cost (on 2 CPU cores a verify pass of 8 tokens
# costs ~1.5 target steps), and the confidence head can cut a block where survival drops.
DSPARK_VARIANTS = {"dspark_g3": {"mode": "fixed", "gamma": 3},
                   "dspark_thr": {"mode": "threshold", "threshold": 0.4, "threshold_on": "prefix"}}
DECODE_TEMPERATURES = (1.0, 0.0)


def decode_modes(out: Path) -> dict:
    """mode -> (drafter folder or None, SchedulerConfig kwargs): the largest point's drafters (if the run
    trained points), DSpark's variants, and each drafter of the epochs and capacity series
    (`dspark_<folder>`: fixed γ, γ = 3 and confidence threshold)."""
    modes = {"target": (None, {"mode": "off"})}
    largest = largest_point_folder(out)
    if largest is not None:
        modes |= {a: (largest / a / "drafter", {"mode": "fixed"}) for a in ALGOS if (largest / a / "drafter").exists()}
    if "dspark" in modes:
        modes |= {name: (largest / "dspark" / "drafter", sched) for name, sched in DSPARK_VARIANTS.items()}
    for folder in epoch_drafters(out) + capacity_drafters(out):
        name = epoch_mode(folder)
        modes |= {name: (folder / "drafter", {"mode": "fixed"}),
                  name + "_g3": (folder / "drafter", DSPARK_VARIANTS["dspark_g3"]),
                  name + "_thr": (folder / "drafter", DSPARK_VARIANTS["dspark_thr"])}
    return modes


def largest_point_folder(out: Path) -> Path | None:
    """points/<largest rollout tokens>, or None for a run that trained only beside the curve (capacity)."""
    points = sorted((out / "points").glob("*"))
    return points[-1] if points else None


def cmd_decode(args, prof: CurveProfile) -> None:
    """Batch-1 decoding through the engine (max_batch 1), at temperature 1 and 0, prompt-major: for each
    prompt every mode runs back to back, so load changes on a shared machine hit all modes alike.
    Results append to decode/results.jsonl; (prompt, mode, temperature) triples already there are skipped."""
    import torch

    from dspark.drafters import load_drafter
    from dspark.decoding.engine import Engine, EngineConfig
    from dspark.eval.evaluate import prompt_seed
    from dspark.decoding.sampling import SamplingParams
    from dspark.decoding.scheduler import SchedulerConfig

    out = Path(args.out)
    target = load_target_of(prof)
    engines, drafters = {}, {}
    wanted = decode_modes(out)
    if args.modes:  # --modes: a subset (target-only is always decoded: the speed reference)
        unknown = set(args.modes) - set(wanted)
        if unknown:
            raise SystemExit(f"--modes: unknown {sorted(unknown)}; known: {sorted(wanted)}")
        wanted = {m: v for m, v in wanted.items() if m in args.modes or m == "target"}
    for mode, (path, sched) in wanted.items():
        if path is not None and path not in drafters:
            drafters[path] = load_drafter(str(path), target)
        drafter = None if path is None else drafters[path]
        # seeded_sampling "stream": a seeded request draws from its own generator with the rejection rule,
        # whose acceptance is Σ min(p, q) — what the estimator predicts and what unseeded serving gets. The
        # engine's default ("keyed", batch-independent outputs) couples draft and target by Gumbel-max and
        # accepts only P(draft == target sample): far less for a weak drafter (up to the 2026-12-02 re-run,
        # every decode here measured that coupling).
        engines[mode] = Engine(target, drafter, EngineConfig(scheduler=SchedulerConfig(**sched), max_batch=1, seed=0,
                                                             seeded_sampling="stream"))
    dest = out / "decode" / "results.jsonl"
    dest.parent.mkdir(parents=True, exist_ok=True)
    done = {(r["benchmark"], r["index"], r["mode"], r.get("temperature", 1.0))
            for r in map(json.loads, dest.read_text().splitlines())} if dest.exists() else set()
    for bench, index, text in decode_prompts(prof):
        ids = target.chat_ids([{"role": "user", "content": text}])
        for temperature in DECODE_TEMPERATURES:
            sp = SamplingParams(temperature=temperature, top_p=1.0, top_k=0)
            for mode, engine in engines.items():
                if (bench, index, mode, temperature) in done:
                    continue
                t0 = time.perf_counter()
                req = engine.generate([ids], sp, prof.decode_max_new_tokens,
                                      seeds=[prompt_seed(0, bench, index)])[0]
                wall = time.perf_counter() - t0
                st = req.stats
                rec = {"benchmark": bench, "index": index, "mode": mode, "temperature": temperature,
                       "tokens": len(req.tokens), "wall_s": wall, "rounds": st.rounds, "accepted": st.accepted,
                       "proposed": st.proposed, "finish_reason": req.finish_reason, "error": req.error,
                       "coupling": "rejection"}
                with dest.open("a") as fh:
                    fh.write(json.dumps(rec) + "\n")
                log(f"decode {bench}[{index}] t={temperature:g} {mode}: {rec['tokens']} tokens in {wall:.1f} s"
                    + (f", τ {(st.accepted + st.rounds) / max(st.rounds, 1):.2f}" if mode != "target" else ""))
    del torch
