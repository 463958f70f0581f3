"""Phases `train`, `baselines`, `epochs`: one drafter per training point (nested prefixes of the
rollouts), each skipped when already saved."""
from __future__ import annotations

import json
import time
from pathlib import Path

from recipes.learning_curve.profiles import log
from recipes.learning_curve.shared import (
    ALGOS, epoch_drafters, load_target_of, point_sizes, train_cache, wanted_sizes)
from recipes.learning_curve.measure import estimate_folders


# ---------------------------------------------------------------- training (resumable per point)
def drafter_config(prof: dict, algo: str):
    from dspark.drafters import DrafterConfig

    cfg = {**prof["drafter"], **ALGOS[algo]}
    if ALGOS[algo]["algo"] != "dspark":
        cfg.pop("head", None), cfg.pop("rank", None), cfg.pop("confidence_head", None)
    if ALGOS[algo]["algo"] == "eagle3":
        cfg.pop("num_layers", None)
        cfg["ttt_steps"] = cfg["block_size"]
    return DrafterConfig(**cfg)


def draft_ids_of(cache, n_rows: int, vocab: int, size: int | None):
    from dspark.drafters.draft_vocab import count_token_frequencies, coverage, top_token_ids

    if not size:
        return None, None
    counts = count_token_frequencies(zip(cache.input_ids[:n_rows], cache.loss_mask[:n_rows]), vocab, "cache")
    ids = top_token_ids(counts, size, vocab)
    return ids, coverage(counts, ids)


def train_one(target, prof: dict, cache, n_rows: int, algo: str, folder: Path, init: Path | None = None) -> dict:
    """Train one drafter on the first n_rows cached rows (`epochs` passes); skip if already saved.
    `init`: a drafter folder of the same config to start from instead of a fresh initialisation."""
    import random

    import numpy as np
    import torch

    from dspark.drafters import build_drafter, save_drafter
    from dspark.training.batching import bucketed_batches
    from dspark.training.config import OptimSection
    from dspark.training.feature_cache import cached_step, collate_cached
    from dspark.training.loop import LocalTrainer, flops_rates

    done = folder / "train.json"
    if done.exists() and (folder / "drafter" / "config.json").exists():
        log(f"{folder}: trained already, skipping")
        return json.loads(done.read_text())
    cfg = drafter_config(prof, algo)
    ids, cov = draft_ids_of(cache, n_rows, int(target.vocab_size), cfg.draft_vocab_size)
    torch.manual_seed(prof["seed"])
    drafter = build_drafter(cfg, target, draft_ids=ids)
    if init is not None:  # continue a saved drafter (same config and draft vocabulary) with a new schedule
        from dspark.training.session import load_initial_weights

        load_initial_weights(drafter, str(init / "drafter"), target)
    optim = OptimSection(lr=prof["lr"], warmup_ratio=0.04, schedule="cosine", grad_clip=1.0)
    trainer = LocalTrainer(algo, target, drafter, optim, precision="fp32")
    batch = min(prof["batch_size"], n_rows)
    per_epoch = n_rows // batch
    steps = per_epoch * prof["epochs"]
    trainer.set_schedule(steps)
    lengths = [min(len(x), prof["max_len"]) for x in cache.input_ids[:n_rows]]
    log(f"{folder.parent.name}/{algo}: {n_rows} rows, {steps} steps of {batch} ({prof['epochs']} epochs), draft vocab "
        f"{cfg.draft_vocab_size} (coverage {cov if cov is None else round(cov, 4)})")
    t0, tokens, flops, step, curve, last = time.perf_counter(), 0.0, 0.0, 0, [], []
    for epoch in range(prof["epochs"]):
        order = list(range(n_rows))
        random.Random(prof["seed"] * 7919 + epoch).shuffle(order)
        for rows in bucketed_batches(order, lengths, batch, window=8, seed=prof["seed"] + epoch):
            b = collate_cached(cache, rows, target.pad_token_id, target.device)
            m = cached_step(trainer, b, seed=prof["seed"] * 1_000_003 + step)
            step += 1
            tokens, flops = tokens + m["tokens"], flops + m["flops"]
            last = (last + [m])[-20:]
            if step % prof["log_every"] == 0 or step == steps:
                dt = time.perf_counter() - t0
                row = {"step": step, "loss": m["loss"], "tokens_per_s": tokens / dt,
                       **{k: float(np.mean([x[k] for x in last if k in x])) for k in ("loss", "token_acc") if k in m}}
                curve.append(row)
                log(f"  {algo} step {step}/{steps} loss {row['loss']:.3f} acc {row.get('token_acc', 0):.3f} "
                    f"{row['tokens_per_s']:.0f} tok/s, {dt:.0f} s")
    wall = time.perf_counter() - t0
    save_drafter(drafter, str(folder / "drafter"))
    rates = flops_rates(flops, wall, target.device, "fp32")
    result = {"algo": algo, "rows": n_rows, "rollout_tokens": int(sum(m for m in cache.generated_tokens()[:n_rows])),
              "trained_tokens": tokens, "steps": steps, "epochs": prof["epochs"], "batch_size": batch, "lr": prof["lr"],
              "init_from": None if init is None else f"{init.parent.parent.name}/{init.parent.name}",
              "anchors_per_seq": cfg.anchors_per_seq, "draft_vocab_size": cfg.draft_vocab_size,
              "draft_vocab_coverage": cov, "wall_s": wall, "cpu_minutes": wall / 60 * prof["threads"],
              "tokens_per_s": tokens / wall, "drafter_tflops_per_s": rates["model_tflops_per_s"],
              "mfu": rates["mfu"], "final_metrics": {k: float(np.mean([x[k] for x in last]))
                                                     for k in last[-1] if isinstance(last[-1][k], float)},
              "curve": curve, "drafter_config": cfg.model_dump()}
    done.write_text(json.dumps(result, indent=1))
    return result


