"""Phases `train`, `baselines`, `epochs`, `capacity`: one drafter per training point (nested prefixes of
the rollouts) or setting, each skipped when already saved; `sweep`: training throughput per setting."""
from __future__ import annotations

import functools
import json
import time
from pathlib import Path

from recipes.learning_curve.profiles import CurveProfile, log
from recipes.learning_curve.shared import (
    ALGOS, capacity_drafters, epoch_drafters, load_target_of, owner_of, point_sizes, train_cache, wanted_sizes)
from recipes.learning_curve.measure import estimate_folders


# ---------------------------------------------------------------- training (resumable per point)
def drafter_config(prof: CurveProfile, algo: str):
    from dspark.drafters import DrafterConfig

    cfg = {**prof.drafter, **ALGOS[algo]}
    if ALGOS[algo]["algo"] != "dspark":
        cfg.pop("head", None), cfg.pop("rank", None), cfg.pop("confidence_head", None)
    if ALGOS[algo]["algo"] == "eagle3":
        cfg.pop("num_layers", None)
        cfg["ttt_steps"] = cfg["block_size"]
    return DrafterConfig(**cfg)


def draft_vocab_of(cache, n_rows: int, vocab: int, size: int | None, kept=None):
    """The draft vocabulary of the first n_rows cached rows, as jobs.train plans it (DraftVocabPlan.of_rows).
    kept: the draft ids of a drafter being continued (kept, with their coverage of these rows)."""
    from dspark.drafters.draft_vocab import DraftVocabPlan

    return DraftVocabPlan.of_rows(zip(cache.input_ids[:n_rows], cache.loss_mask[:n_rows]), size, vocab, kept=kept)


