"""The recipe's training step before and after a change: the same measurement run alternately (ABAB, one
process each) on a baseline git revision and on this working tree, so load changes on a shared machine favour
neither.

    python benchmarks/train_step.py --baseline 01b9160                 # smollm2-135m, DSpark, dense anchors
    python benchmarks/train_step.py --baseline 01b9160 --target tiny --steps 3 --rounds 1   # a smoke run

One measurement (`--measure`, in a child process whose library is the revision's): the library's single-device
step (dspark.training.loop.LocalTrainer, as the GPU recipe trains) on synthetic rollouts (random tokens, a
quarter prompt, three quarters supervised: content does not change the cost) of `--seq-len` tokens, batch
`--batch`, a drafter of the recipe's shape (`--algo`, `--anchors` per sequence: the GPU recipe uses 512, i.e.
every answer position of a 1024-token row is an anchor and each position is labelled by up to block-size anchor
blocks), precision auto. The first step is not timed; tokens/s = non-padding tokens over the timed steps.
With `--memo` a third side runs this tree's step with the target memo warm (every step after the warm-up is
served from it, as in a run's second epoch or its next drafter). Printed (last stdout line, JSON; also written
to benchmarks/results/train_step/<cpu>.json): per side the tokens/s of each round and their median, and the
ratios to the baseline.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", help="git revision measured against this working tree")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--algo", default="dspark")
    ap.add_argument("--anchors", type=int, default=512, help="anchors per sequence (capped by the eligible ones)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4, help="timed optimizer steps per measurement")
    ap.add_argument("--rounds", type=int, default=2, help="ABAB rounds")
    ap.add_argument("--memo", action="store_true",
                    help="also measure this tree's step with the target memo warm (a later epoch: "
                         "dspark/training/target_memo.py), as a third side `after_memo`")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/train_step/<cpu label>.json)")
    ap.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # child mode: the library root to import
    ap.add_argument("--memo-side", action="store_true", help=argparse.SUPPRESS)  # child mode: with a warm memo
    return ap.parse_args(argv)


def measure(args: argparse.Namespace) -> dict:
    """tokens/s of `args.steps` LocalTrainer steps with the library found under args.measure."""
    sys.path.insert(0, args.measure)
    import torch

    from dspark.drafters import DrafterConfig, build_drafter
    from dspark.models.precision import torch_dtype
    from dspark.models.target import load_target
    from dspark.training.config import OptimSection
    from dspark.training.loop import LocalTrainer

    torch.manual_seed(0)
    dtype = torch_dtype("auto", "cpu")
    target = load_target(args.target, device="cpu", dtype=dtype)
    drafter = build_drafter(DrafterConfig(algo=args.algo, anchors_per_seq=args.anchors), target)
    precision = "bf16" if dtype == torch.bfloat16 else "fp32"
    memo = None
    if args.memo_side:  # the same batch every step: after the warm-up step every step is a later epoch's
        from dspark.training.target_memo import TargetMemo

        memo = TargetMemo.of_gb(4.0)
    trainer = LocalTrainer(args.algo, target, drafter, OptimSection(), precision, **({"memo": memo} if memo else {}))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, target.vocab_size, (args.batch, args.seq_len), generator=gen)
    loss_mask = torch.ones_like(ids)
    loss_mask[:, : args.seq_len // 4] = 0
    batch = {"input_ids": ids, "loss_mask": loss_mask, "attention_mask": torch.ones_like(ids)}
    trainer.step(batch, seed=0)  # warm-up: allocator, kernels
    t0, tokens = time.perf_counter(), 0.0
    for step in range(args.steps):
        tokens += trainer.step(batch, seed=step + 1)["tokens"]
    return {"tokens_per_s": round(tokens / (time.perf_counter() - t0), 1), "precision": precision}


def child(root: Path, args: argparse.Namespace, memo: bool = False) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--measure", str(root), "--target", args.target,
           "--algo", args.algo, "--anchors", str(args.anchors), "--seq-len", str(args.seq_len),
           "--batch", str(args.batch), "--steps", str(args.steps)] + (["--memo-side"] if memo else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.measure:
        result = measure(args)
        print(json.dumps(result))
        return result
    if not args.baseline:
        raise SystemExit("--baseline REV is required (the revision to compare this working tree against)")
    rev = subprocess.run(["git", "rev-parse", "--short", args.baseline], cwd=REPO_ROOT, capture_output=True,
                         text=True, check=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="dspark-baseline-") as tmp:
        base = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(base), rev], cwd=REPO_ROOT, check=True,
                       capture_output=True)
        try:
            runs = {"baseline": [], "after": []} | ({"after_memo": []} if args.memo else {})
            roots = {"baseline": base, "after": REPO_ROOT, "after_memo": REPO_ROOT}
            for r in range(args.rounds):
                order = list(runs) if r % 2 == 0 else list(runs)[::-1]
                for name in order:
                    res = child(roots[name], args, memo=name == "after_memo")
                    runs[name].append(res["tokens_per_s"])
                    print(f"round {r + 1} {name}: {res['tokens_per_s']} tok/s ({res['precision']})", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=REPO_ROOT, capture_output=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    result = {"benchmark": "train_step", "baseline_rev": rev, "target": args.target, "algo": args.algo,
              "anchors_per_seq": args.anchors, "seq_len": args.seq_len, "batch": args.batch, "steps": args.steps,
              "tokens_per_s": runs, "median_tokens_per_s": med,
              "after_over_baseline": round(med["after"] / med["baseline"], 3)}
    if args.memo:
        result["after_memo_over_baseline"] = round(med["after_memo"] / med["baseline"], 3)
    sys.path.insert(0, str(REPO_ROOT))
    from benchmarks.decode_core import device_label, write_result

    write_result(result, "train_step", device_label("cpu"), args.out)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
