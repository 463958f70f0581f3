"""Training throughput: padded vs length-bucketed batches and fp32 vs bf16 (--compare, one process), or
jobs.train per DeepSpeed ZeRO stage (default), each measured side by side in one run.

    python benchmarks/train_throughput.py --compare --quick   # tiny target: padded vs bucketed (+ bf16 on CUDA)
    python benchmarks/train_throughput.py --compare --config configs/train/smollm2-135m-dspark.yaml
    python benchmarks/train_throughput.py                  # smollm2-135m, ZeRO 0, 2 and 3, 2 CPU workers
    python benchmarks/train_throughput.py --quick          # the tiny target (a smoke check, seconds per stage)
    python benchmarks/train_throughput.py --stages 2,3 --steps 6 --seq-len 512 --gpu --workers 8
    python benchmarks/train_throughput.py --stages 2 --seq-len 384 --target-forward-dtypes same,auto  # bf16 forward

Each stage is a full Ray Train run (TorchTrainer, DeepSpeed, target features computed online) of
`--steps` optimizer steps on the same synthetic rollouts (random tokens, a quarter prompt and three
quarters supervised: content does not change the cost), starting from the drafter recipe in
`--config`. Reported per stage: training tokens/s over all workers (tokens = non-padding tokens the
target and drafter process; the first step of each run, with its start-up, is excluded), tokens/s per
worker, seconds per optimizer step, and peak memory per worker (max RSS on CPU, max allocated on GPU;
the maximum over workers). Checkpoints go to a temporary directory; MLflow is off. The last stdout
line is one JSON object.

--compare runs the library's single-device step (dspark.training.loop.LocalTrainer, as the GPU recipe)
on rollouts of random lengths (uniform in [--min-len, --seq-len], a quarter prompt): the same rows
grouped as they come (padded to each batch's longest row) and length-bucketed (dspark.training.batching,
--bucket-window batches per window), in fp32, and in bf16 too on CUDA. Reported per variant:
training tokens/s (non-padding tokens; the first step is not timed), the padding share of the
processed positions, model TFLOP/s and MFU where the device's peak is known. The two groupings'
steps are interleaved (ABBA), so load changes on a shared machine do not favour either.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=None, help="train config whose target and drafter are used "
                                                   "(default configs/train/smollm2-135m-dspark.yaml; --quick: tiny)")
    ap.add_argument("--stages", default="0,2,3", help="comma-separated ZeRO stages")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=2, help="sequences per worker per micro batch")
    ap.add_argument("--accum", type=int, default=1, help="micro batches per optimizer step")
    ap.add_argument("--cpus-per-worker", type=float, default=None,
                    help="CPUs reserved per worker (default: the local Ray's CPUs less one, shared by the workers)")
    ap.add_argument("--torch-threads", type=int, default=None, help="torch threads per worker (default: Ray's, see "
                                                                    "scaling.torch_threads)")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps per stage (the first is not timed)")
    ap.add_argument("--target-forward-dtypes", default="same",
                    help="comma-separated target_forward_dtype values run per stage, side by side (e.g. same,auto: "
                         "the frozen target forward in fp32 vs a bf16 copy)")
    ap.add_argument("--gpu", action="store_true", help="one GPU per worker, bf16")
    ap.add_argument("--quick", action="store_true", help="tiny target, 3 steps, 128 tokens")
    ap.add_argument("--compare", action="store_true", help="padded vs bucketed (and fp32 vs bf16 on CUDA), one process")
    ap.add_argument("--min-len", type=int, default=32, help="--compare: shortest rollout")
    ap.add_argument("--bucket-window", type=int, default=16, help="--compare: batches per bucketing window")
    ap.add_argument("--device", default="cpu", help="--compare: torch device")
    args = ap.parse_args(argv)
    if args.quick:
        args.config = args.config or "configs/train/tiny-dspark.yaml"
        args.steps, args.seq_len = (17, 256) if args.compare else (3, 128)
        args.micro_batch = 8 if args.compare else args.micro_batch
    args.config = args.config or "configs/train/smollm2-135m-dspark.yaml"
    if args.steps < 2:
        ap.error("--steps must be >= 2 (the first step is not timed)")
    return args


def vocab_size(target: str) -> int:
    from transformers import AutoConfig

    from dspark.models import builtin as models_builtin

    path = models_builtin.prepare(target) if target in models_builtin.BUILTIN else target
    return int(AutoConfig.from_pretrained(path).vocab_size)


def write_rollouts(path: str, rows: int, seq_len: int, vocab: int, seed: int = 0) -> str:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    prompt = seq_len // 4
    ids = [rng.integers(0, vocab, seq_len).tolist() for _ in range(rows)]
    mask = [[0] * prompt + [1] * (seq_len - prompt)] * rows
    pq.write_table(pa.table({"split": ["train"] * rows, "input_ids": pa.array(ids, pa.list_(pa.int32())),
                             "loss_mask": pa.array(mask, pa.list_(pa.int8()))}), path)
    return path


def stage_overrides(args, stage: int, rollouts: str, storage: str, cpus_per_worker: float) -> list[str]:
    """`--set` overrides of one ZeRO stage's jobs.train run (the job is run as users run it: a subprocess
    attached to this benchmark's Ray)."""
    import ray

    global_batch = args.micro_batch * args.workers * args.accum
    return [f"run_name=bench-zero{stage}-{uuid.uuid4().hex[:8]}", f"data.rollouts={rollouts}",
            f"data.max_seq_len={args.seq_len}", f"optim.micro_batch_size={args.micro_batch}",
            f"optim.global_batch_size={global_batch}", f"optim.max_steps={args.steps}", "optim.warmup_ratio=0",
            f"deepspeed.zero_stage={stage}", f"scaling.num_workers={args.workers}",
            f"scaling.use_gpu={str(args.gpu).lower()}", f"scaling.cpus_per_worker={cpus_per_worker}",
            f"scaling.torch_threads={args.torch_threads or 'null'}",
            f"checkpoint.storage_path={storage}", f"checkpoint.every_steps={args.steps}",
            "checkpoint.max_failures=0", "tracking.enabled=false", "fault=null",
            f"ray.address={ray.get_runtime_context().gcs_address}"]


