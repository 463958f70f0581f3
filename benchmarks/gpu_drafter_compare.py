"""Same data, same budget: train DSpark, DFlash and Eagle3 drafters for one target on one GPU.

    python -m benchmarks.gpu_drafter_compare --out results/gpu-compare            # on a GPU machine
    python -m benchmarks.gpu_drafter_compare --target tiny --device cpu --smoke --out /tmp/x   # CPU check

What it does, in one process (no Ray, no DeepSpeed: for a single GPU box or a bare accelerator VM):
1. rollouts: the target answers every training prompt (data/train, the train split; held-out prompts
   are left for calibration) `--samples` times with different seeds (pipelines.rollout_engine.RolloutEngine);
2. training: the three drafters (configs/train/<target>-<algo>.yaml `drafter:` sections) train on the
   same batches in the same order, interleaved step by step, so a wall-clock budget cuts all three at
   the same step count. The step count is fixed up front from a timed probe of each drafter's step;
   optimiser, schedule, batch and clipping are identical (the configs' `optim:` values);
3. checks on the device: greedy speculative output == greedy target-only output for every drafter;
   τ at temperature 1 on a few eval prompts (a small sample; the real comparison is jobs.evaluate);
4. output: results.json (timings, step counts, loss curves, checks), the drafter checkpoints
   (HF-style, weights stored as bf16 to keep the bundle small) in bundle.tar split into <=15 MiB parts,
   and the rollouts as Parquet. `--unpack DIR` joins and unpacks a bundle into DIR.
JSON summary on the last stdout line.
"""
from __future__ import annotations

import argparse
import glob
import io
import json
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
PART_BYTES = 15 * 2**20


def log(msg: str) -> None:
    print(f"[gpu-compare {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------- rollouts
def train_prompts(limit: int | None) -> list:
    from pipelines.prompts import PromptSource, load_prompts

    cfg = yaml.safe_load(open("configs/generate/smollm2-135m.yaml"))
    sources = [PromptSource(**{**s, "limit": limit}) for s in cfg["sources"]]
    loaded = load_prompts(sources, holdout_fraction=cfg["holdout_fraction"])
    return [p for p in loaded.prompts if p.split == "train"]


def generate_rollouts(target, prompts: list, samples: int, max_new: int, batch: int, deadline: float) -> list[dict]:
    """`samples` answers per prompt (seed s for sample s); stops adding samples past `deadline`."""
    from pipelines.rollout_engine import RolloutEngine, SamplingConfig

    rows = []
    for s in range(samples):
        engine = RolloutEngine(target, SamplingConfig(temperature=0.7, top_p=0.9, max_new_tokens=max_new, seed=s))
        for i in range(0, len(prompts), batch):
            chunk = [dict(p.as_row(), chunk=s) for p in prompts[i:i + batch]]
            rows += [r for r in engine.run(chunk) if r["error_reason"] is None]
        log(f"rollouts: sample {s + 1}/{samples} done, {len(rows)} sequences, "
            f"{sum(r['num_generated_tokens'] for r in rows)} generated tokens")
        if time.time() > deadline:
            log("rollout time budget spent: no more samples")
            break
    return rows


# ---------------------------------------------------------------- training
def load_recipe(target_name: str, algo: str) -> tuple[dict, dict, int]:
    path = f"configs/train/{'smollm2-135m' if target_name == 'smollm2-135m' else 'tiny'}-{algo}.yaml"
    cfg = yaml.safe_load(open(path))
    return cfg["drafter"], cfg["optim"], cfg["data"]["max_seq_len"]


class Trainee:
    """One drafter with its optimiser; `step` does forward, backward, clip and an optimiser step."""

    def __init__(self, algo: str, target, drafter_cfg: dict, optim: dict, seed: int):
        from dspark.drafters import build_drafter
        from dspark.drafters.config import DrafterConfig

        from jobs.train import OptimSection

        torch.manual_seed(seed)
        self.algo, self.target = algo, target
        self.optim_cfg = cfg = OptimSection(**optim)  # the training job's optimiser section and defaults
        self.drafter = build_drafter(DrafterConfig(**drafter_cfg), target)
        self.drafter.train()
        self.params = [p for p in self.drafter.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                                     weight_decay=cfg.weight_decay)
        self.sched = None
        self.curve: list[dict] = []

    def set_schedule(self, total_steps: int) -> None:
        from dspark.training.lr_schedule import build_scheduler

        cfg = self.optim_cfg
        self.sched = build_scheduler(self.opt, total_steps, cfg.warmup_ratio, cfg.schedule, cfg.min_lr_ratio)

    def step(self, batch: dict, seed: int, update: bool = True) -> dict:
        from dspark.training.loss import drafter_loss

        out = drafter_loss(self.drafter, self.target, batch["input_ids"], batch["loss_mask"],
                           batch["attention_mask"], torch.Generator().manual_seed(seed))
        out.loss.backward()
        if update:
            if self.optim_cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.params, self.optim_cfg.grad_clip)
            self.opt.step()
            self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return out.metrics


