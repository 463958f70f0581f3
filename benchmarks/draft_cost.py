"""Cost of one DSpark drafting pass relative to a batch-1 target step, with and without a draft vocabulary.

    flock /tmp/dspark-heavy.lock python benchmarks/draft_cost.py --target smollm2-135m \
        --out benchmarks/results/draft_cost/smollm2-135m-cpu.json
    python benchmarks/draft_cost.py --quick          # tiny target, a few seconds

Measured, side by side in one run (every repetition times each variant in turn, then the target):
- target step: one batch-1 decode step of the target with its KV cache at `--context` positions
  (one token in, next-token logits out; the cache is cropped back after each step);
- drafting pass: `drafter.propose` for one request (γ tokens at temperature 1) from a drafter state
  holding the same context, for each draft vocabulary size (`full` = the target vocabulary);
- where the drafting time goes: backbone (the block pass through the drafter layers), LM head (the
  target head rows of the draft vocabulary on γ hidden states) and the sequential stage (Markov
  bias, softmax, sampling, γ steps, plus the zero-extension of q to V).
Times are medians over `--reps`; ratio = drafting pass / target step (the goal is <= 0.25).
The drafter is untrained (its cost does not depend on its weights); its architecture is the
`drafter:` section of `--drafter-config`. The draft vocabulary is the N most frequent supervised
tokens of `--rollouts` (Parquet) when given, else of the eval prompts' tokens (a proxy: only the
reported coverage depends on it). The last stdout line is one JSON object.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.output import emit  # noqa: E402
from dspark.config import read_yaml  # noqa: E402
from dspark.drafters import draft_vocab  # noqa: E402
from dspark.drafters import DrafterConfig, build_drafter  # noqa: E402
from dspark.drafters.base import RowSampling  # noqa: E402
from dspark.eval.benchmark_files import parse_benchmark  # noqa: E402
from dspark.decoding.sampling import SamplingParams  # noqa: E402

GOAL = 0.25


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m", help="tiny | smollm2-135m | model dir")
    ap.add_argument("--drafter-config", default=None,
                    help="YAML with a drafter: section (default configs/train/<target>-dspark.yaml)")
    ap.add_argument("--layers", type=int, default=None, help="override the drafter's num_layers")
    ap.add_argument("--vocab-sizes", default="full,32768,8192,4096,2048,1024",
                    help="comma-separated draft vocabulary sizes; 'full' = the target vocabulary")
    ap.add_argument("--context", type=int, default=256, help="positions already in the caches")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rollouts", default=None, help="Parquet rollouts to count token frequencies in")
    ap.add_argument("--data-dir", default=str(REPO_ROOT / "data" / "eval"), help="eval JSONL dir (proxy counts)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--quick", action="store_true", help="tiny target, small vocab sizes, 5 reps")
    args = ap.parse_args(argv)
    if args.quick:
        args.target, args.reps, args.warmup, args.context = "tiny", min(args.reps, 5), min(args.warmup, 1), 32
        args.vocab_sizes = "full,256,64"
    if args.drafter_config is None:
        name = "smollm2-135m" if args.target == "smollm2-135m" else "tiny"
        args.drafter_config = str(REPO_ROOT / "configs" / "train" / f"{name}-dspark.yaml")
    return args


def drafter_config(args) -> dict:
    section = read_yaml(args.drafter_config).get("drafter")
    if not section:
        raise SystemExit(f"{args.drafter_config} has no `drafter:` section")
    if args.layers:
        section["num_layers"] = args.layers
    return section


def token_counts(args, target) -> tuple[torch.Tensor, str]:
    """Supervised-token counts [V] of the rollouts, else of the eval prompts' tokens (proxy)."""
    if args.rollouts:
        from dspark.io import storage

        fs, path = storage.pyarrow_fs(args.rollouts)
        return draft_vocab.count_parquet_frequencies([path], target.vocab_size, None, filesystem=fs), args.rollouts
    rows = []
    for path in sorted(Path(args.data_dir).glob("*.jsonl")):
        for turns in parse_benchmark(path.read_text(), str(path)):
            ids = target.tokenizer(" ".join(turns))["input_ids"]
            rows.append((ids, [1] * len(ids)))
    return draft_vocab.count_token_frequencies(rows, target.vocab_size), f"eval prompts in {args.data_dir} (proxy)"


def vocab_sizes(spec: str, vocab: int) -> list[int | None]:
    sizes = []
    for item in [s.strip() for s in spec.split(",") if s.strip()]:
        size = None if item == "full" else int(item)
        if size is not None and not 1 <= size <= vocab:
            raise SystemExit(f"--vocab-sizes: {size} is outside 1..{vocab} (the target vocabulary)")
        sizes.append(size)
    return sizes


