"""Acceptance cost of position-keyed randomness for seeded requests (EngineConfig.seeded_sampling).

    python benchmarks/seeded_acceptance.py            # tiny target, a few minutes on one core

A seeded request under `seeded_sampling=keyed` draws every token by Gumbel-max with noise keyed by
(seed, output position) and accepts a draft iff it equals the target's own Gumbel-max token
(dspark.sampling.KeyedNoise); under `stream` it uses the rejection rule (accept x ~ q w.p.
min(1, p/q)), whose acceptance Σ min(p, q) is the largest any lossless coupling reaches. This
measures what the keyed coupling costs:
1. a DSpark drafter (the `drafter:` section of configs/train/tiny-dspark.yaml) is trained briefly on
   temperature-1 target rollouts of the `tiny` target (so q is close to p, as for a real drafter);
2. the same held-out prompts are decoded by the engine (fixed scheduler: every draft verified, so
   τ measures acceptance alone; one request per prompt, all seeded) under `keyed` and under `stream`; τ = (accepted + rounds) / rounds is reported for each,
   at temperature 1 and 0.7, with the per-draft acceptance rate accepted / verified.
Greedy (temperature 0) is identical under both (one-hot distributions). The last stdout line is one
JSON object.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from dspark.decoding.engine import Engine, EngineConfig  # noqa: E402
from dspark.decoding.sampling import SamplingParams  # noqa: E402
from dspark.decoding.scheduler import SchedulerConfig  # noqa: E402
from dspark.drafters import DrafterConfig, build_drafter  # noqa: E402
from dspark.models.target import load_target  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="tiny")
    ap.add_argument("--train-prompts", type=int, default=48)
    ap.add_argument("--eval-prompts", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=48, help="tokens per rollout and per evaluated answer")
    ap.add_argument("--steps", type=int, default=150, help="drafter training steps")
    ap.add_argument("--temperatures", default="1.0,0.7")
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def prompts(target, n: int, offset: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(offset)
    return [torch.randint(10, target.vocab_size, (6,), generator=gen).tolist() for _ in range(n)]


def train_drafter(target, rollouts: list[list[int]], prompt_len: int, steps: int):
    from dspark.training.loss import drafter_loss

    section = yaml.safe_load((REPO_ROOT / "configs/train/tiny-dspark.yaml").read_text())["drafter"]
    torch.manual_seed(0)
    drafter = build_drafter(DrafterConfig.model_validate(section), target)
    ids = torch.tensor(rollouts)
    mask = torch.zeros_like(ids)
    mask[:, prompt_len:] = 1
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    drafter.train()
    for _ in range(steps):
        out = drafter_loss(drafter, target, ids, mask, None, gen)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    return drafter.eval(), float(out.loss.detach())


def decode(target, drafter, evals, sp, tokens: int, seeded_sampling: str) -> dict:
    engine = Engine(target, drafter, EngineConfig(scheduler=SchedulerConfig(mode="fixed"),
                                                  seeded_sampling=seeded_sampling, max_batch=8))
    start = time.perf_counter()
    engine.generate(evals, sp, max_new_tokens=tokens, stop_ids=[], seeds=list(range(1, len(evals) + 1)))
    t = engine.stats()["totals"]
    return {"tau": round((t["accepted"] + t["rounds"]) / t["rounds"], 4),
            "acceptance": round(t["accepted"] / max(t["verified"], 1), 4), "rounds": t["rounds"],
            "wall_s": round(time.perf_counter() - start, 2)}


@torch.no_grad()
def rollouts_of(target, prompt_list, tokens: int) -> list[list[int]]:
    engine = Engine(target, None, EngineConfig(scheduler=SchedulerConfig(mode="off"), max_batch=64))
    reqs = engine.generate(prompt_list, SamplingParams(temperature=1.0), max_new_tokens=tokens, stop_ids=[],
                           seeds=list(range(len(prompt_list))))
    return [p + r.tokens for p, r in zip(prompt_list, reqs)]


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(1)
    target = load_target(args.target)
    t0 = time.perf_counter()
    drafter, loss = train_drafter(target, rollouts_of(target, prompts(target, args.train_prompts, 0), args.tokens),
                                  6, args.steps)
    train_s = time.perf_counter() - t0
    evals = prompts(target, args.eval_prompts, 1)
    rows = []
    for temp in [float(t) for t in args.temperatures.split(",")]:
        sp = SamplingParams(temperature=temp)
        keyed, stream = (decode(target, drafter, evals, sp, args.tokens, mode) for mode in ("keyed", "stream"))
        rows.append({"temperature": temp, "keyed": keyed, "stream": stream,
                     "tau_ratio_keyed_over_stream": round(keyed["tau"] / stream["tau"], 4)})
        print(f"T={temp}: τ keyed {keyed['tau']:.3f} (acc {keyed['acceptance']:.3f}) vs stream {stream['tau']:.3f} "
              f"(acc {stream['acceptance']:.3f})", file=sys.stderr)
    result = {"benchmark": "seeded_acceptance", "target": args.target, "train_steps": args.steps,
              "final_loss": round(loss, 4), "train_s": round(train_s, 1), "eval_prompts": args.eval_prompts,
              "tokens": args.tokens, "results": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
