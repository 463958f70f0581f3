"""The GPU recipe: prompts -> rollouts -> DSpark, DFlash and Eagle3 trained in lockstep -> evaluation on
the device, in one command that fits a single <= 9 minute run on one H200 (model loading included).
(One file of ~500 lines on purpose: it is copied to a bare accelerator machine and run as one script.)

    python -m benchmarks.gpu_drafter_compare --run h200-recipe                        # on a GPU machine
    python -m benchmarks.gpu_drafter_compare --target tiny --device cpu --smoke --out /tmp/x   # CPU check
    python -m benchmarks.gpu_drafter_compare --out DIR --unpack DEST                  # unpack the drafters

No Ray, DeepSpeed or MLflow (a bare accelerator VM has torch + transformers only). Phases, each with
its own wall-clock budget so the whole run stays inside the limit:
1. prompts: the synthesis hook (`--synthesis-hook module:function`, default dspark.synthesis, called as
   fn(target=, limit=, seed=) -> list[dspark.data.prompts.Prompt]) when that module exists, else the
   repo's data/train prompts; every prompt sharing content n-grams with an evaluation prompt is
   dropped (dspark.data.decontamination);
2. rollouts: the target answers the prompts (temperature 1, batched, one sampling draw per step for
   the whole batch) until `--rollout-tokens` generated tokens or the rollout budget;
3. training: the three drafters (configs/train/<target>-<algo>.yaml `drafter:`/`optim:` sections, the
   baselines as their references train them) take the same length-bucketed batches in the same
   order, step by step, through the library's single-device step (dspark.training.loop.LocalTrainer:
   bf16 autocast on CUDA, fp32 on CPU); the step count comes from a timed probe and the budget;
4. evaluation on the device, first turn of each prompt of gsm8k, math500, humaneval, mbpp and
   mt-bench (data/eval), temperature 1: τ per benchmark, per-position conditional acceptance, batch-1
   tokens/s against target-only decoding on the same prompts and seeds; greedy equality as a
   lossless sanity check;
5. output under --out (default benchmarks/results/<run>/): recipe.json (the summary), results.json
   (everything, loss curves included), plots when matplotlib is installed, and the drafters as bf16
   checkpoints without the frozen target parts, in drafters/bundle.tar.NN parts of <= 15 MiB.
The JSON summary is the last stdout line.

Default budgets (one H200, smollm2-135m): load ~40 s, prompts + rollouts 150 s, training 170 s (the
probe included), evaluation 90 s (warm-up and greedy check included), about 8 minutes in all; each
phase stops at its deadline and records what it reached (rollout_tokens may fall short of 5 M).
"""
from __future__ import annotations

import argparse
import glob
import importlib
import io
import json
import math
import os
import random
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch
import yaml

ALGOS = ("dspark", "dflash", "eagle3")
BENCHMARKS = ("gsm8k", "math500", "humaneval", "mbpp", "mt-bench")
SYNTHESIS_HOOK = "dspark.synthesis:synthesize_prompts"
PART_BYTES = 15 * 2**20