class Variant:
    """One drafter (one draft vocabulary size) with a state holding the benchmark context."""

    def __init__(self, target, section: dict, size: int | None, counts: torch.Tensor, features, ids):
        ids_draft = None if size is None else draft_vocab.top_token_ids(counts, size, target.vocab_size)
        torch.manual_seed(0)
        cfg = DrafterConfig.model_validate({**section, "draft_vocab_size": size})
        self.drafter = build_drafter(cfg, target, draft_ids=ids_draft).eval()
        self.size, self.gamma = size, self.drafter.config.block_size
        self.coverage = 1.0 if ids_draft is None else draft_vocab.coverage(counts, ids_draft)
        self.state = self.drafter.new_state()
        self.drafter.extend_context(self.state, features, ids)
        self.anchor = int(ids[-1])
        self.sp = SamplingParams(temperature=1.0)
        self.times: dict[str, list[float]] = {"propose": [], "backbone": [], "lm_head": [], "sample_blocks": []}

    @torch.no_grad()
    def measure(self, gen: torch.Generator, keep: bool) -> None:
        d, anchors = self.drafter, torch.tensor([self.anchor])
        timings = {"propose": lambda: d.propose(self.state, self.anchor, self.gamma, self.sp, gen)}
        h = d.blocks_hidden([self.state], anchors)[:, :self.gamma]
        timings["backbone"] = lambda: d.blocks_hidden([self.state], anchors)
        timings["lm_head"] = lambda: d.lm_logits(h)
        timings["sample_blocks"] = lambda: d.sample_blocks(h, anchors, [self.gamma], RowSampling([self.sp]), gen)
        for name, fn in timings.items():
            start = time.perf_counter()
            fn()
            if keep:
                self.times[name].append(time.perf_counter() - start)

    def summary(self, target_ms: float) -> dict:
        ms = {k: 1000 * statistics.median(v) for k, v in self.times.items()}
        sequential = max(ms["sample_blocks"] - ms["lm_head"], 0.0)
        return {"draft_vocab_size": self.size or "full", "vocab": self.size or self.drafter.vocab_size,
                "coverage": round(self.coverage, 4), "propose_ms": round(ms["propose"], 3),
                "ratio": round(ms["propose"] / target_ms, 4), "meets_goal": ms["propose"] / target_ms <= GOAL,
                "breakdown_ms": {"backbone": round(ms["backbone"], 3), "lm_head": round(ms["lm_head"], 3),
                                 "sequential": round(sequential, 3)},
                "drafter_params_m": round(sum(p.numel() for p in self.drafter.parameters()) / 1e6, 3)}


@torch.no_grad()
def target_step(target, cache, length: int, token: torch.Tensor) -> float:
    start = time.perf_counter()
    target.forward(token, cache=cache, use_cache=True, logits_at="last")
    elapsed = time.perf_counter() - start
    target.crop_cache(cache, length)
    return elapsed


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from dspark.models.target import load_target

    target = load_target(args.target)
    section = drafter_config(args)
    counts, counted = token_counts(args, target)
    ids = torch.randint(0, target.vocab_size, (args.context,), generator=torch.Generator().manual_seed(0))
    layer_ids = DrafterConfig.model_validate(section).target_layer_ids or target.default_layer_ids(
        section.get("num_context_layers", 3))
    with torch.no_grad():
        prefill = target.forward(ids[None], cache=target.new_cache(), use_cache=True, layer_ids=layer_ids,
                                 logits_at="last")
    cache, features = prefill.cache, prefill.features[0]
    variants = [Variant(target, section, size, counts, features, ids)
                for size in vocab_sizes(args.vocab_sizes, target.vocab_size)]
    print(f"target {target.name} (vocab {target.vocab_size}), context {args.context}, threads "
          f"{torch.get_num_threads()}, drafter {section}, {args.reps} reps; vocab counts from {counted}", flush=True)
    gen, token, target_s = torch.Generator().manual_seed(1), ids[-1:][None], []
    for rep in range(args.warmup + args.reps):
        keep = rep >= args.warmup
        for v in variants:  # side by side: every variant and the target in each repetition
            v.measure(gen, keep)
        step = target_step(target, cache, args.context, token)
        if keep:
            target_s.append(step)
    target_ms = 1000 * statistics.median(target_s)
    rows = [v.summary(target_ms) for v in variants]
    for row in rows:
        b = row["breakdown_ms"]
        print(f"  draft vocab {str(row['draft_vocab_size']):>6}: pass {row['propose_ms']:7.2f} ms = "
              f"{row['ratio']:.1%} of a target step ({target_ms:.2f} ms); backbone {b['backbone']:.2f}, "
              f"LM head {b['lm_head']:.2f}, sequential {b['sequential']:.2f} ms; coverage {row['coverage']:.1%}",
              flush=True)
    meeting = [r["draft_vocab_size"] for r in rows if r["meets_goal"]]
    result = {"benchmark": "draft_cost", "target": target.name, "device": "cpu", "threads": torch.get_num_threads(),
              "context": args.context, "gamma": variants[0].gamma, "reps": args.reps,
              "drafter": {k: section[k] for k in ("algo", "block_size", "num_layers", "num_context_layers",
                                                   "head", "rank") if k in section},
              "vocab_counts_from": counted, "target_step_ms": round(target_ms, 3), "goal_ratio": GOAL,
              "variants": rows, "sizes_meeting_goal": meeting}
    return emit(result, args.out)


if __name__ == "__main__":
    main()
