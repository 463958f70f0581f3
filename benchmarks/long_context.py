"""Long-context drafter training: peak memory and tokens/s of one training step as the sequence grows 4 k → 32 k.

    python benchmarks/long_context.py                                  # 4k, 8k, 16k, 32k tokens
    python benchmarks/long_context.py --lengths 1024 2048 --steps 1    # a smoke run
    python benchmarks/long_context.py --lengths 4096 32768 --context-window 1024 \
        --out benchmarks/results/scale/long_context_window1024.json     # the drafter's sliding window

Each length runs in its own process (so one length's peak cannot hide another's): a random Llama target
(`--hidden`, `--layers`, 32 k positions, seed 0) and a DSpark drafter (block 8, `--anchors` anchors sampled over
the whole sequence), the library's training step (dspark.training.loop.LocalTrainer: the frozen target's forward,
the target distributions at the supervised positions, the drafter's forward and backward, AdamW) on a batch of
two rows, one of that many tokens and one of 3/4 of it, right-padded (the first eighth of each is prompt). Peak = the kernel's peak RSS (VmHWM, reset after the models are
built) minus the RSS then: what the step itself holds. Precision from the hardware (bf16 target forward where
native). Printed (last stdout line, JSON; written to benchmarks/results/scale/long_context.json):
`long_context` [{seq_len, peak_bytes, tok_per_s}], and the peak's growth against the length's.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--anchors", type=int, default=256)
    ap.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up step")
    ap.add_argument("--context-window", type=int, default=None, help="the drafter's context_window (None: whole)")
    ap.add_argument("--measure", type=int, default=None, help=argparse.SUPPRESS)  # one length, in a child
    ap.add_argument("--out", default=str(REPO_ROOT / "benchmarks/results/scale/long_context.json"))
    return ap.parse_args(argv)


def build_llama(args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from dspark.drafters import DrafterConfig, build_drafter
    from dspark.models.target import Target

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=2048, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=max(1, args.hidden // 128), max_position_embeddings=32768)
    target = Target(LlamaForCausalLM(config), None, name="random-long", revision="")
    drafter = build_drafter(DrafterConfig(algo="dspark", block_size=8, num_layers=1, num_context_layers=2,
                                          anchors_per_seq=args.anchors, context_window=args.context_window), target)
    return target, drafter


def measure(args, length: int) -> dict:
    import psutil
    import torch

    from benchmarks.sharded_target import peak_rss, reset_peak_rss
    from dspark.training.config import OptimSection
    from dspark.training.loop import LocalTrainer
    from dspark.training.step import resolve_precision

    target, drafter = build_llama(args)
    trainer = LocalTrainer("dspark", target, drafter, OptimSection(lr=1e-4), resolve_precision("cpu"))
    g = torch.Generator().manual_seed(length)
    ids = torch.randint(0, 2048, (2, length), generator=g)
    attention = torch.ones_like(ids)
    attention[1, 3 * length // 4:] = 0  # a second, shorter row, right-padded as the trainer batches them
    loss_mask = attention.clone()
    loss_mask[:, : length // 8] = 0
    batch = {"input_ids": ids, "loss_mask": loss_mask, "attention_mask": attention}
    tokens = int(attention.sum())
    reset_peak_rss()
    before = psutil.Process().memory_info().rss
    trainer.step(batch, seed=0)  # warm-up (also allocates AdamW's state)
    t0 = time.perf_counter()
    for step in range(args.steps):
        loss = trainer.step(batch, seed=step + 1)["loss"]
    dt = time.perf_counter() - t0
    return {"seq_len": length, "peak_bytes": peak_rss() - before, "tok_per_s": round(tokens * args.steps / dt, 1),
            "loss": loss}


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.measure is not None:
        print(json.dumps(measure(args, args.measure)))
        return {}
    rows = []
    for length in args.lengths:
        cmd = [sys.executable, __file__, "--measure", str(length), "--hidden", str(args.hidden), "--layers",
               str(args.layers), "--anchors", str(args.anchors), "--steps", str(args.steps)]
        cmd += ["--context-window", str(args.context_window)] if args.context_window else []
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=str(REPO_ROOT)).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), file=sys.stderr)
    first, last = rows[0], rows[-1]
    length_growth = last["seq_len"] / first["seq_len"]
    peak_growth = last["peak_bytes"] / max(first["peak_bytes"], 1)
    result = {"target": f"random Llama hidden {args.hidden}, {args.layers} layers, vocab 2048",
              "drafter": f"dspark block 8, {args.anchors} anchors per row", "context_window": args.context_window,
              "long_context": rows,
              "length_growth": length_growth, "peak_growth": round(peak_growth, 3),
              "meets_goal": peak_growth <= length_growth}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
