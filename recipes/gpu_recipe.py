"""The GPU recipe: prompts -> rollouts -> DSpark, DFlash and Eagle3 each trained for an equal share of
the training time -> evaluation, on one device, inside ONE global deadline; a driver over library calls.

    python -m recipes.gpu_recipe --profile configs/recipes/gpu-smollm2-135m.yaml [--out DIR] [--set key=value ...]

Library pieces: prompts dspark.data.prompts (sources) + dspark.data.prompt_filters.EvalIndex (the one
decontamination rule); rollouts dspark.data.rollout_engine.stream_rollouts (continuous batching,
dspark.decoding.generator, sized per device, the stop check before every decoding step, prompts cycled with
fresh seeds); training dspark.training.budget.train_for over LocalTrainer (the shared step
dspark.training.step, as the Ray Train workers run it, without DeepSpeed); evaluation
dspark.eval.evaluate (round robin, each drafter its own failure scope); plot dspark.eval.report.plot_recipe;
drafters dspark.drafters.checkpoint.save_bundle. The profile (configs/recipes/*.yaml, `RecipeConfig`)
names the target and, per drafter, the training config whose `drafter:` / `optim:` sections it uses.

Time: the deadline (`budget_s` from the start, model loading included) is checked before every
decoding step, training step and evaluated prompt. Rollouts get `rollout.seconds` (less if the rest
would not fit); training gets what is left minus the evaluation and output reserves, split into equal
WALL-CLOCK shares, one per drafter, trained one after the other (each sizes its schedule from its own
measured step time); evaluation gets the rest. Between rollouts and training a short `profile` phase times
decoding steps at batch 1 and at the rollout batch under torch.profiler (wall / host / device ms per step),
`decode_core` the batch-1 core, `accept_rows` the engine's rejection step row by row against batched, and
`draft_block` a drafting pass with its random draws per position against up front.
Output (`--out`, default benchmarks/results/<run>/), at most 8 files: recipe.json (the summary, rewritten
after every phase, so a stopped run leaves a valid one), results.json, recipe.png, drafters.tar.NN (bf16, in as few parts as fit). Last stdout line: the
summary JSON. Exit status 1 when a phase failed.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

from pydantic import Field

from dspark.config import StrictModel, load_config, read_yaml
from dspark.drafters import DrafterConfig
from dspark.eval.evaluate import DecodeSettings
from dspark.decoding.generator import GeneratorConfig
from dspark.decoding.static_core import full_graph_caches
from dspark.training.config import OptimSection
from dspark.data.prompts import PromptSource
from dspark.data.rollout_engine import SamplingConfig

MiB = 2**20


class RecipeDrafter(StrictModel):
    train_config: str = Field(description="training config (configs/train/*.yaml) whose drafter/optim sections are used")
    drafter: dict = Field(default_factory=dict, description="overrides of its drafter section")
    optim: dict = Field(default_factory=dict, description="overrides of its optim section")
    chunks: int = Field(1, ge=1, description="micro batches per step (gradient accumulation; memory)")
    init_from: str | None = Field(None, description="a saved drafter folder (repository-relative) to continue "
                                  "on this run's rollouts: its architecture and draft vocabulary are kept; "
                                  "`drafter` may change only training-only fields (anchors, loss weights)")


class RecipeRollouts(StrictModel):
    seconds: float = Field(150, gt=0, description="wall-clock budget of the rollout phase")
    tokens: int = Field(5_000_000, ge=1, description="stop once this many tokens are generated")
    sampling: SamplingConfig = Field(default_factory=lambda: SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=320),
                                     description="the target's sampling (temperature 1: the evaluation's)")
    generator_cuda: GeneratorConfig = Field(default_factory=lambda: GeneratorConfig(max_batch=768, max_prefill_tokens=32768),
                                            description="continuous batching on a GPU (>= 512 rows at 135M)")
    generator_cpu: GeneratorConfig = Field(default_factory=lambda: GeneratorConfig(max_batch=32),
                                           description="continuous batching on a CPU")
    max_context_tokens: int = Field(2048, ge=8, description="prompt + answer limit")


class RecipeTrain(StrictModel):
    batch_size: int = Field(32, ge=1, description="sequences per optimizer step")
    max_seq_len: int = Field(1024, ge=8, description="sequences are cut to this many tokens")
    bucket_window: int = Field(16, ge=0, description="length-bucketing window in batches")
    max_steps: int | None = Field(None, ge=1, description="cap on steps per drafter (None: as many as fit)")
    log_every: int = Field(50, ge=1, description="a training-curve point every N steps")
    target_memo_gb: float = Field(24.0, ge=0, description="frozen-target outputs of the rows trained on, kept on the "
                                  "device (GiB) and reused by later epochs and by the next drafters "
                                  "(dspark/training/target_memo.py); 0 = run the target every step")


class RecipeEval(StrictModel):
    dir: str = Field("data/eval", description="benchmark JSONL folder (also the decontamination reference)")
    benchmarks: list[str] = Field(["gsm8k", "math500", "humaneval", "mbpp", "mt-bench"], description="file stems")
    prompts_per_benchmark: int = Field(8, ge=1, description="first-turn prompts per benchmark at most")
    reserve_s: float = Field(90, ge=0, description="seconds kept for evaluation when the other phases are planned")
    decode: DecodeSettings = Field(default_factory=lambda: DecodeSettings(max_new_tokens=128), description="sampling")
    engine_tau: bool = Field(True, description="first, τ of every drafter on all loaded prompts batched through the "
                                               "serving engine (dspark.eval.engine_tau: fixed γ, bootstrap CI); the "
                                               "batch-1 speedup pass then runs on what the deadline leaves")
    engine_max_batch: int = Field(64, ge=1, description="requests decoding together in the engine-τ pass")


class RecipeConfig(StrictModel):
    run: str = Field(description="run name: default output benchmarks/results/<run>/")
    target: str = Field(description="load_target spec (built-in name, local dir)")
    device: str = Field("auto", description="auto (cuda when available), cuda, cpu")
    precision: str = Field("auto", description="auto | bf16 | fp32 (dspark.training.step.resolve_precision)")
    seed: int = Field(0, description="seed of everything")
    budget_s: float = Field(540, gt=0, description="the one global deadline, from the start, loading included")
    output_reserve_s: float = Field(20, ge=0, description="seconds kept for writing drafters and the plot")
    prompts: list[PromptSource] = Field(description="training prompt sources (decontaminated against eval.dir)")
    decontam_ngram: int = Field(13, ge=1, description="word n-gram size of the decontamination rule")
    rollout: RecipeRollouts = Field(default_factory=RecipeRollouts, description="rollout phase")
    train: RecipeTrain = Field(default_factory=RecipeTrain, description="training phase")
    eval: RecipeEval = Field(default_factory=RecipeEval, description="evaluation phase")
    drafters: dict[str, RecipeDrafter] = Field(description="name -> training config (+ overrides), in bundle priority order")
    max_files: int = Field(8, ge=4, description="files the run may write (a device run brings back 8)")
    max_file_mib: float = Field(16, gt=0, description="size of one output file at most")
    max_total_mib: float = Field(64, gt=0, description="all output files together at most")


class Recipe:
    """The run's state and its summary file: `phase(name, fn)` runs one phase in its failure scope and
    rewrites recipe.json afterwards, whatever happened."""

    def __init__(self, cfg: RecipeConfig, out: Path):
        from dspark.training.budget import Deadline

        self.cfg, self.out, self.t0 = cfg, out, time.time()
        self.deadline = Deadline(self.t0 + cfg.budget_s)
        self.summary = {"run": cfg.run, "target": cfg.target, "device": None, "rollout_tokens": 0,
                        "rollout_tok_per_s": None, "decode_core": None, "target_ms_per_token_batch1": None,
                        "eval_prompts": 0, "tau": {}, "tau_mean": {}, "tau_ci95": {}, "speedup_batch1": {},
                        "tau_engine": {}, "eval_prompts_engine": 0, "drafter_capture_fell_back": {},
                        "graph_caches_full": {},
                        "train_share": "equal wall-clock per drafter", "train": {}, "phases": {}, "errors": {}}
        self.results: dict = {"config": json.loads(cfg.model_dump_json())}
        self.target_memo = None  # the frozen target's outputs, shared by the drafters trained (train_phase)
        out.mkdir(parents=True, exist_ok=True)

    def phase(self, name: str, fn, fatal: bool = True) -> bool:
        start = time.time()
        self.summary["phases"][name] = {"status": "running", "seconds": 0.0}
        ok = True
        try:
            fn()
        except Exception as err:  # noqa: BLE001 — recorded in the summary; fatal phases end the run
            ok = False
            self.summary["errors"][name] = f"{type(err).__name__}: {err}"
            self.results.setdefault("tracebacks", {})[name] = traceback.format_exc()
        self.summary["phases"][name] = {"status": "ok" if ok else "failed", "seconds": round(time.time() - start, 2)}
        self.summary["graph_caches_full"] = full_graph_caches()  # compiled functions whose new buckets now run eager
        self.summary["total_s"] = round(time.time() - self.t0, 2)
        self.write()
        log(f"phase {name}: {self.summary['phases'][name]}")
        return ok or not fatal

    def write(self) -> None:
        for name, data in (("results.json", self.results), ("recipe.json", self.summary)):
            tmp = self.out / f".{name}.tmp"
            tmp.write_text(json.dumps(data, indent=1, default=_json_default))
            os.replace(tmp, self.out / name)  # atomic: a reader never sees half a summary


def log(msg: str) -> None:
    print(f"[recipe {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _json_default(x):
    return None if isinstance(x, float) and math.isnan(x) else str(x)


# ---------------------------------------------------------------- phases
def load_phase(r: Recipe) -> None:
    import torch

    from dspark.io import storage
    from dspark.models.target import load_target
    from dspark.training.step import precision_dtype, resolve_precision

    cfg = r.cfg
    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    r.precision = resolve_precision(device, cfg.precision)
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
    r.target = load_target(cfg.target, device=device, dtype=precision_dtype(r.precision), local_copy=storage.local_copy)
    r.summary.update(device=torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
                     precision=r.precision, torch=torch.__version__)


def prompts_phase(r: Recipe) -> None:
    from dspark.eval.benchmark_files import BenchmarkSpec, load_benchmark
    from dspark.data.prompt_filters import build_eval_index
    from dspark.data.prompts import load_prompts
    from dspark.io import storage

    cfg = r.cfg
    files = {f"{b}.jsonl": Path(cfg.eval.dir, f"{b}.jsonl").read_text() for b in cfg.eval.benchmarks}
    index = build_eval_index(files, cfg.decontam_ngram)
    loaded = load_prompts(cfg.prompts, files=storage).prompts
    r.prompts = [p for p in loaded if index.match("\n".join(p.turns)) is None]
    r.benchmarks = [load_benchmark(BenchmarkSpec(path=name), cfg.eval.dir, cfg.eval.prompts_per_benchmark)
                    for name in files]
    r.results["prompts"] = {"loaded": len(loaded), "kept": len(r.prompts), "contaminated": len(loaded) - len(r.prompts)}


def decode_core_phase(r: Recipe) -> None:
    """The batch-1 decoding core evaluation runs on (eval.decode.decode_core; auto: compiled on CUDA, eager on a
    CPU), tried on one prompt first: a failed compile falls back to eager and says so in recipe.json. Then
    target-only batch-1 milliseconds per token on it (decoding only, the prefill left out)."""
    import torch

    from dspark.decoding.specdec import target_generate
    from dspark.decoding.static_core import default_mode, resolve_mode

    settings = r.cfg.eval.decode
    mode = settings.decode_core or default_mode()
    mode = mode if mode == "dynamic" else resolve_mode(mode, r.target.device)
    ids = r.target.chat_ids([{"role": "user", "content": r.prompts[0].turns[0]}])

    def run(core: str, tokens: int):
        gen = torch.Generator().manual_seed(r.cfg.seed)
        return target_generate(r.target, ids, settings.sampling(), tokens, stop_ids=[], generator=gen, core_mode=core)

    info, start = {"requested": mode}, time.time()
    try:
        run(mode, 8)  # compiles the prefill-free step's graphs (the compiled mode)
    except Exception as err:  # noqa: BLE001 — recorded; evaluation then decodes eager
        if mode != "compiled":
            raise
        info["fallback"] = f"{type(err).__name__}: {err}"[:500]
        mode = "eager"
        run(mode, 8)
    info.update(mode=mode, warmup_s=round(time.time() - start, 2))
    settings.decode_core = mode
    res = run(mode, 64)
    r.summary.update(decode_core=info, target_ms_per_token_batch1=round(
        1000 * (res.wall_s - res.prefill_s) / max(1, len(res.token_ids) - 1), 3))


def rollouts_phase(r: Recipe) -> None:
    from dspark.data.rollout_engine import stream_rollouts

    cfg = r.cfg
    n = len(cfg.drafters)
    reserve = cfg.eval.reserve_s + cfg.output_reserve_s + 10.0 * n  # the later phases' minimum
    stop_at = r.deadline.within(min(cfg.rollout.seconds, r.deadline.left() - reserve))
    gen = cfg.rollout.generator_cuda if r.target.device.type == "cuda" else cfg.rollout.generator_cpu
    r.rows, tokens, start = [], 0, time.time()
    for row in stream_rollouts(r.target, r.prompts, cfg.rollout.sampling, gen,
                               stop=lambda: stop_at.passed() or tokens >= cfg.rollout.tokens,
                               max_context_tokens=cfg.rollout.max_context_tokens):
        r.rows.append(row)
        tokens += row["num_generated_tokens"]
    wall = time.time() - start
    if not r.rows:
        raise RuntimeError(f"no rollouts within the budget ({stop_at.at - start:.0f} s left for them)")
    r.summary.update(rollout_tokens=tokens, rollout_tok_per_s=round(tokens / max(wall, 1e-9), 1),
                     rollout_sequences=len(r.rows), rollout_batch=gen.max_batch)


def profile_phase(r: Recipe) -> None:
    """Where a decoding step's time goes on this device (the first H200 run decoded target-only at batch 1
    slower than 2 CPU cores, and its rollouts made 5.1 k tok/s from 768 rows: host-bound, by the look of
    it). torch.profiler over the ragged forward of rollouts and evaluation, at batch 1 (16 tokens) and at the
    rollout batch (4 decoding steps): per step its wall, host (self CPU) and device (self CUDA) milliseconds
    and the busiest ops; device far below wall means the host is the bottleneck."""
    r.results["profile"] = {"batch1": profile_steps(r, 1, 16), f"batch{r.summary['rollout_batch']}":
                            profile_steps(r, r.summary["rollout_batch"], 4)}
    r.summary["ms_per_step"] = {k: {m: v[m] for m in ("wall_ms", "host_ms", "device_ms")}
                                for k, v in r.results["profile"].items()}


def accept_rows_phase(r: Recipe) -> None:
    """The serving engine's rejection step on this device, row by row against batched (benchmarks/accept_rows.py,
    the target's vocabulary, same tokens checked): `accept_rows` takes the batched rule (one read-back per step)
    on an accelerator, where each row's two read-backs wait for the device — a ratio not yet measured on a GPU
    (on a CPU batched is ~0.5x, so a CPU stays row by row)."""
    from benchmarks import accept_rows

    report = accept_rows.main(["--device", str(r.target.device), "--vocab", str(r.target.vocab_size),
                               "--rows", "1,16,64", "--repeats", "5"])
    r.results["accept_rows"] = report
    r.summary["accept_rows_row_over_batched"] = {str(row["rows"]): row["ratio"] for row in report["rows"]}


def draft_block_phase(r: Recipe) -> None:
    """A DSpark drafting pass for 1 / 16 / 64 requests on this device, the block's random draws made per position
    against up front (benchmarks/draft_block.py, same tokens checked): the launches and host work saved per pass,
    timed where they cost (on a CPU the pass is vocabulary-bound: 0.97-1.02x)."""
    from benchmarks import draft_block

    report = draft_block.main(["--rows", "1,16,64", "--reps", "10"], target=r.target)
    r.results["draft_block"] = report
    r.summary["draft_block_per_position_over_up_front"] = {str(row["rows"]): row["per_position_over_up_front"]
                                                           for row in report["rows"]}


def profile_steps(r: Recipe, rows: int, steps: int, top: int = 12) -> dict:
    """`steps` decoding steps of `rows` sequences (rollout prompts) under torch.profiler, after a prefill
    and one decoding step left out of it (profiler schedule: the generator's stop check marks each step)."""
    from torch.profiler import ProfilerActivity, schedule
    from torch.profiler import profile as torch_profile

    from dspark.decoding.generator import BatchGenerator, GeneratorConfig, PromptJob
    from dspark.decoding.sampling import SamplingParams
    from dspark.training.budget import sync

    prompts = [[int(t) for t, m in zip(x["input_ids"], x["loss_mask"]) if not m] for x in r.rows]
    prompts = (prompts * (rows // len(prompts) + 1))[:rows]
    gen = BatchGenerator(r.target, GeneratorConfig(max_batch=rows, max_prefill_tokens=1 << 30))
    requests = [PromptJob(i, p, i, steps + 3) for i, p in enumerate(prompts)]
    marks = []  # before each loop iteration: 1 = prefill + first decoding step, 2.. = decoding steps

    def stop() -> bool:
        sync(r.target.device)
        marks.append(time.perf_counter())
        prof.step()
        return len(marks) == steps + 2

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if r.target.device.type == "cuda" else [])
    for _ in gen.stream(requests[:1], SamplingParams(), None, None):  # warm-up: kernels, allocator
        pass
    with torch_profile(activities=activities, schedule=schedule(wait=1, warmup=1, active=steps)) as prof:
        for _ in gen.stream(requests, SamplingParams(), None, stop):
            pass
    events = prof.key_averages()
    busiest = sorted(events, key=lambda e: e.self_cpu_time_total + device_us(e), reverse=True)[:top]
    per = 1e-3 / steps  # us over the window -> ms per step
    return {"rows": rows, "steps": steps, "wall_ms": round((marks[-1] - marks[1]) * 1e3 / steps, 3),
            "host_ms": round(sum(e.self_cpu_time_total for e in events) * per, 3),
            "device_ms": round(sum(device_us(e) for e in events) * per, 3),
            "top_ops": [{"op": e.key, "calls": e.count, "host_ms_per_step": round(e.self_cpu_time_total * per, 3),
                         "device_ms_per_step": round(device_us(e) * per, 3)} for e in busiest]}


def device_us(event) -> float:
    """An op's self time on the accelerator (torch >= 2.4 names it device time; older, CUDA time)."""
    return getattr(event, "self_device_time_total", 0.0) or getattr(event, "self_cuda_time_total", 0.0)


def train_phase(r: Recipe, name: str, share_s: float) -> None:
    import torch

    from dspark.drafters.draft_vocab import DraftVocabPlan
    from dspark.drafters import build_drafter
    from dspark.training.budget import epoch_batches, probe_batches, train_for
    from dspark.training.loop import LocalTrainer, flops_rates
    from dspark.training.target_memo import TargetMemo

    entry, tc = r.cfg.drafters[name], r.cfg.train
    base = read_yaml(entry.train_config)
    optim = OptimSection(**{**base.get("optim", {}), **entry.optim})
    torch.manual_seed(r.cfg.seed)
    if entry.init_from:
        drafter_cfg, drafter = continued_drafter(entry, r.target)
    else:
        drafter_cfg = DrafterConfig(**{**base["drafter"], **entry.drafter})
        vocab = DraftVocabPlan.of_rows(((x["input_ids"], x["loss_mask"]) for x in r.rows),  # as jobs.train plans it
                                       drafter_cfg.draft_vocab_size, r.target.vocab_size)
        drafter = build_drafter(drafter_cfg, r.target, draft_ids=vocab.ids())
    if r.target_memo is None:
        r.target_memo = TargetMemo.of_gb(memo_gb(tc.target_memo_gb, r.target.device))
    trainer = LocalTrainer(drafter_cfg.algo, r.target, drafter, optim, r.precision, memo=r.target_memo)
    pad = r.target.pad_token_id
    batches = epoch_batches(r.rows, tc.batch_size, tc.max_seq_len, pad, tc.bucket_window, r.cfg.seed)
    probe = probe_batches(r.rows, min(tc.batch_size, len(r.rows)), tc.max_seq_len, pad)
    rep = train_for(trainer, batches, probe, share_s, r.deadline, r.cfg.seed, entry.chunks, tc.log_every,
                    tc.max_steps, on_log=lambda p: log(f"{name} step {p['step']}: loss {p['loss']:.3f}"))
    r.drafters[name] = trainer.drafter
    r.curves[name] = rep.curve
    r.summary["train"][name] = {
        "algo": drafter_cfg.algo, "init_from": entry.init_from, "share_s": round(share_s, 1), "steps": rep.steps,
        "planned_steps": rep.planned_steps,
        "stopped_by": rep.stopped_by, "epochs": rep.epochs, "measured_step_s": round(rep.step_s, 4),
        "tokens_per_s": round(rep.tokens / max(rep.train_s, 1e-9), 1),
        "target_memo": None if r.target_memo is None else vars(r.target_memo.stats).copy(),
        **flops_rates(rep.flops, rep.train_s, r.target.device, r.precision)}


def memo_gb(requested: float, device) -> float:
    """The target memo's budget: as configured on an accelerator; on a CPU at most a quarter of free RAM."""
    if device.type != "cpu":
        return requested
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")  # no psutil in the GPU image
    return min(requested, free / 4 / 2**30)


def continued_drafter(entry: RecipeDrafter, target):
    """(config, drafter) of a saved drafter to continue: its own config with the entry's training-only
    overrides, its draft vocabulary, its weights (dspark.training.session.load_initial_weights)."""
    from dspark.drafters import build_drafter
    from dspark.drafters.checkpoint import read_checkpoint_config, saved_draft_ids
    from dspark.drafters.config import TRAINING_ONLY_FIELDS
    from dspark.training.session import load_initial_weights

    other = sorted(set(entry.drafter) - TRAINING_ONLY_FIELDS)
    if other:
        raise ValueError(f"init_from {entry.init_from}: drafter overrides {other} would change its architecture; "
                         f"only training-only fields may differ ({', '.join(sorted(TRAINING_ONLY_FIELDS))})")
    saved = read_checkpoint_config(entry.init_from)["drafter_config"]
    cfg = DrafterConfig(**{**saved, **entry.drafter})
    drafter = build_drafter(cfg, target, draft_ids=saved_draft_ids(entry.init_from))
    load_initial_weights(drafter, entry.init_from, target)
    return cfg, drafter


def save_phase(r: Recipe) -> None:
    """Drafters in priority order while they fit the file budget; the rest are named in the summary."""
    from dspark.drafters.checkpoint import save_bundle

    cfg = r.cfg
    part = int(min(cfg.max_file_mib, 15.9) * MiB)
    room = int(cfg.max_total_mib * MiB) - 2 * MiB  # recipe.json, results.json and the plot
    free_files = cfg.max_files - 3
    chosen, skipped = {}, {}
    for name, drafter in r.drafters.items():
        size = sum(t.numel() * (2 if t.is_floating_point() else t.element_size()) for t in drafter.state_dict().values())
        need = size + 64 * 1024 * (len(chosen) + 1)  # tar headers and config.json
        if need <= room and math.ceil((sum(chosen.values()) + need) / part) <= free_files:
            chosen[name] = need
            room -= need
        else:
            skipped[name] = f"{size / MiB:.1f} MiB bf16 does not fit the output budget"
    parts = save_bundle({n: r.drafters[n] for n in chosen}, str(r.out), part) if chosen else []
    r.summary.update(drafters_returned=list(chosen), drafters_not_returned=skipped,
                     drafter_parts=[os.path.basename(p) for p in parts])


def eval_phase(r: Recipe) -> None:
    from dspark.drafters import chain_capture
    from dspark.eval.evaluate import aggregate, evaluate_round_robin, tau_ci95

    if r.cfg.eval.engine_tau:
        engine_taus(r)
    stop = r.deadline.within(r.deadline.left() - r.cfg.output_reserve_s)  # the plot still fits
    convs, failed = evaluate_round_robin(r.target, r.drafters, r.benchmarks, r.cfg.eval.decode, r.cfg.seed,
                                         stop=stop.passed)
    algos = {n: d.algo for n, d in r.drafters.items() if n not in failed}
    res = aggregate(convs, r.benchmarks, algos)
    r.results["eval"] = res
    for name, block in res["drafters"].items():
        r.summary["tau"][name] = {b: s.get("tau") for b, s in block["per_benchmark"].items()}
        r.summary["tau_mean"][name] = block["overall"].get("tau")
        r.summary["tau_ci95"][name] = tau_ci95(convs, name)
        r.summary["speedup_batch1"][name] = block["overall"].get("speedup")
    r.summary["eval_prompts"] = len({(c.benchmark, c.index) for c in convs})
    # on a compiled core batch-1 drafting runs captured graphs; a capture that failed ran eager (and logged why)
    r.summary["drafter_capture_fell_back"] = {n: chain_capture.fell_back(d) for n, d in r.drafters.items()}
    r.summary["errors"].update({f"eval:{n}": e for n, e in failed.items()})


def engine_taus(r: Recipe) -> None:
    """τ with its bootstrap CI for every drafter, all loaded prompts batched through the engine (one pass each)."""
    from dspark.eval.engine_tau import engine_tau

    ev = r.cfg.eval
    for name, drafter in r.drafters.items():
        try:
            r.summary["tau_engine"][name] = engine_tau(r.target, drafter, r.benchmarks, ev.decode, r.cfg.seed,
                                                       ev.engine_max_batch)
        except Exception as err:  # noqa: BLE001 — one drafter's failure is recorded; the others go on
            r.summary["errors"][f"eval_engine:{name}"] = f"{type(err).__name__}: {err}"
    counts = [t["prompts"] for t in r.summary["tau_engine"].values()]
    r.summary["eval_prompts_engine"] = max(counts, default=0)


def plot_phase(r: Recipe) -> None:
    from dspark.eval.report import plot_recipe

    plot_recipe(r.results.get("eval"), r.curves, str(r.out / "recipe.png"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--profile", required=True, help="configs/recipes/<name>.yaml")
    p.add_argument("--out", default=None, help="output folder (default benchmarks/results/<run>/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="dotted override key=value")
    args = p.parse_args(argv)
    cfg = load_config(RecipeConfig, args.profile, args.overrides)
    r = Recipe(cfg, Path(args.out or f"benchmarks/results/{cfg.run}"))
    r.drafters, r.curves = {}, {}
    ok = r.phase("load", lambda: load_phase(r)) and r.phase("prompts", lambda: prompts_phase(r)) \
        and r.phase("rollouts", lambda: rollouts_phase(r))
    if ok:
        r.phase("profile", lambda: profile_phase(r), fatal=False)
        r.phase("decode_core", lambda: decode_core_phase(r), fatal=False)
        r.phase("accept_rows", lambda: accept_rows_phase(r), fatal=False)
        r.phase("draft_block", lambda: draft_block_phase(r), fatal=False)
        share = max(0.0, r.deadline.left() - cfg.eval.reserve_s - cfg.output_reserve_s) / len(cfg.drafters)
        for name in cfg.drafters:  # each drafter its own share and failure scope
            ok &= r.phase(f"train:{name}", lambda name=name: train_phase(r, name, share), fatal=False)
        ok &= r.phase("save", lambda: save_phase(r), fatal=False)
        ok &= r.phase("eval", lambda: eval_phase(r), fatal=False)
        ok &= r.phase("plot", lambda: plot_phase(r), fatal=False)
    ok &= not r.summary["errors"]
    print(json.dumps(r.summary, default=_json_default))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
