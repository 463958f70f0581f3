"""The decoding core, eager against compiled (and HF's dynamic cache), measured side by side in one run.

    python benchmarks/decode_core.py                       # smollm2-135m, the committed CPU drafter, auto precision
    python benchmarks/decode_core.py --target tiny --prompts 1 --max-new-tokens 16 --rollout-rows 4 --drafter untrained

Rows of the JSON (the last stdout line; also written to benchmarks/results/decode_core/<device>.json):
- ops_per_step: what one decoding step dispatches, counted with torch.profiler: `aten` = every aten call (nested
  ones too), `top_level` = aten calls not inside another op. batch1 = one new token of one sequence; rollout =
  one new token for each of `--rollout-rows` sequences. `dynamic` = the pre-core path (HF DynamicCache forward).
  A compiled step's fused C++/Triton kernels are not aten calls: what it still dispatches is what is counted.
- host_ms_per_step: wall time of that step (median of `--step-repeats`). Row prefill_batch1: one prefill of the
  shortest prompt at batch 1 (compiled: one graph of its token bucket where it has at most 64 tokens, else eager).
- tok_per_s: target_batch1 (target-only decoding, `target_generate`), speculative_batch1 (`speculative_generate`
  with the drafter; compiled: the drafter's passes captured too, dspark.drafters.block_capture), modes taking
  turns prompt by prompt (order rotating); rollout = the rollout generator (BatchGenerator at max_batch
  `--rollout-rows`, 2 x rows seeded sequences; dynamic = its ragged KV store).
- compile_s: seconds the first compiled calls took (one graph per shape bucket: rows, new tokens, KV window);
  the decode rows are timed after a warm-up that decodes every prompt once compiled.
- cpu_default: the mode `auto` picks on a CPU (dspark.decoding.static_core.resolve_mode), with the ratios that
  justify it.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.decode_speed import eval_prompt_ids  # noqa: E402
from dspark.decoding.sampling import SamplingParams  # noqa: E402
from dspark.decoding.specdec import speculative_generate, target_generate  # noqa: E402
from dspark.decoding.static_core import DecodeCore, resolve_mode  # noqa: E402
from dspark.models.precision import bf16_is_native, torch_dtype  # noqa: E402

CORE_MODES = ("eager", "compiled")
DEFAULT_DRAFTER = str(REPO_ROOT / "benchmarks/results/learning_curve/drafter-cpu-mix2")


def model_args(description: str, drafter_help: str) -> argparse.ArgumentParser:
    """A parser with the target, drafter, precision, device and prompt-folder options the decoding benchmarks share."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--target", default="smollm2-135m", help="tiny | smollm2-135m | model dir")
    ap.add_argument("--drafter", default=DEFAULT_DRAFTER, help=drafter_help)
    ap.add_argument("--dtype", default="auto", help="auto (bf16 where native) | float32 | bfloat16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--data-dir", default=str(REPO_ROOT / "data" / "eval"))
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    ap = model_args(__doc__.split("\n")[0], "drafter reference for speculative_batch1, or untrained")
    ap.add_argument("--datasets", default="gsm8k,humaneval,mt-bench")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per dataset")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--rollout-rows", type=int, default=16)
    ap.add_argument("--step-repeats", type=int, default=20, help="timed steps per mode and shape")
    ap.add_argument("--quick", action="store_true", help="no speculative row (a smoke run)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/decode_core/<device>.json)")
    return ap.parse_args(argv)


