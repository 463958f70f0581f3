"""Acceptance cost of position-keyed randomness for seeded requests (EngineConfig.seeded_sampling).

    python benchmarks/seeded_acceptance.py            # tiny target, a few minutes on one core

A seeded request under `seeded_sampling=keyed` draws every token by Gumbel-max with noise keyed by
(seed, output position) and accepts a draft iff it equals the target's own Gumbel-max token
(dspark.decoding.sampling.KeyedNoise); under `stream` it uses the rejection rule (accept x ~ q w.p.
min(1, p/q)), whose acceptance Σ min(p, q) is the largest any lossless coupling reaches. A coupling
whose emitted token ignores the draft cannot reach it in general (Gumbel-max keeps at least
(1 - TV) / (1 + TV)). This measures the gap as per-draft acceptance α on real target distributions:
p = the `tiny` target's next-token distributions along its own temperature-1 rollouts, q = p
perturbed in log space (Gaussian noise of scale σ: drafters of known quality); the rejection rule's
Σ min(p, q) exactly, the keyed coupling's P(argmax(log q + g) = argmax(log p + g)) by Monte Carlo
over `--noise-draws` Gumbel vectors; and the τ each implies at γ = 4 with independent positions
(Σ_{k<=γ} α^k). Greedy (temperature 0) is identical under both (one-hot distributions).
(An end-to-end τ needs a drafter close to the target: a DSpark drafter trained for 150 steps on
these rollouts accepted ~1% of drafts under both rules, too weak to tell them apart, so it is not
part of this benchmark.) The last stdout line is one JSON object.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.output import emit  # noqa: E402
from dspark.decoding.engine import Engine, EngineConfig  # noqa: E402
from dspark.decoding.sampling import SamplingParams  # noqa: E402
from dspark.decoding.scheduler import SchedulerConfig  # noqa: E402
from dspark.models.target import load_target  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="tiny")
    ap.add_argument("--prompts", type=int, default=48, help="rollouts (random 6-token prompts)")
    ap.add_argument("--tokens", type=int, default=48, help="tokens per rollout")
    ap.add_argument("--sigmas", default="0.25,0.5,1.0,2.0", help="log-space noise scales of the synthetic drafters")
    ap.add_argument("--noise-draws", type=int, default=256)
    ap.add_argument("--gamma", type=int, default=4, help="block size for the implied τ")
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def prompts(target, n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(10, target.vocab_size, (6,), generator=gen).tolist() for _ in range(n)]


@torch.no_grad()
def rollouts_of(target, prompt_list, tokens: int) -> list[list[int]]:
    engine = Engine(target, None, EngineConfig(scheduler=SchedulerConfig(mode="off"), max_batch=64))
    reqs = engine.generate(prompt_list, SamplingParams(temperature=1.0), max_new_tokens=tokens, stop_ids=[],
                           seeds=list(range(len(prompt_list))))
    return [p + r.tokens for p, r in zip(prompt_list, reqs)]


@torch.no_grad()
def sweep(target, rollouts: list[list[int]], sigmas: list[float], draws: int, gamma: int) -> list[dict]:
    """Per-draft acceptance of both couplings for q = softmax(log p + σ ε) over the rollouts' positions."""
    logits = target.forward(torch.tensor(rollouts), logits_at="all").logits.reshape(-1, target.vocab_size)
    p = torch.softmax(logits.double(), -1)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for sigma in sigmas:
        q = torch.softmax(p.log() + sigma * torch.randn(p.shape, generator=gen, dtype=torch.float64), -1)
        rejection = float(torch.minimum(p, q).sum(-1).mean())
        hits = 0.0
        for _ in range(draws):
            g = -torch.log(-torch.log(torch.rand(p.shape, generator=gen, dtype=torch.float64)))
            hits += float(((p.log() + g).argmax(-1) == (q.log() + g).argmax(-1)).double().mean())
        keyed = hits / draws
        tv = float(0.5 * (p - q).abs().sum(-1).mean())
        rows.append({"sigma": sigma, "tv": round(tv, 4), "alpha_rejection": round(rejection, 4),
                     "alpha_keyed": round(keyed, 4),
                     "tau_rejection": round(sum(rejection ** k for k in range(gamma + 1)), 3),
                     "tau_keyed": round(sum(keyed ** k for k in range(gamma + 1)), 3)})
        print(f"σ={sigma}: α rejection {rejection:.3f} vs keyed {keyed:.3f} (TV {tv:.3f})", file=sys.stderr)
    return rows


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(1)
    target = load_target(args.target)
    rollouts = rollouts_of(target, prompts(target, args.prompts), args.tokens)
    rows = sweep(target, rollouts, [float(s) for s in args.sigmas.split(",")], args.noise_draws, args.gamma)
    result = {"benchmark": "seeded_acceptance", "target": args.target, "positions": len(rollouts) * len(rollouts[0]),
              "noise_draws": args.noise_draws, "gamma": args.gamma, "synthetic_drafters": rows}
    return emit(result, args.out)


if __name__ == "__main__":
    main()