def log(msg: str) -> None:
    print(f"[recipe {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---------------------------------------------------------------- prompts
def load_hook(spec: str):
    """`module:function` -> the function, or None when the module is not installed (the fallback)."""
    module, _, name = spec.partition(":")
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name and module.startswith(err.name):
            return None
        raise
    if not hasattr(mod, name):
        raise AttributeError(f"synthesis hook {spec!r}: module {module} has no function {name!r}")
    return getattr(mod, name)


def repo_prompts(limit: int | None) -> list:
    from dspark.data.prompts import PromptSource, load_prompts

    cfg = yaml.safe_load(open("configs/generate/smollm2-135m.yaml"))
    sources = [PromptSource(**{**s, "limit": limit}) for s in cfg["sources"]]
    loaded = load_prompts(sources, holdout_fraction=cfg["holdout_fraction"])
    return [p for p in loaded.prompts if p.split == "train"]


def eval_benchmarks(per_benchmark: int | None) -> list:
    from dspark.eval.evaluation import BenchmarkSpec, load_benchmark

    return [load_benchmark(BenchmarkSpec(path=f"{name}.jsonl"), "data/eval", per_benchmark) for name in BENCHMARKS]


def train_prompts(target, args) -> tuple[list, dict]:
    """Synthesised (hook) or repo prompts, minus those contaminated by ANY evaluation prompt."""
    from dspark.data.decontamination import Decontaminator

    hook = None if args.synthesis_hook in ("", "none") else load_hook(args.synthesis_hook)
    if hook is not None:
        prompts, source = list(hook(target=target, limit=args.synth_prompts, seed=args.seed)), args.synthesis_hook
    else:
        prompts, source = repo_prompts(args.prompt_limit), "data/train"
    evals = [turn for bench in eval_benchmarks(None) for turns in bench.prompts for turn in turns]
    kept, dropped = Decontaminator(evals, n=args.decontam_ngram).split(prompts, lambda p: "\n".join(p.turns))
    info = {"source": source, "prompts": len(kept), "dropped_contaminated": len(dropped),
            "decontam_ngram": args.decontam_ngram}
    log(f"prompts: {len(kept)} from {source} ({len(dropped)} dropped as contaminated)")
    return kept, info


# ---------------------------------------------------------------- rollouts
def fast_engine(target, sampling):
    """pipelines.rollout.RolloutEngine drawing ONE multinomial per step for the whole batch (seeded from
    the batch's first row) instead of one per row: per-row generators cost a kernel launch per row per
    step, which dominates at batch 1024; training data needs no per-row reproducibility."""
    from transformers import LogitsProcessor

    from dspark.decoding.sampling import to_probs
    from dspark.data.rollout_engine import RolloutEngine

    class BatchSampler(LogitsProcessor):
        def __init__(self, sp, generators):
            self.sp, self.generator = sp, generators[0]

        def __call__(self, input_ids, scores):
            pick = torch.multinomial(to_probs(scores, self.sp), 1, generator=self.generator)
            return torch.full_like(scores, float("-inf")).scatter_(1, pick, 0.0)

    engine = RolloutEngine(target, sampling)
    engine._sampler = BatchSampler
    return engine


def generate_rollouts(target, prompts: list, args, deadline: float) -> list[dict]:
    """Answer passes over the prompts (pass s: seed s, prompt ids suffixed so rows differ) until
    `--rollout-tokens` generated tokens, `--max-samples` passes or the deadline; batches sorted by
    prompt length (less left padding)."""
    from dspark.data.rollout_engine import SamplingConfig

    rows, generated = [], 0
    ordered = sorted(prompts, key=lambda p: sum(len(t) for t in p.turns))
    for s in range(args.max_samples):
        sampling = SamplingConfig(temperature=args.rollout_temperature, top_p=1.0,
                                  max_new_tokens=args.rollout_max_new, seed=args.seed + s)
        engine = fast_engine(target, sampling)
        for i in range(0, len(ordered), args.rollout_batch):
            chunk = [dict(p.as_row(), prompt_id=f"{p.prompt_id}#s{s}", chunk=s)
                     for p in ordered[i:i + args.rollout_batch]]
            done = [r for r in engine.run(chunk) if r["error_reason"] is None and r["num_generated_tokens"] > 0]
            rows += done
            generated += sum(r["num_generated_tokens"] for r in done)
            if generated >= args.rollout_tokens or time.time() > deadline:
                log(f"rollouts: {len(rows)} sequences, {generated} generated tokens (pass {s + 1})")
                return rows
        log(f"rollouts: pass {s + 1} done, {len(rows)} sequences, {generated} generated tokens")
    return rows


# ---------------------------------------------------------------- training (the library step)
def load_recipe(target_name: str, algo: str) -> tuple[dict, dict, int]:
    path = f"configs/train/{'smollm2-135m' if target_name == 'smollm2-135m' else 'tiny'}-{algo}.yaml"
    cfg = yaml.safe_load(open(path))
    return cfg["drafter"], cfg["optim"], cfg["data"]["max_seq_len"]


def batch_stream(rows: list[dict], args, max_len: int, pad_id: int):
    """Endless (epoch, collated batch, index batch): a new permutation per epoch, length-bucketed in
    windows of `--bucket-window` batches (dspark.training.batching); identical for every drafter."""
    from dspark.training.batching import bucketed_batches, collate

    lengths = [min(len(r["input_ids"]), max_len) for r in rows]
    rng, epoch = random.Random(args.seed), 0
    while True:
        order = list(range(len(rows)))
        rng.shuffle(order)
        for pick in bucketed_batches(order, lengths, args.batch_size, args.bucket_window, args.seed + epoch):
            batch = collate({"input_ids": [rows[j]["input_ids"] for j in pick],
                             "loss_mask": [rows[j]["loss_mask"] for j in pick]}, max_len, pad_id)
            yield epoch, batch
        epoch += 1


def build_trainers(target, args, precision: str) -> tuple[dict, dict]:
    from dspark.drafters import build_drafter
    from dspark.drafters.config import DrafterConfig
    from dspark.training.loop import LocalTrainer
    from dspark.training.config import OptimSection

    recipes, trainers = {}, {}
    for algo in ALGOS:
        drafter_cfg, optim, max_len = load_recipe(args.target, algo)
        optim = {**optim, "lr": args.lr or optim["lr"]}
        recipes[algo] = {"drafter": drafter_cfg, "optim": optim, "max_seq_len": max_len}
        torch.manual_seed(args.seed)
        drafter = build_drafter(DrafterConfig(**drafter_cfg), target)
        trainers[algo] = LocalTrainer(algo, target, drafter, OptimSection(**optim), precision)
    return trainers, recipes


def chunks_for(trainer, args) -> int:
    """Dense TTT (Eagle3) supervises every position × ttt_steps over the full vocabulary: split its batch."""
    return args.eagle3_chunks if trainer.drafter.trains_every_position else 1


def train_all(target, rows: list[dict], args, precision: str, deadline: float) -> tuple[dict, dict]:
    from dspark.training.batching import bucketed_batches, padding_fraction
    from dspark.training.loop import flops_rates

    trainers, recipes = build_trainers(target, args, precision)
    max_len = args.max_seq_len or recipes["dspark"]["max_seq_len"]
    stream = batch_stream(rows, args, max_len, target.pad_token_id)
    probe = next(stream)[1]
    per_algo_s = {}
    for algo, t in trainers.items():  # timed probe: forward + backward, no update
        t.step(probe, 0, update=False, chunks=chunks_for(t, args))
        sync(args.device)
        start = time.perf_counter()
        t.step(probe, 1, update=False, chunks=chunks_for(t, args))
        sync(args.device)
        per_algo_s[algo] = time.perf_counter() - start
    budget = max(0.0, deadline - time.time())
    steps = max(1, min(args.max_steps, int(budget / sum(per_algo_s.values()))))
    log(f"probe s/step {json.dumps({k: round(v, 4) for k, v in per_algo_s.items()})}: {steps} lockstep steps "
        f"(batch {args.batch_size}, max_len {max_len}, {precision})")
    for t in trainers.values():
        t.set_schedule(steps)
    busy = {a: 0.0 for a in ALGOS}
    totals = {a: {"tokens": 0.0, "flops": 0.0} for a in ALGOS}
    start, epoch = time.time(), 0
    for step in range(steps):
        epoch, batch = next(stream)
        last = {}
        for algo, t in trainers.items():
            t0 = time.perf_counter()
            last[algo] = t.step(batch, args.seed * 1_000_003 + step, chunks=chunks_for(t, args))
            sync(args.device)
            busy[algo] += time.perf_counter() - t0
            totals[algo]["tokens"] += last[algo]["tokens"]
            totals[algo]["flops"] += last[algo]["flops"]
        if step % args.log_every == 0 or step == steps - 1:
            for algo, m in last.items():
                trainers[algo].curve.append({"step": step + 1, "epoch": epoch,
                                             **{k: round(v, 5) for k, v in m.items() if k != "flops"}})
            log(f"step {step + 1}/{steps} epoch {epoch} " + "  ".join(
                f"{a}: loss {m['loss']:.3f} E[len] {m.get('expected_accept_len', math.nan):.2f}" for a, m in last.items()))
    lengths = [min(len(r["input_ids"]), max_len) for r in rows]
    order = list(range(len(rows)))
    random.Random(args.seed).shuffle(order)
    info = {"steps": steps, "epochs": epoch + 1, "batch_size": args.batch_size, "max_seq_len": max_len,
            "precision": precision, "probe_s_per_step": per_algo_s, "train_wall_s": time.time() - start,
            "padding_fraction": {"unbucketed": padding_fraction(bucketed_batches(order, lengths, args.batch_size, 1, 0),
                                                                lengths),
                                 "bucketed": padding_fraction(bucketed_batches(order, lengths, args.batch_size,
                                                                               args.bucket_window, args.seed),
                                                              lengths)},
            "throughput": {a: {"tokens_per_s": totals[a]["tokens"] / max(busy[a], 1e-9),
                               **flops_rates(totals[a]["flops"], busy[a], args.device, precision)}
                           for a in ALGOS},
            "sequences_per_drafter": steps * args.batch_size,
            "curves": {a: t.curve for a, t in trainers.items()}, "recipes": recipes}
    for t in trainers.values():
        t.drafter.eval()
    return {a: t.drafter for a, t in trainers.items()}, info


# ---------------------------------------------------------------- evaluation on the device
def evaluate(target, drafters: dict, args, deadline: float) -> dict:
    """τ per benchmark and per-position acceptance at temperature 1, batch-1 tokens/s against
    target-only decoding (same prompts, same seeds, after one warm-up run per mode); prompts are taken
    round-robin over the benchmarks so a deadline cuts every benchmark alike."""
    from dspark.eval import metrics
    from dspark.decoding.sampling import SamplingParams
    from dspark.decoding.specdec import speculative_generate, target_generate

    benches = eval_benchmarks(args.eval_prompts)
    queue = [(b.name, i, target.chat_ids([{"role": "user", "content": b.prompts[i][0]}], add_generation_prompt=True))
             for i in range(max(len(b.prompts) for b in benches)) for b in benches if i < len(b.prompts)]
    greedy, sampled = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)
    modes = ("target",) + tuple(drafters)

    def run(mode, ids, sp, seed, max_new):
        g = torch.Generator(device=target.device).manual_seed(seed)
        with torch.no_grad():
            if mode == "target":
                return target_generate(target, ids, sp, max_new, generator=g)
            return speculative_generate(target, drafters[mode], ids, sp, max_new, generator=g)

    out = {"greedy_equal": {}, "tokens": {m: 0 for m in modes}, "wall_s": {m: 0.0 for m in modes}}
    ref = run("target", queue[0][2], greedy, 0, args.greedy_check_tokens).token_ids
    for mode in drafters:
        out["greedy_equal"][mode] = run(mode, queue[0][2], greedy, 0, args.greedy_check_tokens).token_ids == ref
    for mode in modes:  # warm-up: kernels, allocator, caches
        run(mode, queue[0][2], sampled, 1, 16)
    rounds = {m: {b.name: [] for b in benches} for m in drafters}
    done = 0
    for q, (bench, _, ids) in enumerate(queue):
        if time.time() > deadline:
            break
        for mode in modes:  # the same seed for every mode: target-only and speculative runs are comparable
            res = run(mode, ids, sampled, args.seed * 7919 + q, args.max_new_tokens)
            out["tokens"][mode] += len(res.token_ids)
            out["wall_s"][mode] += res.wall_s
            if mode != "target":
                rounds[mode][bench] += res.rounds
        done += 1
    rate = {m: out["tokens"][m] / max(out["wall_s"][m], 1e-9) for m in modes}
    out["tokens_per_s_batch1"] = rate
    out["speedup_batch1"] = {a: rate[a] / rate["target"] for a in drafters}
    out["tau"] = {a: {b: metrics.summarize(r)["tau"] for b, r in per.items() if r} for a, per in rounds.items()}
    out["tau_mean"] = {a: sum(v.values()) / len(v) if v else None for a, v in out["tau"].items()}
    pooled = {a: metrics.summarize([x for r in per.values() for x in r]) for a, per in rounds.items()}
    # P(draft k accepted | drafts 1..k-1 accepted), k = 1..γ (None where no round reached k)
    out["accept_by_position"] = {a: [s["cond_accept"][k] for k in sorted(s["cond_accept"])] for a, s in pooled.items()}
    out["prompts_evaluated"], out["prompts_planned"] = done, len(queue)
    return out