def batches(rows: list[dict], batch_size: int, max_len: int, pad_id: int, seed: int):
    """Endless shuffled batches (a new permutation per epoch), identical for every drafter."""
    from jobs.train_worker import collate

    rng, epoch = random.Random(seed), 0
    while True:
        order = list(range(len(rows)))
        rng.shuffle(order)
        for i in range(0, len(order) - batch_size + 1, batch_size):
            pick = [rows[j] for j in order[i:i + batch_size]]
            yield epoch, collate({"input_ids": [r["input_ids"] for r in pick],
                                  "loss_mask": [r["loss_mask"] for r in pick]}, max_len, pad_id)
        epoch += 1


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def train_all(target, rows: list[dict], args) -> tuple[dict, dict]:
    recipes = {a: load_recipe(args.target, a) for a in ALGOS}
    max_len = args.max_seq_len or recipes["dspark"][2]
    trainees = {a: Trainee(a, target, recipes[a][0], {**recipes[a][1], "lr": args.lr or recipes[a][1]["lr"]},
                           args.seed) for a in ALGOS}
    stream = batches(rows, args.batch_size, max_len, target.pad_token_id, args.seed)
    probe_batch = next(stream)[1]
    per_algo_s = {}
    for algo, t in trainees.items():  # timed probe: forward + backward, no update
        t.step(probe_batch, 0, update=False)
        sync(args.device)
        start = time.perf_counter()
        for i in range(2):
            t.step(probe_batch, i, update=False)
        sync(args.device)
        per_algo_s[algo] = (time.perf_counter() - start) / 2
    round_s = sum(per_algo_s.values())
    steps = max(1, min(args.max_steps, int(args.train_budget_s / round_s)))
    log(f"probe: s/step {json.dumps({k: round(v, 4) for k, v in per_algo_s.items()})}; "
        f"training {steps} steps each (batch {args.batch_size}, max_len {max_len})")
    for t in trainees.values():
        t.set_schedule(steps)
    start, last = time.time(), {}
    for step in range(steps):
        epoch, batch = next(stream)
        for algo, t in trainees.items():
            last[algo] = t.step(batch, args.seed * 1_000_003 + step)
        if step % args.log_every == 0 or step == steps - 1:
            for algo, m in last.items():
                trainees[algo].curve.append({"step": step + 1, "epoch": epoch, **{k: round(v, 5) for k, v in m.items()}})
            log(f"step {step + 1}/{steps} epoch {epoch} " + "  ".join(
                f"{a}: loss {m['loss']:.3f} acc {m['token_acc']:.3f} E[len] {m['expected_accept_len']:.2f}"
                for a, m in last.items()))
    sync(args.device)
    info = {"steps": steps, "batch_size": args.batch_size, "max_seq_len": max_len, "probe_s_per_step": per_algo_s,
            "train_wall_s": time.time() - start, "sequences_per_drafter": steps * args.batch_size,
            "curves": {a: t.curve for a, t in trainees.items()},
            "drafter_configs": {a: recipes[a][0] for a in ALGOS},
            "optim": {a: {**recipes[a][1], "lr": args.lr or recipes[a][1]["lr"]} for a in ALGOS}}
    for t in trainees.values():
        t.drafter.eval()
    return {a: t.drafter for a, t in trainees.items()}, info


# ---------------------------------------------------------------- checks on the device
def eval_prompts(per_benchmark: int) -> dict[str, list[list[str]]]:
    from dspark.evaluation import BenchmarkSpec, load_benchmark

    benches = [load_benchmark(BenchmarkSpec(path=f"{name}.jsonl"), "data/eval", per_benchmark)
               for name in ("gsm8k", "humaneval", "mt-bench")]
    return {b.name: b.prompts for b in benches}


def device_checks(target, drafters: dict, args) -> dict:
    """Greedy equality (lossless sanity on this device) and a small temperature-1 τ sample."""
    from dspark.sampling import SamplingParams
    from dspark.specdec import speculative_generate, target_generate

    prompts = eval_prompts(args.eval_prompts)
    greedy, sampled = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)
    out = {"greedy_equal": {}, "tau_t1": {}, "speedup_t1": {}}
    first = [target.chat_ids([{"role": "user", "content": turns[0]}], add_generation_prompt=True)
             for bench in prompts.values() for turns in bench]
    with torch.no_grad():
        reference = [target_generate(target, ids, greedy, 48).token_ids for ids in first[:3]]  # once, for all drafters
        for algo, drafter in drafters.items():
            out["greedy_equal"][algo] = all(speculative_generate(target, drafter, ids, greedy, 48).token_ids == ref
                                            for ids, ref in zip(first, reference))
    from dspark import metrics

    for mode in ("target",) + tuple(drafters):
        rounds, tokens, wall = [], 0, 0.0
        for i, ids in enumerate(first):
            g = torch.Generator(device=target.device).manual_seed(args.seed + i)
            with torch.no_grad():
                res = (target_generate(target, ids, sampled, args.max_new_tokens, generator=g) if mode == "target" else
                       speculative_generate(target, drafters[mode], ids, sampled, args.max_new_tokens, generator=g))
            rounds += res.rounds
            tokens += len(res.token_ids)
            wall += res.wall_s
        out["speedup_t1"][mode] = tokens / wall
        if mode != "target":
            out["tau_t1"][mode] = metrics.summarize(rounds)["tau"]
    base = out["speedup_t1"].pop("target")
    out["speedup_t1"] = {a: v / base for a, v in out["speedup_t1"].items()}
    out["eval_prompts"] = len(first)
    return out