def cpus_per_worker(args) -> float:
    """Leave one CPU for Ray Data (and the driver) beside the workers."""
    import ray

    if args.cpus_per_worker:
        return args.cpus_per_worker
    total = ray.cluster_resources().get("CPU", 1.0)
    return round(max(0.25, min(4.0, (total - 1) / args.workers)), 2)


def measure(args, stage: int, rollouts: str, workdir: str, cpus: float, forward_dtype: str = "same") -> dict:
    import subprocess

    overrides = stage_overrides(args, stage, rollouts, os.path.join(workdir, f"ckpt-{stage}-{forward_dtype}"), cpus)
    overrides.append(f"target_forward_dtype={forward_dtype}")
    cmd = [sys.executable, "-m", "jobs.train", "--config", str(REPO_ROOT / args.config)]
    for item in overrides:
        cmd += ["--set", item]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True, check=True)
    summary = json.loads(done.stdout.strip().splitlines()[-1])  # the job's summary: its last stdout line
    m = summary["metrics"]
    tokens_per_s = float(m.get("mean_tokens_per_s", m.get("tokens_per_s", 0.0)))
    tokens_per_step = float(m.get("tokens", 0.0))
    return {"tokens_per_s": round(tokens_per_s, 1), "tokens_per_s_per_worker": round(tokens_per_s / args.workers, 1),
            "step_s": round(tokens_per_step / tokens_per_s, 3) if tokens_per_s else None,
            "peak_mem_gb_per_worker": round(float(m.get("peak_mem_gb", 0.0)), 3),
            "final_loss": round(float(m.get("loss", float("nan"))), 4),
            "run_wall_s": round(time.perf_counter() - start, 1)}


def compare_rows(n: int, args, vocab: int, seed: int = 0) -> list[dict]:
    import numpy as np

    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        length = int(rng.integers(args.min_len, args.seq_len + 1))
        prompt = length // 4
        rows.append({"input_ids": rng.integers(0, vocab, length).tolist(),
                     "loss_mask": [0] * prompt + [1] * (length - prompt)})
    return rows


def measure_interleaved(base, target, rows: list[dict], args, precision: str) -> dict:
    """Padded (window 1) and bucketed (--bucket-window) LocalTrainer runs over the same rows, their steps
    interleaved in ABBA order so load drift on a shared machine hits both alike; each step is timed on
    its own and the first step of each run (warm-up) is not timed."""
    import torch

    from dspark.training.batching import bucketed_batches, collate, padding_fraction
    from dspark.drafters import build_drafter
    from dspark.drafters.draft_vocab import DraftVocabPlan
    from dspark.training.loop import LocalTrainer, flops_rates

    lengths = [len(r["input_ids"]) for r in rows]
    runs = {}
    for name, window in (("padded", 1), ("bucketed", args.bucket_window)):
        torch.manual_seed(0)
        drafter = build_drafter(base.drafter, target, draft_ids=DraftVocabPlan.of_rows(
            ((r["input_ids"], r["loss_mask"]) for r in rows), base.drafter.draft_vocab_size, target.vocab_size).ids())
        trainer = LocalTrainer(base.drafter.algo, target, drafter, base.optim, precision)
        trainer.set_schedule(args.steps)
        picks = bucketed_batches(list(range(len(rows))), lengths, args.micro_batch, window, seed=0)
        runs[name] = {"trainer": trainer, "picks": picks, "s": 0.0, "tokens": 0.0, "flops": 0.0, "m": {}}
    for i in range(len(runs["padded"]["picks"])):
        for name in (("padded", "bucketed") if i % 2 == 0 else ("bucketed", "padded")):
            run = runs[name]
            batch = collate({k: [rows[j][k] for j in run["picks"][i]] for k in ("input_ids", "loss_mask")},
                            args.seq_len, target.pad_token_id)
            start = time.perf_counter()
            run["m"] = run["trainer"].step(batch, seed=i)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            if i:
                run["s"] += time.perf_counter() - start
                run["tokens"] += run["m"]["tokens"]
                run["flops"] += run["m"]["flops"]
    rates = {name: flops_rates(run["flops"], run["s"], args.device, precision) for name, run in runs.items()}
    return {name: {"tokens_per_s": round(run["tokens"] / run["s"], 1),
                   "padding_fraction": round(padding_fraction(run["picks"][1:], lengths), 4),
                   "model_tflops_per_s": round(rates[name]["model_tflops_per_s"], 5),
                   "mfu": round(rates[name]["mfu"], 4) if rates[name]["mfu"] is not None else None,
                   "timed_steps": len(run["picks"]) - 1, "final_loss": round(run["m"]["loss"], 4)}
            for name, run in runs.items()}