def cmd_train(args, prof: dict) -> None:
    out = Path(args.out)
    target = load_target_of(prof)
    rows, cache = train_cache(target, prof, out)
    sizes = point_sizes(rows, wanted_sizes(rows, prof))
    log(f"points (rollout tokens, rows): {sizes}")
    for tokens, n in sizes:
        train_one(target, prof, cache, n, "dspark", out / "points" / f"{tokens:09d}" / "dspark")


def cmd_baselines(args, prof: dict) -> None:
    out = Path(args.out)
    target = load_target_of(prof)
    rows, cache = train_cache(target, prof, out)
    tokens, n = point_sizes(rows, wanted_sizes(rows, prof))[-1]
    for algo in ("dflash_tv", "dflash", "eagle3"):
        train_one(target, prof, cache, n, algo, out / "points" / f"{tokens:09d}" / algo)


def epochs_folder_name(epochs: int, prof: dict, args) -> str:
    """e<N>, + -lr<lr> when --lr changed the profile's learning rate, + -from-<folder> when the run
    continues an earlier epochs drafter (each a separate drafter)."""
    name = f"e{epochs:02d}" + (f"-lr{prof['lr']:g}" if args.lr else "")
    return name + (f"-from-{args.init_from}" if args.init_from else "")


def cmd_epochs(args, prof: dict) -> None:
    """DSpark at the largest point trained for each of `--epochs` passes over the same rows (each its own
    cosine schedule, from scratch or, with --init-from, from a saved epochs drafter), into
    epochs/<epochs_folder_name>/dspark, then its expected τ: what more passes over the same data buy,
    beside what more data buys (the points)."""
    out = Path(args.out)
    target = load_target_of(prof)
    rows, cache = train_cache(target, prof, out)
    _, n = point_sizes(rows, wanted_sizes(rows, prof))[-1]
    init = None
    if args.init_from:
        init = out / "epochs" / args.init_from / "dspark"
        if not (init / "drafter" / "config.json").exists():
            raise SystemExit(f"--init-from {args.init_from}: no trained drafter at {init}")
    for epochs in args.epochs or []:
        train_one(target, {**prof, "epochs": epochs}, cache, n, "dspark",
                  out / "epochs" / epochs_folder_name(epochs, prof, args) / "dspark", init)
    estimate_folders(target, prof, out, epoch_drafters(out))