# ---------------------------------------------------------------- bundle
def write_bundle(drafters: dict, rows: list[dict], out: Path) -> list[str]:
    """Checkpoints (bf16 weights) + rollouts in one tar, split into PART_BYTES parts."""
    from dspark.drafters import save_drafter

    with tempfile.TemporaryDirectory() as tmp:
        for algo, drafter in drafters.items():
            save_drafter(drafter, os.path.join(tmp, algo))
            _to_bf16(os.path.join(tmp, algo, "model.safetensors"))
        _write_rollouts(rows, os.path.join(tmp, "rollouts.parquet"))
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            tar.add(tmp, arcname="bundle")
    data, parts = buf.getvalue(), []
    for i in range(0, len(data), PART_BYTES):
        part = out / f"bundle.tar.{i // PART_BYTES:02d}"
        part.write_bytes(data[i:i + PART_BYTES])
        parts.append(part.name)
    return parts


def _to_bf16(path: str) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(path)
    save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()}, path,
              metadata={"format": "pt", "dspark": "dspark-drafter"})


def _write_rollouts(rows: list[dict], path: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    keep = ("prompt_id", "domain", "split", "input_ids", "loss_mask", "num_generated_tokens", "chunk")
    table = pa.table({k: [r[k] for r in rows] for k in keep})
    pq.write_table(table, path, compression="zstd")


def unpack(parts_dir: str, dest: str) -> None:
    data = b"".join(Path(p).read_bytes() for p in sorted(glob.glob(os.path.join(parts_dir, "bundle.tar.*"))))
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(dest, filter="data")
    print(json.dumps({"unpacked": sorted(os.listdir(os.path.join(dest, "bundle")))}))


# ---------------------------------------------------------------- main
def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default="results/gpu-compare")
    p.add_argument("--samples", type=int, default=4, help="answers per training prompt")
    p.add_argument("--rollout-max-new", type=int, default=256)
    p.add_argument("--rollout-batch", type=int, default=256)
    p.add_argument("--rollout-budget-s", type=float, default=150)
    p.add_argument("--prompt-limit", type=int, default=None, help="records read per source (smoke runs)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-seq-len", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--max-steps", type=int, default=3000)
    p.add_argument("--train-budget-s", type=float, default=240)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--eval-prompts", type=int, default=2, help="per benchmark, for the on-device τ sample")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="tiny sizes for a CPU check of the whole flow")
    p.add_argument("--unpack", metavar="DEST", help="join bundle.tar.* in --out and unpack into DEST")
    args = p.parse_args(argv)
    if args.smoke:
        args.samples, args.rollout_max_new, args.prompt_limit, args.batch_size = 1, 24, 4, 4
        args.max_steps, args.log_every, args.eval_prompts, args.max_new_tokens = 3, 1, 1, 16
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.unpack:
        unpack(args.out, args.unpack)
        return 0
    from dspark.target import load_target

    t0 = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    target = load_target(args.target, device=args.device)
    target.model.eval()
    results = {"target": args.target, "device": args.device, "torch": torch.__version__,
               "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
               "load_s": time.time() - t0}
    log(f"target {args.target} on {args.device} in {results['load_s']:.1f}s")
    prompts = train_prompts(args.prompt_limit)
    t1 = time.time()
    rows = generate_rollouts(target, prompts, args.samples, args.rollout_max_new, args.rollout_batch,
                             t1 + args.rollout_budget_s)
    results["rollouts"] = {"prompts": len(prompts), "sequences": len(rows), "wall_s": time.time() - t1,
                           "generated_tokens": sum(r["num_generated_tokens"] for r in rows),
                           "tokens": sum(len(r["input_ids"]) for r in rows)}
    drafters, results["training"] = train_all(target, rows, args)
    results["bundle"] = write_bundle(drafters, rows, out)  # first: a failing or slow check loses nothing
    (out / "results.json").write_text(json.dumps(results, indent=1))
    try:
        results["checks"] = device_checks(target, drafters, args)
    except Exception as err:  # noqa: BLE001 — recorded, the checkpoints are already written
        results["checks"] = {"error": f"{type(err).__name__}: {err}"}
    log(f"checks: {json.dumps(results['checks'])}")
    results["total_s"] = time.time() - t0
    (out / "results.json").write_text(json.dumps(results, indent=1))
    summary = {k: results[k] for k in ("target", "device", "gpu", "rollouts", "checks", "bundle", "total_s")}
    summary["steps"] = results["training"]["steps"]
    summary["final"] = {a: c[-1] for a, c in results["training"]["curves"].items()}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
