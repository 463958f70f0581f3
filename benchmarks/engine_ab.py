"""Engine-level A/B of scheduler modes on one machine shared with other work: tokens per busy second.

    python benchmarks/engine_ab.py --target smollm2-135m --drafter DIR --modes off,dynamic --concurrency 1,4,16,64

Every mode gets its own engine in this one process (same target weights, same drafter), kept at `c`
active requests (a finished request is replaced at once; closed loop, `--max-tokens` each, temperature
1). The engines take turns `--chunk` steps at a time, the order of the modes reversed every turn
(ABBA), until each has run `--steps` steps per level; a mode's figure is tokens emitted / seconds
spent in its own steps (`prefill_steps`/`prefill_s`: the steps that admitted requests, part of it). With
`--max-tokens-spread 0` every request has the same budget, so mode off's requests finish and are prefilled
together (a few large prefills) while a drafting mode's drift apart (more, smaller prefills): a closed-loop
artefact that real traffic does not have; a spread scatters every mode's. Background load that drifts
over the run then hits every mode alike, which a sequential HTTP benchmark (benchmarks/serve_load.py)
cannot ensure on a busy machine. What it leaves out, HTTP and Ray Serve, is the same code for every mode.

The dynamic engine uses the draft gate (as configs/serve does) and the SPS table given with
--sps-table (JSON) or profiled at start. A mode "<mode>+t<tree>" (e.g. fixed+t2, fixed+t4x2) verifies that
draft tree per request (EngineConfig.draft_tree) at every level, or while at most --tree-max-rows requests
are active (chains above, as a served config would run): where trees stop paying as load grows. `over_off` holds every mode's tokens per busy second over mode off's, per
level. The last stdout line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m", help="smollm2-135m | tiny | model dir")
    ap.add_argument("--drafter", required=True, help="local drafter directory")
    ap.add_argument("--modes", default="off,dynamic",
                    help="comma-separated scheduler modes; <mode>+t<tree> adds a draft tree, e.g. fixed+t2,fixed+t4x2")
    ap.add_argument("--concurrency", default="1,4,16,64", help="comma-separated numbers of active requests")
    ap.add_argument("--steps", type=int, default=48, help="timed steps per mode and level")
    ap.add_argument("--chunk", type=int, default=4, help="steps a mode runs before the next one takes its turn")
    ap.add_argument("--warmup", type=int, default=4, help="untimed steps per mode at the start of each level")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    ap.add_argument("--max-tokens-spread", type=float, default=0.0,
                    help="each request's token budget drawn uniformly from max-tokens x [1 - s, 1 + s] (one seeded "
                         "sequence, the same for every mode): requests finish at scattered steps in every mode, as "
                         "with real traffic; 0: all the same, so mode off's requests finish and are prefilled together")
    ap.add_argument("--prompt-len", type=int, default=48, help="tokens per prompt (from the eval prompts)")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--gate-decay", type=float, default=0.8, help="scheduler.draft_gate_decay of the dynamic modes")
    ap.add_argument("--tree-max-rows", type=int, default=None,
                    help="EngineConfig.tree_max_rows of the +t modes (default: the level, i.e. trees at every level)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="target and drafter weights (bfloat16: what configs/serve's dtype auto picks on a CPU with bf16)")
    ap.add_argument("--gamma", type=int, default=None, help="drafts proposed per round (default: the drafter's block size)")
    ap.add_argument("--sps-table", default=None, help='JSON {"B": steps/s} for dynamic (default: profile at start)')
    ap.add_argument("--explore-rows", type=int, default=None,
                    help="scheduler.draft_gate_explore_rows of the dynamic modes (default: the config's)")
    ap.add_argument("--gate-closed", action="store_true",
                    help="the dynamic engines' draft gate skips every step (never explores): what a skipped step "
                         "costs next to mode off's step, with nothing drafted at all")
    ap.add_argument("--out", default=None, help="write the JSON here too")
    return ap.parse_args(argv)


def prompt_ids(target, n: int, length: int) -> list[list[int]]:
    """n prompts of `length` tokens from the repo's eval prompts (chat-templated, cut or repeated)."""
    from dspark.eval.benchmark_files import parse_benchmark

    texts = [t[0] for f in sorted((REPO_ROOT / "data" / "eval").glob("*.jsonl"))
             for t in parse_benchmark(f.read_text(), str(f))]
    out = []
    for i in range(n):
        ids = target.chat_ids([{"role": "user", "content": texts[i % len(texts)]}])
        out.append((ids * (length // len(ids) + 1))[:length])
    return out


class Load:
    """One engine kept at `c` active requests."""

    def __init__(self, engine, prompts: list[list[int]], max_tokens: int, spread: float = 0.0):
        import random

        from dspark.decoding.sampling import SamplingParams

        self.engine, self.prompts, self.max_tokens = engine, prompts, max_tokens
        self.spread, self.budgets = spread, random.Random(0)  # the same budget sequence for every mode
        self.sampling, self.next = SamplingParams(temperature=1.0), 0
        self.busy_s, self.tokens, self.steps, self.skipped = 0.0, 0, 0, 0
        self.skipped_s, self.skipped_tokens = 0.0, 0  # the steps where the draft gate skipped drafting
        self.prefill_steps, self.prefill_s = 0, 0.0  # steps that admitted (prefilled) new requests

    def top_up(self, c: int) -> None:
        while len(self.engine.active) + len(self.engine.waiting) < c:
            budget = round(self.max_tokens * self.budgets.uniform(1 - self.spread, 1 + self.spread))
            self.engine.submit(self.prompts[self.next % len(self.prompts)], self.sampling, max(1, budget), stop_ids=[])
            self.next += 1

    def run(self, c: int, steps: int, timed: bool) -> None:
        for _ in range(steps):
            self.top_up(c)
            t0 = time.perf_counter()
            report = self.engine.step()
            if timed:
                dt = time.perf_counter() - t0
                self.busy_s += dt
                self.tokens += report.emitted
                self.steps += 1
                if report.admitted:
                    self.prefill_steps, self.prefill_s = self.prefill_steps + 1, self.prefill_s + dt
                if self.engine.drafting and not report.drafted:
                    self.skipped += 1
                    self.skipped_s += dt
                    self.skipped_tokens += report.emitted


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from benchmarks.serve_load import split_mode
    from dspark.decoding.engine import Engine, EngineConfig
    from dspark.decoding.scheduler import SchedulerConfig
    from dspark.drafters import load_drafter
    from dspark.models.target import load_target

    torch.set_num_threads(args.threads)
    modes = [m for m in args.modes.split(",") if m]
    levels = [int(c) for c in args.concurrency.split(",") if c]
    target = load_target(args.target, dtype=getattr(torch, args.dtype))
    drafter = load_drafter(args.drafter, target=target).to(getattr(torch, args.dtype))
    prompts = prompt_ids(target, 64, args.prompt_len)
    sps = {int(k): float(v) for k, v in json.loads(args.sps_table).items()} if args.sps_table else None
    results, tables = [], {}
    for c in levels:
        loads = {}
        for mode in modes:  # fresh engines per level: every mode starts the level from the same state
            sched, tree = split_mode(mode)
            explore = {} if args.explore_rows is None else {"draft_gate_explore_rows": args.explore_rows}
            cfg = EngineConfig(scheduler=SchedulerConfig(mode=sched, draft_gate=sched == "dynamic",
                                                         draft_gate_decay=args.gate_decay, **explore),
                               gamma=args.gamma, max_batch=c, max_waiting=4 * c, sps_table=sps or tables.get(mode),
                               draft_tree=tree,
                               tree_max_rows=args.tree_max_rows or c)
            engine = Engine(target, None if sched == "off" else drafter, cfg)
            if args.gate_closed and engine.gate is not None:
                close_gate(engine.gate)
            if engine.sps is not None:
                tables[mode] = engine.sps.points
            loads[mode] = Load(engine, prompts, args.max_tokens, args.max_tokens_spread)
            loads[mode].run(c, args.warmup, timed=False)
        turn = 0
        while min(ld.steps for ld in loads.values()) < args.steps:
            for mode in (modes if turn % 2 == 0 else modes[::-1]):
                loads[mode].run(c, min(args.chunk, args.steps - loads[mode].steps), timed=True)
            turn += 1
        for mode, ld in loads.items():
            row = {"mode": mode, "concurrency": c, "steps": ld.steps, "busy_s": round(ld.busy_s, 3),
                   "tokens": ld.tokens, "tokens_per_busy_s": ld.tokens / ld.busy_s,
                   "draft_skipped_step_fraction": ld.skipped / ld.steps if ld.engine.drafting else None,
                   # tokens per second over the skipped steps alone: what "no cost when not drafting" is about
                   "skipped_steps_tokens_per_s": ld.skipped_tokens / ld.skipped_s if ld.skipped_s else None,
                   "mean_drafted_step_s": ((ld.busy_s - ld.skipped_s) / (ld.steps - ld.skipped)
                                           if ld.engine.drafting and ld.steps > ld.skipped else None),
                   "mean_skipped_step_s": ld.skipped_s / ld.skipped if ld.skipped else None,
                   "prefill_steps": ld.prefill_steps, "prefill_s": round(ld.prefill_s, 3),
                   "engine_totals": {k: ld.engine.totals[k] for k in ("proposed", "verified", "accepted")},
                   **{k: v for k, v in ld.engine.stats().items() if k in ("draft_gate", "tree_draft_gate")}}
            results.append(row)
            print(f"[engine_ab] {mode:>8} c={c:<3} {row['tokens_per_busy_s']:7.2f} tok/busy-s  steps {ld.steps}  "
                  f"skipped {row['draft_skipped_step_fraction']}  skipped-step {row['mean_skipped_step_s']}  "
                  f"drafted-step {row['mean_drafted_step_s']}", file=sys.stderr, flush=True)
            ld.engine.stop()
        write(args, modes, levels, tables, results)  # after every level: a long run killed midway keeps its levels
    print(json.dumps(write(args, modes, levels, tables, results)))
    return 0


def close_gate(gate) -> None:
    """Make this draft gate skip every step (--gate-closed): a measurement, not a serving setting."""
    def never(n_active: int) -> bool:
        gate.exploring = False
        return gate._decide(False)

    gate.should_draft = never


def write(args, modes: list[str], levels: list[int], tables: dict, results: list[dict]) -> dict:
    ratio, skipped_ratio, over_off = {}, {}, {}
    for c in levels:
        by = {r["mode"]: r for r in results if r["concurrency"] == c}
        if "off" in by:
            for mode, row in by.items():
                over_off.setdefault(mode, {})[str(c)] = row["tokens_per_busy_s"] / by["off"]["tokens_per_busy_s"]
        if "off" in by and "dynamic" in by:
            off = by["off"]["tokens_per_busy_s"]
            ratio[str(c)] = by["dynamic"]["tokens_per_busy_s"] / off
            if by["dynamic"]["skipped_steps_tokens_per_s"]:
                skipped_ratio[str(c)] = by["dynamic"]["skipped_steps_tokens_per_s"] / off
    report = {"benchmark": "engine_ab", "target": args.target, "drafter": args.drafter, "modes": modes,
              "concurrency": levels, "steps": args.steps, "chunk": args.chunk, "max_tokens": args.max_tokens, "max_tokens_spread": args.max_tokens_spread,
              "prompt_len": args.prompt_len, "gamma": args.gamma, "threads": args.threads, "dtype": args.dtype, "tree_max_rows": args.tree_max_rows, "gate_decay": args.gate_decay,
              "gate_closed": args.gate_closed, "explore_rows": args.explore_rows,
              "sps_tables": {m: {str(b): v for b, v in t.items()} for m, t in tables.items()},
              "results": results, "over_off": over_off, "dynamic_over_off": ratio, "dynamic_skipped_steps_over_off": skipped_ratio}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    sys.exit(main())