def compare(args) -> dict:
    import torch

    from dspark.config import load_config
    from dspark.io import storage
    from dspark.models.target import load_target
    from dspark.training.loop import resolve_precision
    from dspark.training.config import TrainJobConfig

    base = load_config(TrainJobConfig, REPO_ROOT / args.config, ["data.rollouts=unused"])
    precisions = ["fp32"] + (["bf16"] if resolve_precision(args.device) == "bf16" else [])
    rows = compare_rows(args.micro_batch * args.steps, args, vocab_size(base.target))
    results = {}
    for precision in precisions:
        target = load_target(base.target, device=args.device, local_copy=storage.local_copy,
                             dtype=torch.bfloat16 if precision == "bf16" else torch.float32)
        for name, res in measure_interleaved(base, target, rows, args, precision).items():
            results[f"{precision}/{name}"] = res
            print(f"[bench] {precision}/{name}: {res}", file=sys.stderr, flush=True)
    best = max(results.values(), key=lambda r: r["tokens_per_s"])
    report = {"benchmark": "train_throughput", "mode": "compare", "target": base.target, "algo": base.drafter.algo,
              "device": args.device, "config": args.config,
              "batch": {"micro_batch": args.micro_batch, "seq_len_range": [args.min_len, args.seq_len],
                        "bucket_window": args.bucket_window, "steps": args.steps},
              "results": results,
              "speedup_vs_fp32_padded": round(best["tokens_per_s"] / results["fp32/padded"]["tokens_per_s"], 3)}
    print(json.dumps(report))
    return report


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.compare:
        return compare(args)
    from pipelines.ray_cluster import init_ray
    from dspark.config import RayConfig

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    init_ray(RayConfig())
    from dspark.config import load_config
    from dspark.training.config import TrainJobConfig

    base = load_config(TrainJobConfig, REPO_ROOT / args.config, ["data.rollouts=unused"])
    stages = [int(s) for s in args.stages.split(",")]
    results = {}
    with tempfile.TemporaryDirectory(prefix="dspark-train-bench-") as workdir:
        rows = args.micro_batch * args.workers * args.accum * args.steps
        rollouts = write_rollouts(os.path.join(workdir, "rollouts.parquet"), rows, args.seq_len,
                                  vocab_size(base.target))
        cpus = cpus_per_worker(args)
        forward_dtypes = args.target_forward_dtypes.split(",")
        for stage in stages:
            for forward_dtype in forward_dtypes:
                key = f"zero{stage}" + (f"-{forward_dtype}" if len(forward_dtypes) > 1 else "")
                print(f"[bench] {key}: {args.workers} workers x {args.micro_batch} seq x {args.seq_len} tokens "
                      f"x {args.accum} accum, {args.steps} steps", file=sys.stderr, flush=True)
                results[key] = measure(args, stage, rollouts, workdir, cpus, forward_dtype)
                print(f"[bench] {key}: {results[key]}", file=sys.stderr, flush=True)
            if len(forward_dtypes) > 1:  # each forward dtype's tokens/s over the first one's, this stage
                first = results[f"zero{stage}-{forward_dtypes[0]}"]["tokens_per_s"]
                for forward_dtype in forward_dtypes[1:]:
                    entry = results[f"zero{stage}-{forward_dtype}"]
                    entry[f"over_{forward_dtypes[0]}"] = round(entry["tokens_per_s"] / first, 3) if first else None
    report = {"benchmark": "train_throughput", "target": base.target, "algo": base.drafter.algo,
              "drafter_layers": base.drafter.depth, "workers": args.workers, "device": "gpu" if args.gpu else "cpu",
              "precision": "bf16" if args.gpu else "fp32", "cpus_per_worker": cpus, "torch_threads": args.torch_threads,
              "batch": {"micro_batch": args.micro_batch, "accum": args.accum, "seq_len": args.seq_len,
                        "global_batch_sequences": args.micro_batch * args.workers * args.accum},
              "target_forward_dtypes": args.target_forward_dtypes.split(","),
              "timed_steps": args.steps - 1, "results": results}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
