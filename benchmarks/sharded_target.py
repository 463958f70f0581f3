"""A frozen target too big to copy per worker: its memory per worker whole vs sharded (FSDP2 over the workers,
dspark/models/sharded_target.py), and the drafter's losses with each, on `--workers` CPU ranks (gloo).

    python benchmarks/sharded_target.py                      # a random 1.1 B Llama (TinyLlama's shape), 3 workers
    python benchmarks/sharded_target.py --size micro --workers 2   # a smoke run

The target is built once from its config with random weights (seed 0) and saved as safetensors under
$DSPARK_CACHE/models/random-<size>; both sides load that directory (whole: `load_target`, i.e.
`from_pretrained`; sharded: `load_sharded_target`, slice by slice). Each side runs the `--workers` ranks as one
process group; on each rank:
1. target memory = peak RSS (the kernel's VmHWM, reset first) over loading the target and one frozen forward (the features of the rank's own
   batch) minus the RSS before loading; also the bytes of the parameters the rank holds;
2. then `--steps` optimizer steps of a DSpark drafter (seed 0) on the rank's batch (ranks differ in batch length),
   through the library's step (dspark.training.loop.LocalTrainer); the losses are compared side to side.
Precision: bf16 where this CPU computes it natively, else fp32 (the target's dtype and the drafter's autocast).
Printed (last stdout line, JSON; written to benchmarks/results/scale/sharded_target.json):
`target_memory_per_worker` {replicated, sharded (max over ranks, bytes), workers, ratio, goal}, the parameter
bytes, and the largest loss difference.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

SIZES = {  # Llama configs; "1b" is TinyLlama-1.1B's shape (1.10 B parameters)
    "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
               num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048),
    "micro": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512),
}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="1b")
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=48, help="rank r's batch: one row of seq_len + 8r tokens")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=str(REPO_ROOT / "benchmarks/results/scale/sharded_target.json"))
    return ap.parse_args(argv)


def random_target_dir(size: str) -> Path:
    """A Llama of `size` with random weights (seed 0), saved once as safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from dspark.models.builtin import cache_root

    out = cache_root() / "models" / f"random-{size}"
    if (out / "config.json").exists():
        return out
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SIZES[size], tie_word_embeddings=False)).to(torch.bfloat16)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".random-{size}-"))
    model.save_pretrained(tmp)
    tmp.rename(out)
    return out


def rank_batch(rank: int, seq_len: int, vocab: int) -> dict:
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, vocab, (1, seq_len + 8 * rank), generator=g)
    loss_mask = torch.ones_like(ids)
    loss_mask[:, : seq_len // 4] = 0
    return {"input_ids": ids, "loss_mask": loss_mask, "attention_mask": torch.ones_like(ids)}


def rank_main(rank: int, world: int, port: int, path: str, sharded: bool, args, precision: str, out_dir: str):
    import torch.distributed as dist

    from dspark.drafters import DrafterConfig, build_drafter
    from dspark.models.sharded_target import load_sharded_target, local_target_bytes, shard_mesh
    from dspark.models.target import load_target
    from dspark.training.config import OptimSection
    from dspark.training.loop import LocalTrainer
    from dspark.training.step import precision_dtype

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    dtype = precision_dtype(precision)
    _meta_model(Path(path))  # the model classes imported before measuring: code is not target memory
    reset_peak_rss()
    rss_before = psutil.Process().memory_info().rss
    target = (load_sharded_target(path, shard_mesh(world, "cpu"), dtype=dtype) if sharded
              else load_target(path, dtype=dtype))
    batch = rank_batch(rank, args.seq_len, target.vocab_size)
    t0 = time.perf_counter()
    target.forward(batch["input_ids"], attention_mask=batch["attention_mask"], layer_ids=[2, 10, 18][:3]
                   if target.num_layers > 18 else [0, 1], logits_at=None)
    forward_s = time.perf_counter() - t0
    peak = peak_rss()
    torch.manual_seed(0)
    drafter = build_drafter(DrafterConfig(algo="dspark", block_size=4, num_layers=1, num_context_layers=3,
                                          anchors_per_seq=8), target)
    trainer = LocalTrainer("dspark", target, drafter, OptimSection(lr=1e-3), precision)
    losses = [trainer.step(batch, seed=i)["loss"] for i in range(args.steps)]
    report = {"rank": rank, "target_peak_bytes": peak - rss_before, "param_bytes": local_target_bytes(target),
              "forward_s": forward_s, "losses": losses}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def reset_peak_rss() -> None:
    """Start the kernel's peak-RSS counter (VmHWM) over from the current RSS (ru_maxrss would also count what
    the parent held before the spawn: it survives exec)."""
    Path("/proc/self/clear_refs").write_text("5")


def peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_side(path: Path, sharded: bool, args, precision: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        torch.multiprocessing.spawn(rank_main, args=(args.workers, free_port(), str(path), sharded, args, precision,
                                                     out), nprocs=args.workers)
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(args.workers)]


def main(argv=None) -> dict:
    from dspark.models.precision import bf16_is_native

    args = parse_args(argv)
    precision = "bf16" if bf16_is_native(torch.device("cpu")) else "fp32"
    path = random_target_dir(args.size)
    whole, sharded = run_side(path, False, args, precision), run_side(path, True, args, precision)
    rep, shd = max(r["target_peak_bytes"] for r in whole), max(r["target_peak_bytes"] for r in sharded)
    n = args.workers
    result = {
        "target": f"random-{args.size}", "params": sum(p.numel() for p in _meta_model(path).parameters()),
        "precision": precision, "workers": n, "backend": "gloo (CPU)",
        "target_memory_per_worker": {"replicated": rep, "sharded": shd, "workers": n, "ratio": round(shd / rep, 4),
                                     "goal": round(1.5 / n + 0.15, 4), "meets_goal": shd / rep <= 1.5 / n + 0.15,
                                     "measure": "peak RSS after load + one frozen forward, minus RSS before load"},
        "param_bytes_per_worker": {"replicated": whole[0]["param_bytes"],
                                   "sharded": [r["param_bytes"] for r in sharded]},
        "forward_s": {"replicated": [round(r["forward_s"], 3) for r in whole],
                      "sharded": [round(r["forward_s"], 3) for r in sharded]},
        "losses": {"replicated": [r["losses"] for r in whole], "sharded": [r["losses"] for r in sharded]},
        "max_loss_diff": max(abs(a - b) for w, s in zip(whole, sharded) for a, b in zip(w["losses"], s["losses"])),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return result


def _meta_model(path: Path):
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    with init_empty_weights():
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))


if __name__ == "__main__":
    main()
