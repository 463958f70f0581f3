"""What every phase after the rollouts shares: the target (loaded once per process), the committed rows,
the frozen-target feature cache, the algorithms, and where each drafter's folder is."""
from __future__ import annotations

import json
from pathlib import Path

from recipes.learning_curve.profiles import CurveProfile, log, target_dtype

# ---------------------------------------------------------------- shared: target, rows, caches
_TARGETS: dict = {}  # one load per process (the after-rollouts run chains phases)


def load_target_of(prof: CurveProfile):
    """The profile's target in its dtype resolved on its device (`target_dtype`: "auto" is bf16 where native)."""
    key = (prof.target, prof.device, target_dtype(prof))
    if key not in _TARGETS:
        _TARGETS[key] = _load_target(prof)
    return _TARGETS[key]


def _load_target(prof: CurveProfile):
    import torch

    from dspark.models import builtin as models_builtin
    from dspark.models.target import load_target

    torch.set_num_threads(prof.threads)
    if prof.target in models_builtin.BUILTIN:
        models_builtin.prepare(prof.target)
    return load_target(prof.target, dtype=getattr(torch, target_dtype(prof)), device=prof.device)


def committed_rows(folder: Path) -> list[dict]:
    """Rows of the committed chunks, in commit-plan order (pass 0 first), as dicts."""
    from dspark.io.storage.rollout_store import read_rollouts

    table = read_rollouts(str(folder))
    cols = ["prompt_id", "domain", "input_ids", "loss_mask", "num_generated_tokens"]
    return table.select(cols).to_pylist() if table.num_rows else []


def layer_ids_of(target, prof: CurveProfile) -> list[int]:
    return list(target.default_layer_ids(prof.drafter["num_context_layers"]))


def ensure_cache(target, prof: CurveProfile, rows: list[dict], folder: Path, max_len: int):
    """Build (resumably) and load the frozen-target feature cache of `rows`."""
    from dspark.training.feature_cache import build_cache, load_cache

    layers = layer_ids_of(target, prof)
    build_cache(target, rows, layers, str(folder), max_len, rows_per_shard=prof.cache_rows_per_shard,
                batch_size=prof.cache_batch, progress=log)
    cache = load_cache(str(folder), target, layers, max_len)
    if len(cache) != len(rows):
        raise RuntimeError(f"{folder}: the cache holds {len(cache)} rows but the rollouts {len(rows)}; a cache built "
                           f"from an earlier, smaller rollout set? delete it to rebuild")
    return cache


def data_target(target, prof: CurveProfile):
    """The target that makes training data (train rollouts, the training feature cache): `target` itself, or
    the same model loaded in the profile's `data_dtype` (--data-dtype bfloat16: 2x the rollout and ~3x the
    feature tok/s on a CPU with avx512_bf16, measured 2026-12-02). Evaluation and decoding always use the
    profile's dtype, so the estimator and the speed figures measure the reference target."""
    dtype = target_dtype(prof, prof.data_dtype)
    return target if dtype == target_dtype(prof) else load_target_of(prof.model_copy(update={"dtype": dtype}))


def train_sets(out: Path) -> list[tuple[Path, Path]]:
    """(rollout folder, feature-cache folder) of every training set, in training-row order: rollouts-train,
    then each rollouts-train-<name> (an extra prompt set, `rollouts --extra-prompts`) by name."""
    extras = sorted(p for p in out.glob("rollouts-train-*") if p.is_dir())
    return [(out / "rollouts-train", out / "features-train"),
            *((p, out / p.name.replace("rollouts-", "features-", 1)) for p in extras)]


