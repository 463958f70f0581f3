"""The GPU machine's image, as far as the recipe is concerned, and a local Python 3.12 copy of it.

`IMAGE` pins what the image holds (DEVELOPERS.md / the device notes: Python 3.12.3, torch 2.11.0,
transformers 5.17.0, tokenizers 0.23.2, safetensors 0.8.0, numpy 2.5.2, huggingface_hub 1.33.0, accelerate 1.15.0 (transformers needs it to read GGUF), and
pyarrow, pyyaml, matplotlib, psutil, tqdm); `MISSING` is what the image lacks and the recipe imports, so it travels
as wheels in the prepared bundle (recipes/gpu_prepare.py).

`python -m recipes.gpu_image` builds the simulated image: a Python 3.12 virtual environment (under
$DSPARK_CACHE/gpu-sim/, default ~/.cache/dspark/gpu-sim/) holding exactly IMAGE and its dependencies,
installed from downloaded wheels with --no-deps, and without MISSING (checked: importing pydantic
fails there). torch: the package index reachable here has no CPU build of torch 2.11 for Python 3.12
(PyPI's Linux wheel is the CUDA 13 build), so the simulated image installs that very wheel with its
CUDA runtime wheels (~2.7 GB once); it runs on the CPU as the GPU image's torch would without a GPU.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

PYTHON312 = os.environ.get("PYTHON312", "/root/.pyenv/versions/3.12.1/bin/python3.12")
IMAGE = ["torch==2.11.0", "transformers==5.17.0", "tokenizers==0.23.2", "safetensors==0.8.0", "numpy==2.5.2",
         "huggingface_hub==1.33.0", "accelerate==1.15.0", "pyarrow", "pyyaml", "matplotlib", "psutil", "tqdm"]
MISSING = ["pydantic", "pydantic-core", "annotated-types", "typing-inspection", "pydantic-settings",
           "python-dotenv", "gguf"]  # gguf: transformers reads the smollm2 target's GGUF file with it
_MISSING_WHEELS = tuple(n.replace("-", "_") for n in MISSING)


def sim_root() -> Path:
    base = os.environ.get("DSPARK_CACHE") or str(Path.home() / ".cache" / "dspark")
    return Path(base) / "gpu-sim"


def run(cmd: list[str], **kw) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)


def build(root: Path | None = None) -> Path:
    """-> the simulated image's python (built once; a stamp file marks a finished build)."""
    root = root or sim_root()
    venv, wheels = root / "venv", root / "wheels"
    python = venv / "bin" / "python"
    stamp = venv / ".image-installed"
    if stamp.exists() and stamp.read_text() == "\n".join(IMAGE):
        return python  # built for this IMAGE list (a changed list installs what it adds)
    wheels.mkdir(parents=True, exist_ok=True)
    run([PYTHON312, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "-d", str(wheels), *IMAGE])
    if not venv.exists():
        run([PYTHON312, "-m", "venv", str(venv)])
    picked = [str(w) for w in sorted(wheels.glob("*.whl")) if not w.name.lower().startswith(_MISSING_WHEELS)]
    run([str(python), "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", *picked])
    check = subprocess.run([str(python), "-c", "import pydantic"], capture_output=True)
    if check.returncode == 0:
        raise RuntimeError(f"the simulated image {venv} imports pydantic; it must not")
    run([str(python), "-c", "import torch, transformers, sys; print('simulated image: python', sys.version.split()[0],"
                            " 'torch', torch.__version__, 'transformers', transformers.__version__)"])
    stamp.write_text("\n".join(IMAGE))
    return python


if __name__ == "__main__":
    print(build())
    sys.exit(0)