def device_label(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(device).replace(" ", "-").lower()
    return "cpu-bf16-native" if bf16_is_native(device) else "cpu-avx2"


def write_result(result: dict, name: str, label: str, out: str | None = None) -> None:
    """The result JSON at `out`, default benchmarks/results/<name>/<label>.json (folders made)."""
    path = Path(out or REPO_ROOT / "benchmarks/results" / name / f"{label}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")


# ---- one step: ops and host time --------------------------------------------------------------
def filled_core(target, mode: str, rows: int, context: int) -> DecodeCore:
    """A core of `rows` slots whose sequences hold `context` tokens (prefilled eager)."""
    core = DecodeCore(target, slots=rows, mode="eager")
    core.step(torch.randint(0, target.vocab_size, (rows, context)), [0] * rows)
    core.mode = mode  # the prefill ran eager (as CoreSequence runs steps longer than COMPILED_MAX_TOKENS)
    return core


def dynamic_step_fn(target, rows: int, context: int):
    """The pre-core step: HF forward on a DynamicCache (cropped back after each step)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        target.model(torch.randint(0, target.vocab_size, (rows, context), device=target.device),
                     past_key_values=cache, use_cache=True)

    def step(ids):
        with torch.no_grad():
            target.model(ids, past_key_values=cache, use_cache=True)
        target.crop_cache(cache, context)
    return step


def core_step_fn(target, mode: str, rows: int, context: int):
    core = filled_core(target, mode, rows, context)
    return lambda ids: core.step(ids, [context] * rows)


def count_ops(step, ids) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(ids)
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    top = [e for e in events if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    return {"aten": len(events), "top_level": len(top)}


def time_step(step, ids, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step(ids)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_steps(target, rows: int, context: int, repeats: int, compile_s: dict, label: str):
    """ops and host ms of one step at [rows, 1] for dynamic, eager and compiled."""
    ids = torch.randint(0, target.vocab_size, (rows, 1), device=target.device)
    ops, ms = {}, {}
    for mode in ("dynamic", *CORE_MODES):
        step = dynamic_step_fn(target, rows, context) if mode == "dynamic" else core_step_fn(target, mode, rows, context)
        t0 = time.perf_counter()
        step(ids)  # warm-up; the compiled mode compiles here
        if mode == "compiled":
            compile_s[label] = round(time.perf_counter() - t0, 1)
        step(ids)
        ops[mode] = count_ops(step, ids)
        ms[mode] = round(1000 * time_step(step, ids, repeats), 3)
    return ops, ms


def measure_prefill(target, ids: list[int], repeats: int, compile_s: dict):
    """ops and host ms of one prompt's batch-1 prefill (what speculative and target-only decoding run first),
    eager and compiled: a prompt of at most COMPILED_MAX_TOKENS tokens is one replay of its bucket's graph."""
    from dspark.decoding.kv_sequence import open_sequence

    ops, ms = {}, {}
    for mode in CORE_MODES:
        def prefill(_, mode=mode):
            open_sequence(target, mode).extend(ids, (), logits="last")

        t0 = time.perf_counter()
        prefill(None)  # warm-up; the compiled mode compiles here
        if mode == "compiled":
            compile_s["prefill_batch1"] = round(time.perf_counter() - t0, 1)
        ops[mode] = count_ops(prefill, None)
        ms[mode] = round(1000 * time_step(prefill, None, repeats), 3)
    return ops, ms


# ---- whole decodes -----------------------------------------------------------------------------
def tok_per_s_interleaved(prompts, modes: dict, max_new_tokens: int) -> dict:
    """tok/s per mode; modes take turns per prompt, in an order that rotates."""
    from tqdm.auto import tqdm

    tokens = {m: 0 for m in modes}
    seconds = {m: 0.0 for m in modes}
    names = list(modes)
    for i, (_, ids) in enumerate(tqdm(prompts, desc="decode", unit="prompt")):
        order = names[i % len(names):] + names[: i % len(names)]
        for name in order:
            t0 = time.perf_counter()
            res = modes[name](ids, torch.Generator().manual_seed(i))
            seconds[name] += time.perf_counter() - t0
            tokens[name] += len(res.token_ids)
    return {m: round(tokens[m] / seconds[m], 2) for m in modes}


def warm_up(prompts, modes: dict) -> float:
    """Decode every prompt once in compiled mode (each KV window and token bucket compiles its graph here,
    not inside the timed runs) and the first prompt in the other modes; returns the compiled mode's seconds."""
    t0 = time.perf_counter()
    for i, (_, ids) in enumerate(prompts):
        modes["compiled"](ids, torch.Generator().manual_seed(i))
    seconds = round(time.perf_counter() - t0, 1)
    for name, decode in modes.items():
        if name != "compiled":
            decode(prompts[0][1], torch.Generator().manual_seed(0))
    return seconds


def decode_rows(target, drafter, prompts, sp, max_new_tokens: int, compile_s: dict) -> dict:
    rows = {}
    target_modes = {m: (lambda mm: lambda ids, g: target_generate(target, ids, sp, max_new_tokens, generator=g,
                                                                 core_mode=mm))(m) for m in ("dynamic", *CORE_MODES)}
    compile_s["target_batch1_warmup"] = warm_up(prompts, target_modes)
    rows["target_batch1"] = tok_per_s_interleaved(prompts, target_modes, max_new_tokens)
    if drafter is not None:
        spec_modes = {m: (lambda mm: lambda ids, g: speculative_generate(
            target, drafter, ids, sp, max_new_tokens, generator=g, core_mode=mm))(m) for m in ("dynamic", *CORE_MODES)}
        compile_s["speculative_batch1_warmup"] = warm_up(prompts, spec_modes)
        rows["speculative_batch1"] = tok_per_s_interleaved(prompts, spec_modes, max_new_tokens)
    return rows


def drafter_or_untrained(ref: str, target):
    """The drafter reference, or with "untrained" a fresh DSpark drafter (a speed smoke run, τ ≈ 1);
    "untrained-<algo>" a fresh drafter of that algorithm (dspark, dflash, eagle3)."""
    from dspark.drafters import DrafterConfig, build_drafter
    from dspark.io.drafter_source import load_drafter_ref

    if ref == "untrained" or ref.startswith("untrained-"):
        torch.manual_seed(0)
        return build_drafter(DrafterConfig(algo=ref.removeprefix("untrained").lstrip("-") or "dspark"), target).eval()
    return load_drafter_ref(ref, target).eval()


def rollout_row(target, prompts, rows: int, max_new_tokens: int, compile_s: dict, rounds: int = 2) -> dict:
    """Rollout tok/s: BatchGenerator (max_batch `rows`) over 2 x rows sequences of the prompts, seeded, per
    decode_core (dynamic = the ragged store), modes taking turns; new tokens over wall time, prefills included."""
    from dspark.decoding.generator import BatchGenerator, GeneratorConfig

    sp = SamplingParams(temperature=1.0)
    batch = [ids for _, ids in prompts] * (2 * rows // len(prompts) + 1)
    batch = batch[: 2 * rows]
    gens = {m: BatchGenerator(target, GeneratorConfig(max_batch=rows, decode_core=m)) for m in ("dynamic", *CORE_MODES)}
    run = lambda m, seed: gens[m].generate(batch, sp, [seed + i for i in range(len(batch))], max_new_tokens, stop_ids=[])
    t0 = time.perf_counter()
    run("compiled", 0)  # compiles the row buckets' decoding graphs
    compile_s["rollout_warmup"] = round(time.perf_counter() - t0, 1)
    tokens, seconds = {m: 0 for m in gens}, {m: 0.0 for m in gens}
    names = list(gens)
    for r in range(rounds):
        for m in names[r % len(names):] + names[: r % len(names)]:
            t0 = time.perf_counter()
            tokens[m] += sum(len(t) for t, _ in run(m, 1000 * (r + 1)))
            seconds[m] += time.perf_counter() - t0
    return {m: round(tokens[m] / seconds[m], 1) for m in gens}


def main(argv=None) -> dict:
    args = parse_args(argv)
    from dspark.io import storage
    from dspark.models.target import load_target

    dtype = torch_dtype(args.dtype, args.device)
    target = load_target(args.target, device=args.device, dtype=dtype, local_copy=storage.local_copy)
    drafter = None if args.quick else drafter_or_untrained(args.drafter, target).to(dtype)
    prompts = eval_prompt_ids(target, args.data_dir, args.datasets, args.prompts)
    context = max(len(ids) for _, ids in prompts)
    print(f"target {target.name} {dtype} on {args.device}; {len(prompts)} prompts x {args.max_new_tokens} tokens; "
          f"rollout rows {args.rollout_rows}", flush=True)
    compile_s: dict = {}
    ops, host_ms = {}, {}
    for label, rows in (("batch1", 1), ("rollout", args.rollout_rows)):
        ops[label], host_ms[label] = measure_steps(target, rows, context, args.step_repeats, compile_s, label)
        print(label, json.dumps({"ops": ops[label], "host_ms": host_ms[label]}), flush=True)
    shortest = min((ids for _, ids in prompts), key=len)
    ops["prefill_batch1"], host_ms["prefill_batch1"] = measure_prefill(target, shortest, args.step_repeats, compile_s)
    print("prefill_batch1", len(shortest), "tokens", json.dumps({"ops": ops["prefill_batch1"],
                                                                  "host_ms": host_ms["prefill_batch1"]}), flush=True)
    tok_per_s = decode_rows(target, drafter, prompts, SamplingParams(temperature=1.0), args.max_new_tokens, compile_s)
    tok_per_s["rollout"] = rollout_row(target, prompts, args.rollout_rows, args.max_new_tokens, compile_s)
    ratios = {row: round(v["compiled"] / v["eager"], 3) for row, v in tok_per_s.items()}
    result = {
        "device": device_label(args.device), "target": target.name, "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
        "rollout_rows": args.rollout_rows, "context": context, "prefill_tokens": len(shortest),
        "ops_per_step": ops, "host_ms_per_step": host_ms, "tok_per_s": tok_per_s, "compile_s": compile_s,
        "batch1_ops_eager_over_compiled": round(ops["batch1"]["eager"]["aten"] / max(1, ops["batch1"]["compiled"]["aten"]), 1),
        "compiled_over_eager_tok_per_s": ratios,
        "cpu_default": resolve_mode("auto", torch.device("cpu")),
        "rollout_note": "BatchGenerator, max_batch rollout_rows, 2 x rollout_rows sequences, prefills included",
    }
    if args.device == "cpu" and not args.quick:
        write_result(result, "decode_core", result["device"], args.out)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