# ---------------------------------------------------------------- outputs
def write_drafters(drafters: dict, out: Path) -> list[str]:
    """bf16 checkpoints (the frozen target embedding / LM head are never part of a drafter's state) in
    one tar split into PART_BYTES parts under out/drafters/."""
    from dspark.drafters import save_drafter

    dest = out / "drafters"
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for algo, drafter in drafters.items():
            save_drafter(drafter, os.path.join(tmp, algo))
            _to_bf16(os.path.join(tmp, algo, "model.safetensors"))
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            tar.add(tmp, arcname="bundle")
    data, parts = buf.getvalue(), []
    for i in range(0, len(data), PART_BYTES):
        part = dest / f"bundle.tar.{i // PART_BYTES:02d}"
        part.write_bytes(data[i:i + PART_BYTES])
        parts.append(f"drafters/{part.name}")
    return parts


def _to_bf16(path: str) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(path)
    save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()}, path,
              metadata={"format": "pt", "dspark": "dspark-drafter"})


def unpack(out_dir: str, dest: str) -> None:
    parts = sorted(glob.glob(os.path.join(out_dir, "drafters", "bundle.tar.*")))
    data = b"".join(Path(p).read_bytes() for p in parts)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(dest, filter="data")
    print(json.dumps({"unpacked": sorted(os.listdir(os.path.join(dest, "bundle")))}))


