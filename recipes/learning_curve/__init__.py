"""Learning curve of the DSpark drafter on one machine: rollouts -> nested training points -> expected τ,
plus equal-budget baselines, a report (JSON + plot) and the inputs of `dspark plan`. Single process, no Ray.

    python -m recipes.learning_curve rollouts  [--profile cpu|gpu] [--out DIR]   # train + held-out rollouts
        [--which train --extra-prompts URI --extra-name magpie]  # more train prompts (e.g. jobs.synthesize output)
        [--which train --first-pass 5 --passes 16]  # only answers ~p5..~p15: fresh rows for a drafter of passes 0-4
    python -m recipes.learning_curve train     [--profile cpu|gpu] [--out DIR]   # every training point
        [--point-epochs 2 --layers 1 --anchors 32]  # another point recipe (a point trained otherwise stops it)
    python -m recipes.learning_curve evaluate  [--profile cpu|gpu] [--out DIR]   # expected τ per point
    python -m recipes.learning_curve baselines [--profile cpu|gpu] [--out DIR]   # 4 algos, real τ + speed
    python -m recipes.learning_curve epochs    [--profile cpu|gpu] [--out DIR] --epochs 2 6  # the largest point, more passes
        [--lr 5e-4] [--init-from e05 | capacity/L1-a32-m60 --layers 1 --anchors 32]  # continue a saved drafter
        [--init-from DRAFTER --refresh-vocab]  # ... moved to the draft vocabulary of this run's rows
        [--init-from DRAFTER --layers 2]  # ... deepened (dspark.drafters.deepen: drafts as before until trained)
    python -m recipes.learning_curve sweep     [--out DIR] --layers 1 2 3 --anchors 32 128 512  # training tok/s + MFU
    python -m recipes.learning_curve capacity  [--out DIR] --layers 1 2 --anchors 512 --minutes 20  # equal CPU-minutes
    python -m recipes.learning_curve report    [--profile cpu|gpu] [--out DIR]   # JSON + plot
    python -m recipes.learning_curve compare   [--out DIR] --drafters BASE OTHER  # paired τ difference
        [--gamma 3 --answer-tokens 64 --benchmarks gsm8k humaneval mt-bench]  # ... at a decode run's setting
    python -m recipes.learning_curve lineage   [--spec S --curve C]  # a drafter trained in rounds: τ vs distinct tokens
    python -m recipes.learning_curve draft-temperature --drafters D [--temperatures 0.6 0.8 1.0] [--save DIR]
        [--gamma 3 --answer-tokens 64]  # the draft temperature that maximises decoding's τ (renewal estimate)
    python -m recipes.learning_curve draft-trees --drafters D [--trees 2 3 4 2x2 3x2] [--gamma 3 ...]
        # a tree of drafts verified per round: decoding's τ (renewal), the measured round cost, the projection

Every phase is resumable from its output folder (DIR, default /work/learn-runs/<profile>): rollouts commit a
Parquet shard per chunk in the rollout-store format (dspark/io/storage/rollout_store.py) and skip committed
chunks; a training point with a saved drafter is skipped; an evaluation with a result file is skipped.
Progress goes to stdout (one line per chunk / log interval).

Data: prompts = every data/train file (first user turn), decontaminated against data/eval with the
synthesis job's EvalIndex rule (13-gram, boilerplate-aware; dspark.data.prompt_filters); `passes` samples per
prompt, each pass with its own seed and prompt ids suffixed `~p<k>` (so every answer has its own row
seed). Held-out: the first turn of every data/eval prompt, one answer each, for the expected-τ estimate.
"""
from __future__ import annotations

import argparse
import re

from recipes.learning_curve.profiles import PROFILES, REPO, CurveProfile, log
from recipes.learning_curve.rollouts import cmd_rollouts
from recipes.learning_curve.training import (cmd_baselines, cmd_capacity, cmd_epochs, cmd_sweep, cmd_train,
                                             one_setting)
from recipes.learning_curve.measure import cmd_compare, cmd_decode, cmd_evaluate
from recipes.learning_curve.report import cmd_report
from recipes.learning_curve.lineage import cmd_lineage
from recipes.learning_curve.draft_temperature import cmd_draft_temperature
from recipes.learning_curve.draft_trees import cmd_draft_trees