def train_cache(target, prof: CurveProfile, out: Path):
    """(rows, feature cache) of the training set: every train set's committed rows, concatenated, cut to the
    row count frozen at the first training run (train-rows.json; nested points stay nested)."""
    sets = [(folder, cache_dir, committed_rows(folder)) for folder, cache_dir in train_sets(out)]
    rows = [r for _, _, part in sets for r in part]
    if not rows:
        raise SystemExit(f"no committed train rollouts under {out / 'rollouts-train'}; run the rollouts phase first")
    frozen = out / "train-rows.json"  # the training set is fixed at the first training run (nested prefixes)
    if frozen.exists():
        n = json.loads(frozen.read_text())["rows"]
        if n > len(rows):
            raise SystemExit(f"{frozen} says {n} rows but only {len(rows)} are committed")
        rows = rows[:n]
    else:
        frozen.write_text(json.dumps({"rows": len(rows), "generated_tokens": sum(r["num_generated_tokens"] for r in rows),
                                      "sets": {folder.name: len(part) for folder, _, part in sets}}))
    caches, start = [], 0
    for folder, cache_dir, part in sets:
        take = part[:max(0, len(rows) - start)]
        start += len(part)
        if take:
            caches.append(ensure_cache(data_target(target, prof), prof, take, cache_dir, prof.max_len))
    return rows, concat_caches(caches)


def concat_caches(caches: list):
    """One FeatureCache holding the rows of `caches` in order (lists of per-row views: nothing copied)."""
    if len(caches) == 1:
        return caches[0]
    from dspark.training.feature_cache import FeatureCache

    return FeatureCache(*([x for c in caches for x in getattr(c, name)]
                          for name in ("input_ids", "loss_mask", "features", "final")))


def wanted_sizes(rows: list[dict], prof: CurveProfile) -> list[int]:
    """Point sizes in rollout tokens: the profile's fixed sizes, or fractions of what was committed."""
    total = sum(r["num_generated_tokens"] for r in rows)
    return [int(f * total) for f in prof.point_fractions] or list(prof.point_tokens)


def point_sizes(rows: list[dict], wanted: list[int]) -> list[tuple[int, int]]:
    """(rollout tokens, rows) per point: the shortest prefix holding >= each wanted size; sizes beyond
    the data are replaced by one point with every row (the largest point = all committed rollouts)."""
    cum, total, out = [], 0, []
    for r in rows:
        total += r["num_generated_tokens"]
        cum.append(total)
    for size in sorted(wanted):
        n = next((i + 1 for i, c in enumerate(cum) if c >= size), None)
        if n is None:
            break
        out.append((cum[n - 1], n))
    if not out or out[-1][1] < len(rows):
        out.append((total, len(rows)))
    return out


# ---------------------------------------------------------------- the algorithms and their drafter folders
ALGOS = {
    # the paper's comparison (DESIGN §6): DSpark = parallel block + Markov head + confidence, L_ce + L_tv;
    # DFlash = parallel block, CE only (reference recipe); DFlash+TV = DSpark's loss without the head;
    # Eagle3 = autoregressive, dense training-time test, soft labels, 0.8^(k-1) step weights.
    "dspark": {"algo": "dspark", "head": "markov", "confidence_head": True, "loss_ce": 0.1, "loss_tv": 0.9},
    "dflash": {"algo": "dflash", "loss_ce": 1.0, "loss_tv": 0.0},
    "dflash_tv": {"algo": "dflash", "loss_ce": 0.1, "loss_tv": 0.9},
    "eagle3": {"algo": "eagle3", "dense_ttt": True, "ce_target": "soft", "position_weight": "geometric",
               "position_decay": 0.8, "loss_ce": 1.0, "loss_tv": 0.0},
}


def owner_of(drafter: Path) -> Path | None:
    """The training folder (<run>/<series>/<name>) whose dspark/drafter `drafter` is, else None."""
    path = drafter.resolve()
    return path.parents[1] if path.parts[-2:] == ("dspark", "drafter") else None


def trained_drafters(out: Path) -> list[Path]:
    return sorted(p for p in (out / "points").glob("*/*") if (p / "train.json").exists())


def epoch_drafters(out: Path) -> list[Path]:
    return sorted(p for p in (out / "epochs").glob("e*/dspark") if (p / "train.json").exists())


def capacity_drafters(out: Path) -> list[Path]:
    return sorted(p for p in (out / "capacity").glob("*/dspark") if (p / "train.json").exists())


def epoch_mode(folder: Path) -> str:
    """Decode-mode name of an epochs- or capacity-series drafter folder (epochs/e05/dspark -> dspark_e05,
    capacity/L1-a256-m20/dspark -> dspark_L1-a256-m20)."""
    return f"dspark_{folder.parent.name}"