def write_plots(results: dict, out: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    ev, made = results.get("eval") or {}, []
    if ev.get("tau"):
        fig, ax = plt.subplots(figsize=(8, 4))
        width = 0.8 / len(ev["tau"])
        for j, (algo, per) in enumerate(ev["tau"].items()):
            names = [b for b in BENCHMARKS if b in per]
            ax.bar([i + j * width for i in range(len(names))], [per[b] for b in names], width, label=algo)
            ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names)
        ax.set_ylabel("τ (temperature 1)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "tau_by_benchmark.png", dpi=120)
        made.append("tau_by_benchmark.png")
        plt.close(fig)
    if ev.get("accept_by_position"):
        fig, ax = plt.subplots(figsize=(6, 4))
        for algo, acc in ev["accept_by_position"].items():
            ks = [k for k, v in enumerate(acc, start=1) if v is not None]
            ax.plot(ks, [acc[k - 1] for k in ks], marker="o", label=algo)
        ax.set_xlabel("draft position k")
        ax.set_ylabel("P(accept k | accepted < k)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "accept_by_position.png", dpi=120)
        made.append("accept_by_position.png")
        plt.close(fig)
    curves = results["training"]["curves"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for algo, curve in curves.items():
        ax.plot([c["step"] for c in curve], [c.get("expected_accept_len", math.nan) for c in curve], label=algo)
    ax.set_xlabel("step")
    ax.set_ylabel("E[accept length] (train batches)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "train_accept_len.png", dpi=120)
    plt.close(fig)
    return made + ["train_accept_len.png"]


def summary_of(results: dict) -> dict:
    ev, tr = results.get("eval") or {}, results["training"]
    return {"device": results["device"], "target": results["target"],
            "rollout_tokens": results["rollouts"]["generated_tokens"],
            "tau": ev.get("tau"), "tau_mean": ev.get("tau_mean"), "speedup_batch1": ev.get("speedup_batch1"),
            "accept_by_position": ev.get("accept_by_position"), "greedy_equal": ev.get("greedy_equal"),
            "train_steps": tr["steps"], "train_epochs": tr["epochs"], "precision": tr["precision"],
            "padding_fraction": tr["padding_fraction"], "train_throughput": tr["throughput"],
            "phases_s": results["phases_s"], "total_s": results.get("total_s"), "drafters": results.get("drafters"),
            "eval_error": ev.get("error")}


# ---------------------------------------------------------------- main
def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--device", default="cuda")
    p.add_argument("--run", default=None, help="run name: output under benchmarks/results/<run>/")
    p.add_argument("--out", default=None, help="output directory (overrides --run)")
    p.add_argument("--synthesis-hook", default=SYNTHESIS_HOOK, help="module:function, or 'none' for data/train")
    p.add_argument("--synth-prompts", type=int, default=20000, help="prompts asked of the synthesis hook")
    p.add_argument("--prompt-limit", type=int, default=None, help="records read per data/train source")
    p.add_argument("--decontam-ngram", type=int, default=8)
    p.add_argument("--rollout-tokens", type=int, default=5_000_000, help="generated tokens to collect")
    p.add_argument("--max-samples", type=int, default=64, help="answer passes over the prompts at most")
    p.add_argument("--rollout-max-new", type=int, default=320)
    p.add_argument("--rollout-batch", type=int, default=1024)
    p.add_argument("--rollout-temperature", type=float, default=1.0)
    p.add_argument("--rollout-budget-s", type=float, default=150)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--bucket-window", type=int, default=16, help="batches per length-bucketing window")
    p.add_argument("--eagle3-chunks", type=int, default=4, help="micro batches per Eagle3 step (memory)")
    p.add_argument("--max-seq-len", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--precision", default="auto", choices=("auto", "bf16", "fp32"))
    p.add_argument("--max-steps", type=int, default=100_000)
    p.add_argument("--train-budget-s", type=float, default=170)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--eval-prompts", type=int, default=6, help="per benchmark")
    p.add_argument("--eval-budget-s", type=float, default=90)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--greedy-check-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="tiny sizes for a CPU check of the whole flow")
    p.add_argument("--unpack", metavar="DEST", help="join drafters/bundle.tar.* in --out and unpack into DEST")
    args = p.parse_args(argv)
    if args.smoke:
        args.synthesis_hook, args.prompt_limit, args.rollout_tokens, args.max_samples = "none", 4, 400, 1
        args.rollout_max_new, args.batch_size, args.max_steps, args.log_every = 24, 4, 3, 1
        args.eval_prompts, args.max_new_tokens, args.greedy_check_tokens, args.eagle3_chunks = 1, 12, 12, 2
        args.max_seq_len = args.max_seq_len or 96
    args.out = args.out or f"benchmarks/results/{args.run or 'recipe-' + args.target}"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.unpack:
        unpack(args.out, args.unpack)
        return 0
    from dspark.models.target import load_target
    from dspark.training.loop import resolve_precision

    t0 = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    precision = resolve_precision(args.device, args.precision)
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    target = load_target(args.target, device=args.device,
                         dtype=torch.bfloat16 if precision == "bf16" else torch.float32)
    target.model.eval()
    phases = {"load": time.time() - t0}
    results = {"target": args.target, "torch": torch.__version__, "phases_s": phases,
               "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"}
    log(f"target {args.target} on {results['device']} ({precision}) in {phases['load']:.1f}s")

    t = time.time()
    prompts, results["prompts"] = train_prompts(target, args)
    rows = generate_rollouts(target, prompts, args, t + args.rollout_budget_s)
    phases["prompts_rollouts"] = time.time() - t
    results["rollouts"] = {"sequences": len(rows), "generated_tokens": sum(r["num_generated_tokens"] for r in rows),
                           "tokens": sum(len(r["input_ids"]) for r in rows), "wall_s": phases["prompts_rollouts"]}
    t = time.time()
    drafters, results["training"] = train_all(target, rows, args, precision, t + args.train_budget_s)
    phases["train"] = time.time() - t
    results["drafters"] = write_drafters(drafters, out)  # first: a failing evaluation loses nothing
    t = time.time()
    try:
        results["eval"] = evaluate(target, drafters, args, t + args.eval_budget_s)
    except Exception as err:  # noqa: BLE001 — recorded; the drafters are already written
        results["eval"] = {"error": f"{type(err).__name__}: {err}"}
    phases["eval"] = time.time() - t
    results["plots"] = write_plots(results, out)
    results["total_s"] = time.time() - t0
    summary = summary_of(results)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=_json_default))
    (out / "recipe.json").write_text(json.dumps(summary, indent=1, default=_json_default))
    print(json.dumps(summary, default=_json_default))
    return 0


def _json_default(x):
    if isinstance(x, float) and math.isnan(x):
        return None
    return str(x)


if __name__ == "__main__":
    sys.exit(main())