def train_one(target, prof: CurveProfile, cache, n_rows: int, algo: str, folder: Path, init: Path | None = None,
              minutes: float | None = None) -> dict:
    """Train one drafter on the first n_rows cached rows (`epochs` passes, or with `minutes` a wall-clock
    budget: the cosine schedule is first sized from a probed step time, re-sized from the measured mean
    step time after 5 %, 25 % and 50 % of it, and no step starts past the budget); skip if already saved.
    `init`: a saved drafter (its folder holds config.json) of the same config to start from instead of a
    fresh initialisation; its draft vocabulary is kept."""
    import torch

    from dspark.drafters import build_drafter, save_drafter
    from dspark.training.config import OptimSection
    from dspark.training.budget import StepBudget, run_steps
    from dspark.training.feature_cache import cached_step
    from dspark.training.loop import LocalTrainer, flops_rates

    done = folder / "train.json"
    cfg = drafter_config(prof, algo)
    if done.exists() and (folder / "drafter" / "config.json").exists():
        saved = json.loads(done.read_text())
        check_same_settings(saved, cfg, prof, minutes, folder)
        log(f"{folder}: trained already, skipping")
        return saved
    kept = None
    if init is not None:
        from dspark.drafters.checkpoint import saved_draft_ids

        kept = saved_draft_ids(str(init))
    refresh = prof.refresh_vocab and kept is not None  # recount the vocabulary on these rows
    plan = draft_vocab_of(cache, n_rows, int(target.vocab_size), cfg.draft_vocab_size, None if refresh else kept)
    ids, cov = plan.ids(), plan.coverage
    torch.manual_seed(prof.seed)
    drafter = build_drafter(cfg, target, draft_ids=kept if refresh else ids)
    if init is not None:  # continue a saved drafter (same config and draft vocabulary) with a new schedule
        from dspark.training.session import load_initial_weights

        load_initial_weights(drafter, str(init), target)
    shared = None
    if refresh:  # then move it to this data's vocabulary (shared tokens keep their rows, new ones start at 0)
        shared = len(set(kept.tolist()) & set(ids.tolist()))
        drafter.change_draft_vocab(ids)
        log(f"{folder.parent.name}: draft vocabulary recounted on these rows: {shared} of {len(ids)} tokens kept")
    optim = OptimSection(lr=prof.lr, warmup_ratio=0.04, schedule="cosine", grad_clip=1.0)
    precision = prof.precision
    trainer = LocalTrainer(algo, target, drafter, optim, precision=precision)
    batch = min(prof.batch_size, n_rows)
    batches = cached_batches(cache, n_rows, batch, prof, target)
    probe_s = None
    if minutes:  # the first plan comes from a probe (weights untouched); StepBudget re-sizes it from real steps
        probe_s = probe_step(trainer, cache, n_rows, batch, target)["step_s"]
    budget = StepBudget(int(minutes * 60 / probe_s) if minutes else n_rows // batch * prof.epochs,
                        minutes * 60 if minutes else None)
    trainer.set_schedule(budget.total)
    plan = f"{minutes:g} min at {probe_s:.2f} s/step (probed)" if minutes else f"{prof.epochs} epochs"
    log(f"{folder.parent.name}/{algo}: {n_rows} rows, {budget.total} steps of {batch} ({plan}), "
        f"{cfg.num_layers} layers, {cfg.anchors_per_seq} anchors/seq, draft vocab {cfg.draft_vocab_size} "
        f"(coverage {cov if cov is None else round(cov, 4)})")

    def log_point(p: dict) -> None:
        log(f"  {algo} step {p['step']}/{p['planned_steps']} loss {p['loss']:.3f} acc {p.get('token_acc', 0):.3f} "
            f"{p['tokens_per_s']:.0f} tok/s, {p['seconds']:.0f} s")

    rep = run_steps(trainer, budget, batches, lambda b, seed: cached_step(trainer, b, seed=seed), prof.seed,
                    prof.log_every, log_point)
    tokens, flops, curve = rep.tokens, rep.flops, rep.curve
    steps, planned, stopped_by = rep.steps, rep.planned_steps, rep.stopped_by
    wall = budget.elapsed()
    save_drafter(drafter, str(folder / "drafter"))
    peak = matmul_peak(str(target.device), precision)
    rates = flops_rates(flops, wall, target.device, precision, peak=peak)
    result = {"algo": algo, "rows": n_rows, "rollout_tokens": int(sum(m for m in cache.generated_tokens()[:n_rows])),
              "trained_tokens": tokens, "steps": steps, "epochs": steps * batch / n_rows if minutes else prof.epochs,
              "batch_size": batch, "lr": prof.lr, "budget_minutes": minutes, "probe_step_s": probe_s,
              "planned_steps": planned, "stopped_by": stopped_by,
              "threads": torch.get_num_threads(),
              "init_from": init_label(init, folder),
              "num_layers": cfg.num_layers, "anchors_per_seq": cfg.anchors_per_seq,
              "draft_vocab_size": cfg.draft_vocab_size, "draft_vocab_coverage": cov, "wall_s": wall,
              **({"draft_vocab_recounted": {"kept_tokens": shared}} if refresh else {}),
              "cpu_minutes": wall / 60 * torch.get_num_threads(), "tokens_per_s": tokens / wall,
              "drafter_tflops_per_s": rates["model_tflops_per_s"], "mfu": rates["mfu"],
              "precision": precision, "mfu_peak_tflops": peak / 1e12,
              "mfu_basis": f"measured {precision} 1024^3 matmul, same threads",
              "final_metrics": rep.final_metrics,
              "curve": curve, "drafter_config": cfg.model_dump()}
    done.write_text(json.dumps(result, indent=1))
    return result


def check_same_settings(saved: dict, cfg, prof: CurveProfile, minutes: float | None, folder: Path) -> None:
    """A resumed phase must not count a drafter trained with other settings as done (e.g. `train --layers 1`
    in a folder whose points were trained with 2 layers): stop and name the difference."""
    wanted = {"num_layers": cfg.num_layers, "anchors_per_seq": cfg.anchors_per_seq, "lr": prof.lr,
              **({} if minutes else {"epochs": prof.epochs})}
    differ = {k: (saved.get(k), v) for k, v in wanted.items() if k in saved and saved[k] != v}
    if differ:
        detail = ", ".join(f"{k} {old} (saved) vs {new} (asked)" for k, (old, new) in differ.items())
        raise SystemExit(f"{folder} was trained with other settings: {detail}; use another --out folder")