# ---------------------------------------------------------------- CLI
PHASES = {"rollouts": cmd_rollouts, "train": cmd_train, "baselines": cmd_baselines, "evaluate": cmd_evaluate,
          "decode": cmd_decode, "epochs": cmd_epochs, "report": cmd_report, "sweep": cmd_sweep,
          "capacity": cmd_capacity, "compare": cmd_compare, "lineage": cmd_lineage,
          "draft-temperature": cmd_draft_temperature, "draft-trees": cmd_draft_trees}
# `after-rollouts`: everything after the rollouts in ONE process (imports and the target load once), the
# curve first (train, evaluate), then real decoding of what exists (DSpark at the largest point: the
# estimator's check), then the baselines and their decoding; a stop at any point leaves valid results.
AFTER_ROLLOUTS = ["train", "evaluate", "report", "decode", "report", "baselines", "evaluate", "decode", "report"]


def _folder_name(text: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", text):
        raise argparse.ArgumentTypeError(f"{text!r}: use letters, digits, '.', '_' and '-' (it names a folder)")
    return text


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m recipes.learning_curve", description=__doc__.splitlines()[0])
    p.add_argument("phase", choices=[*PHASES, "after-rollouts", "all"])
    p.add_argument("--profile", choices=sorted(PROFILES), default="cpu")
    p.add_argument("--out", default=None, help="output folder (default /work/learn-runs/<profile>)")
    p.add_argument("--which", choices=["eval", "train", "both"], default="both", help="rollouts: which set")
    p.add_argument("--passes", type=int, default=None, help="rollouts: samples per train prompt")
    p.add_argument("--first-pass", type=int, default=0,
                   help="rollouts --which train: start at this pass (answers ~p<first-pass> .. ~p<passes-1>): fresh "
                        "answers for a drafter trained on a folder that stopped before it")
    p.add_argument("--chunk-prompts", type=int, default=None,
                   help="rollouts: prompts per committed chunk, also the engine's batch (default: the profile's; "
                        "64 measured 2x the tok/s of 24 on 2 cores); a folder keeps the size it started with")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default=None,
                   help="the target's dtype (default: the profile's, auto = bfloat16 where the profile's device "
                        "computes it natively, else float32; float32 reproduces the cpu measurements before 2026-12-05)")
    p.add_argument("--data-dtype", choices=["auto", "float32", "bfloat16"], default=None,
                   help="the target's dtype for the training data only (train rollouts, training feature cache); "
                        "evaluation and decoding keep the profile's (default: the profile's dtype)")
    p.add_argument("--precision", choices=["fp32", "bf16"], default=None,
                   help="train/epochs/capacity/sweep: the drafter's training precision (bf16 = autocast; default fp32)")
    p.add_argument("--limit-prompts", type=int, default=None, help="rollouts: first N train prompts only")
    p.add_argument("--extra-prompts", default=None, help="rollouts --which train: another prompt set (a jobs.synthesize "
                   "output such as Magpie prompts, a JSONL file), decontaminated likewise, into rollouts-train-<--extra-name>; "
                   "training then uses rollouts-train and every rollouts-train-<name> after it")
    p.add_argument("--extra-name", default=None, type=_folder_name, help="rollouts: the extra set's name")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: the profile's)")
    p.add_argument("--epochs", type=int, nargs="+", default=None, help="epochs: passes per run (one drafter each)")
    p.add_argument("--point-epochs", type=int, default=None,
                   help="train/baselines: passes over its rows per curve point (default: the profile's)")
    p.add_argument("--lr", type=float, default=None, help="epochs: peak learning rate (default: the profile's); "
                   "the drafter goes to epochs/e<N>-lr<lr>")
    p.add_argument("--refresh-vocab", action="store_true",
                   help="epochs with --init-from: recount the draft vocabulary on this run's rows and move the "
                        "drafter to it (tokens in both keep their weights, new ones start at zero; folder -vocab)")
    p.add_argument("--init-from", default=None, help="epochs: continue this drafter (an epochs folder such as "
                   "e05, capacity/<name>, or the path of any saved drafter folder, with the same --layers/--anchors, or more "
                   "--layers: it is deepened, the added layers starting as no-ops) with a new schedule instead of "
                   "starting from scratch; it keeps its draft vocabulary")
    p.add_argument("--layers", type=int, nargs="+", default=None,
                   help="sweep/capacity: drafter layers per setting; train/baselines/epochs: one value, the drafter's")
    p.add_argument("--anchors", type=int, nargs="+", default=None,
                   help="sweep/capacity: anchors per sequence per setting; train/baselines/epochs: one value")
    p.add_argument("--minutes", type=float, default=None, help="capacity: wall-clock training budget per setting")
    p.add_argument("--modes", nargs="+", default=None, help="decode: only these modes (and target-only)")
    p.add_argument("--drafters", nargs="+", default=None,
                   help="compare: saved drafter folders, the baseline first; draft-temperature, draft-trees: the one "
                        "drafter")
    p.add_argument("--temperatures", nargs="+", type=float, default=None,
                   help="draft-temperature: the values to try (1 is always tried; default 0.5 0.6 0.7 0.8 0.9 1.0)")
    p.add_argument("--trees", nargs="+", default=None,
                   help="draft-trees: children per node at each depth, e.g. 4 or 3x2 (one chain is always tried; "
                        "default 2 3 4 2x2 3x2)")
    p.add_argument("--save", default=None, help="draft-temperature: write the drafter with the best value here")
    p.add_argument("--labels", nargs="+", default=None,
                   help="compare: a short name per drafter, in --drafters order (default: its path)")
    p.add_argument("--gamma", type=int, default=None,
                   help="compare: drafts per round to estimate τ at (a decode run's γ; default each drafter's block size)")
    p.add_argument("--answer-tokens", type=int, default=None,
                   help="compare: anchors only in each held-out answer's first N tokens (a decode run's max_new_tokens)")
    p.add_argument("--benchmarks", nargs="+", default=None,
                   help="compare: held-out rows of these benchmarks only (a decode run's --datasets)")
    p.add_argument("--spec", default=str(REPO / "benchmarks" / "results" / "learning_curve" / "lineage-spec.json"),
                   help="lineage: the rounds (label, compare JSON and drafter key, rollout sets first seen)")
    p.add_argument("--curve", default=str(REPO / "benchmarks" / "results" / "learning_curve" / "cpu-5k.json"),
                   help="lineage: a report JSON whose points and fit are drawn beside the rounds")
    p.add_argument("--results", default=str(REPO / "benchmarks" / "results" / "learning_curve"),
                   help="report: where <name>.json, <name>.png and drafter-<name>/ go")
    p.add_argument("--name", default=None, help="report/lineage: their name (default: the profile's; lineage: "
                   "'lineage'), e.g. a second "
                   "run folder of the same profile reported beside the first")
    p.add_argument("--no-drafter", action="store_true",
                   help="report: do not export the best drafter into the results folder (JSON and plot only)")
    args = p.parse_args(argv)
    if args.refresh_vocab and not args.init_from:
        p.error("--refresh-vocab moves a saved drafter to a new vocabulary: it needs --init-from DRAFTER "
                "(a drafter trained from scratch already counts its vocabulary on this run's rows)")
    for name in ("gamma", "answer_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    args.out = args.out or f"/work/learn-runs/{args.profile}"
    args.name = args.name or ("lineage" if args.phase == "lineage" else args.profile)
    return args


def profile_of(args: argparse.Namespace) -> CurveProfile:
    """--profile's settings with the command line's overrides (each validated by CurveProfile)."""
    given = {"threads": args.threads, "lr": args.lr, "dtype": args.dtype, "data_dtype": args.data_dtype,
             "precision": args.precision, "epochs": args.point_epochs}
    prof = PROFILES[args.profile].with_overrides({k: v for k, v in given.items() if v})
    if args.phase in ("train", "baselines", "after-rollouts", "all"):
        prof = one_setting(args, prof, args.phase)
    if args.chunk_prompts:
        prof = prof.with_overrides({"chunk_prompts": args.chunk_prompts, "max_batch": args.chunk_prompts})
    return prof


def main(argv=None) -> None:
    args = parse_args(argv)
    prof = profile_of(args)
    phases = {"all": ["rollouts", *AFTER_ROLLOUTS], "after-rollouts": AFTER_ROLLOUTS}.get(args.phase, [args.phase])
    for phase in phases:
        log(f"phase {phase}")
        PHASES[phase](args, prof)


if __name__ == "__main__":
    main()