@functools.lru_cache(maxsize=None)
def matmul_peak(device: str, precision: str = "fp32") -> float:
    """This machine's measured matmul FLOPs/s in `precision` (the MFU basis), once per process and device."""
    from dspark.training.loop import measured_matmul_peak
    from dspark.training.step import precision_dtype

    return measured_matmul_peak(device, dtype=precision_dtype(precision))


def cached_batches(cache, n_rows: int, batch: int, prof: CurveProfile, target):
    """Endless collated batches of the first n_rows cached rows: a new shuffle per epoch, length-bucketed."""
    import random

    from dspark.training.batching import bucketed_batches
    from dspark.training.feature_cache import collate_cached

    lengths = [min(len(x), prof.max_len) for x in cache.input_ids[:n_rows]]
    epoch = 0
    while True:
        order = list(range(n_rows))
        random.Random(prof.seed * 7919 + epoch).shuffle(order)
        for rows in bucketed_batches(order, lengths, batch, window=8, seed=prof.seed + epoch):
            yield collate_cached(cache, rows, target.pad_token_id, target.device)
        epoch += 1


def probe_step(trainer, cache, n_rows: int, batch: int, target, seed: int = 0) -> dict[str, float]:
    """One cached step (update=False) timed on a short, a median and a long batch after a warm-up (one
    random batch would mis-size a budgeted run by the spread of row lengths): mean seconds per step
    (`step_s`) and mean tokens, FLOPs, anchors and supervised positions per step."""
    from dspark.training.feature_cache import cached_step, collate_cached

    order = sorted(range(n_rows), key=lambda i: len(cache.input_ids[i]))
    picks = [order[s:s + batch] for s in sorted({0, max(0, n_rows // 2 - batch // 2), max(0, n_rows - batch)})]
    batches = [collate_cached(cache, rows, target.pad_token_id, target.device) for rows in picks]
    cached_step(trainer, batches[0], seed, update=False)
    sums: dict[str, float] = {}
    start = time.perf_counter()
    for i, b in enumerate(batches):
        m = cached_step(trainer, b, seed + i + 1, update=False)
        for k in ("tokens", "flops", "n_anchors", "n_supervised"):
            sums[k] = sums.get(k, 0.0) + m.get(k, 0.0)
    elapsed = time.perf_counter() - start
    return {"step_s": elapsed / len(batches), **{k: v / len(batches) for k, v in sums.items()}}


def cmd_train(args, prof: CurveProfile) -> None:
    out = Path(args.out)
    target = load_target_of(prof)
    rows, cache = train_cache(target, prof, out)
    sizes = point_sizes(rows, wanted_sizes(rows, prof))
    log(f"points (rollout tokens, rows): {sizes}")
    for tokens, n in sizes:
        train_one(target, prof, cache, n, "dspark", out / "points" / f"{tokens:09d}" / "dspark")


def largest_point(args, prof: CurveProfile):
    """(output folder, target, feature cache, rollout tokens, rows) of the largest point: what every phase
    that trains beside the curve (baselines, epochs, capacity, sweep) works on."""
    out = Path(args.out)
    target = load_target_of(prof)
    rows, cache = train_cache(target, prof, out)
    tokens, n = point_sizes(rows, wanted_sizes(rows, prof))[-1]
    return out, target, cache, tokens, n


def cmd_baselines(args, prof: CurveProfile) -> None:
    out, target, cache, tokens, n = largest_point(args, prof)
    for algo in ("dflash_tv", "dflash", "eagle3"):
        train_one(target, prof, cache, n, algo, out / "points" / f"{tokens:09d}" / algo)


def resolve_init(out: Path, init_from: str) -> Path:
    """The saved drafter folder --init-from names: a path holding config.json, or a folder of this run
    (e05 = epochs/e05, capacity/<name>) whose dspark/drafter it is."""
    given = Path(init_from)
    init = given if (given / "config.json").exists() else (
        out / (init_from if "/" in init_from else f"epochs/{init_from}") / "dspark" / "drafter")
    if not (init / "config.json").exists():
        raise SystemExit(f"--init-from {init_from}: no saved drafter at {given} or {init}")
    return init


def init_label(init: Path | None, folder: Path) -> str | None:
    """How train.json names the drafter a run continued: "<series>/<name>" inside this run folder (as
    --init-from takes it), else its absolute path."""
    if init is None:
        return None
    owner = owner_of(init)
    if owner is not None and owner.parent.parent == folder.parents[2].resolve():
        return f"{owner.parent.name}/{owner.name}"
    return str(init.resolve())


def epochs_folder_name(epochs: int, prof: CurveProfile, args) -> str:
    """e<N>, + -L<layers>-a<anchors> when --layers/--anchors changed the drafter, + -lr<lr> when --lr changed
    the profile's learning rate, + -from-<folder> when the run continues an earlier drafter (each a separate
    drafter; a capacity/<name> source is written capacity-<name>), + -vocab when it moves to a recounted
    draft vocabulary (--refresh-vocab)."""
    shape = f"-L{prof.drafter['num_layers']}-a{prof.drafter['anchors_per_seq']}" if (args.layers or args.anchors) else ""
    name = f"e{epochs:02d}{shape}" + (f"-lr{prof.lr:g}" if args.lr else "") + precision_suffix(prof)
    name += f"-from-{init_name(args.init_from)}" if args.init_from else ""
    return name + ("-vocab" if prof.refresh_vocab else "")


def init_name(init_from: str) -> str:
    """A folder-name part for --init-from: capacity/L1-a32-m60 -> capacity-L1-a32-m60; a drafter path
    .../<name>/dspark/drafter -> <name>; any other drafter path -> its last folder's name."""
    path = Path(init_from)
    if not (path / "config.json").exists():
        return init_from.replace("/", "-")
    return (owner_of(path) or path.resolve()).name


def cmd_epochs(args, prof: CurveProfile) -> None:
    """DSpark at the largest point trained for each of `--epochs` passes over the same rows (each its own
    cosine schedule, from scratch or, with --init-from, from a saved drafter: an epochs folder name such as
    e05, or capacity/<name>; --layers/--anchors (one value each) set its shape), into
    epochs/<epochs_folder_name>/dspark, then its expected τ: what more passes over the same data buy,
    beside what more data buys (the points)."""
    out, target, cache, _, n = largest_point(args, prof)
    prof = one_setting(args, prof, "epochs").model_copy(update={"refresh_vocab": args.refresh_vocab})
    init = resolve_init(out, args.init_from) if args.init_from else None
    for epochs in args.epochs or []:
        train_one(target, prof.model_copy(update={"epochs": epochs}), cache, n, "dspark",
                  out / "epochs" / epochs_folder_name(epochs, prof, args) / "dspark", init)
    estimate_folders(target, prof, out, epoch_drafters(out))


def precision_suffix(prof: CurveProfile) -> str:
    """'' for the default fp32 training, '-bf16' otherwise (a folder name says what it holds)."""
    return "" if prof.precision == "fp32" else f"-{prof.precision}"


def capacity_folder(out: Path, layers: int, anchors: int, minutes: float, prof: CurveProfile) -> Path:
    return out / "capacity" / f"L{layers}-a{anchors}-m{minutes:g}{precision_suffix(prof)}" / "dspark"


def setting_grid(args, prof: CurveProfile):
    """(layers, anchors, the profile with them) for every --layers x --anchors pair (default: the profile's)."""
    for layers in args.layers or [prof.drafter["num_layers"]]:
        for anchors in args.anchors or [prof.drafter["anchors_per_seq"]]:
            yield layers, anchors, prof.model_copy(update={"drafter": {**prof.drafter, "num_layers": layers,
                                                                       "anchors_per_seq": anchors}})


def one_setting(args, prof: CurveProfile, phase: str) -> CurveProfile:
    """The profile with the one --layers / --anchors value given (phases that train a single shape)."""
    if not (args.layers or args.anchors):
        return prof
    (_, _, setting), *more = list(setting_grid(args, prof))
    if more:
        raise SystemExit(f"{phase}: give one --layers and one --anchors value")
    return setting


def cmd_capacity(args, prof: CurveProfile) -> None:
    """DSpark at the largest point, one drafter per (--layers, --anchors) setting, each trained from scratch
    for the same wall-clock budget (--minutes, schedule sized from the probed step time), into
    capacity/L<layers>-a<anchors>-m<minutes>/dspark, then its expected τ: what capacity and anchor density
    buy per CPU-minute."""
    if not args.minutes:
        raise SystemExit("capacity: --minutes is required (the equal wall-clock budget of every setting)")
    out, target, cache, _, n = largest_point(args, prof)
    for layers, anchors, setting in setting_grid(args, prof):
        train_one(target, setting, cache, n, "dspark", capacity_folder(out, layers, anchors, args.minutes, prof),
                  minutes=args.minutes)
    estimate_folders(target, prof, out, capacity_drafters(out))


def cmd_sweep(args, prof: CurveProfile) -> None:
    """Training throughput of DSpark on the cached features per (--layers, --anchors): tokens/s, anchor
    blocks/s, drafter TFLOP/s and MFU against this machine's measured matmul peak, each from the same
    three probe batches (short, median, long rows); written to sweep.json (sweep-bf16.json with --precision
    bf16; the report copies both)."""
    import torch

    from dspark.drafters import build_drafter
    from dspark.training.config import OptimSection
    from dspark.training.loop import LocalTrainer, flops_rates, param_count

    out, target, cache, _, n = largest_point(args, prof)
    batch = min(prof.batch_size, n)
    precision = prof.precision
    peak = matmul_peak(str(target.device), precision)
    settings_done = []
    for layers, anchors, setting in setting_grid(args, prof):
        cfg = drafter_config(setting, "dspark")
        ids = draft_vocab_of(cache, n, int(target.vocab_size), cfg.draft_vocab_size).ids()
        torch.manual_seed(prof.seed)
        drafter = build_drafter(cfg, target, draft_ids=ids)
        trainer = LocalTrainer("dspark", target, drafter, OptimSection(lr=prof.lr), precision=precision)
        m = probe_step(trainer, cache, n, batch, target)
        rates = flops_rates(m["flops"], m["step_s"], target.device, precision, peak=peak)
        entry = {"num_layers": layers, "anchors_per_seq": anchors, "batch_size": batch, "precision": precision,
                 "trainable_params": param_count(drafter, trainable_only=True),
                 "step_s": m["step_s"], "tokens_per_s": m["tokens"] / m["step_s"],
                 "anchor_blocks_per_s": m["n_anchors"] / m["step_s"],
                 "supervised_per_s": m["n_supervised"] / m["step_s"],
                 "anchors_per_step": m["n_anchors"], "drafter_tflops_per_s": rates["model_tflops_per_s"],
                 "mfu": rates["mfu"]}
        settings_done.append(entry)
        log(f"sweep L{layers} a{anchors}: {entry['tokens_per_s']:.0f} tok/s, "
            f"{entry['anchor_blocks_per_s']:.0f} anchor blocks/s, MFU {entry['mfu']:.3f}")
    result = {"device": prof.device_label, "threads": torch.get_num_threads(), "rows": n,
              "mfu_peak_tflops": peak / 1e12, "mfu_basis": f"measured {precision} 1024^3 matmul, same threads",
              "method": "mean of 3 timed cached steps (short, median, long batch) after a warm-up, no update",
              "settings": settings_done}
    (out / f"sweep{precision_suffix(prof)}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
