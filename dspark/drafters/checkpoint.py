"""Drafter checkpoints: an HF-style directory with `config.json` + `model.safetensors`.

config.json = {"format": "dspark-drafter", "format_version": 1, "algo", "drafter_config" (resolved
DrafterConfig), "target_meta" (name, revision, hidden_size, vocab_size, num_layers, layer_ids),
"calibration" (STS temperatures or null)}. model.safetensors holds the drafter's own state_dict only:
the target's embedding and LM head are shared by reference and never written. A drafter with a
draft vocabulary (drafter_config.draft_vocab_size = N) also stores its maps there as buffers, in the
speculators layout: `d2t` [N] int64 offsets (target id = draft id + d2t) and `t2d` [V] bool; loading
checks that they agree (dspark.drafters.draft_vocab.check_maps). Directories may be
local or s3:// (through dspark.io.storage); a round trip reproduces the weights bit for bit.
"""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

from dspark.drafters.base import Drafter
from dspark.drafters.registry import drafter_from_config
from dspark.drafters.config import DrafterConfig

FORMAT = "dspark-drafter"
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def checkpoint_config(drafter: Drafter) -> dict:
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "algo": drafter.algo,
            "drafter_config": drafter.config.model_dump(), "target_meta": drafter.target_meta,
            "calibration": None if drafter.calibration is None else [float(t) for t in drafter.calibration]}


def write_local(drafter: Drafter, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    save_file(state, os.path.join(out_dir, WEIGHTS_FILE), metadata={"format": "pt", "dspark": FORMAT})
    with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
        json.dump(checkpoint_config(drafter), f, indent=2)


def save_drafter(drafter: Drafter, out_dir: str) -> str:
    """Write the checkpoint to a local dir; returns out_dir. (Object storage is an io concern:
    dspark.io.drafter_source.save_drafter_to writes here, then uploads.)"""
    _require_local(out_dir, "save_drafter", "save_drafter_to")
    write_local(getattr(drafter, "module", drafter), str(out_dir))  # unwrap DDP / DeepSpeed engines
    return str(out_dir)


def _require_local(path: str, what: str, io_function: str) -> None:
    if "://" in str(path):
        raise ValueError(f"{what}({path!r}): a local directory is expected here; for object storage use "
                         f"dspark.io.drafter_source.{io_function}")


def read_checkpoint_config(local_dir: str) -> dict:
    path = os.path.join(local_dir, CONFIG_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: not a dspark drafter checkpoint directory")
    with open(path) as f:
        data = json.load(f)
    if data.get("format") != FORMAT:
        raise ValueError(f"{path} is not a dspark drafter checkpoint (format={data.get('format')!r}); "
                         "vLLM exports cannot be loaded back, load the original checkpoint")
    if data.get("format_version", 0) > FORMAT_VERSION:
        raise ValueError(f"{path} has format_version {data['format_version']}, newer than this code "
                         f"({FORMAT_VERSION}); upgrade dspark")
    return data


def check_target(meta: dict, target, source: str, check_name: bool = True) -> None:
    """Fail with one clear line when `target` is not the model the drafter was trained against."""
    problems = []
    if check_name and meta.get("name") != target.name:
        problems.append(f"name {meta.get('name')!r} != {target.name!r}")
    for key in ("hidden_size", "vocab_size", "num_layers"):
        if key in meta and meta[key] != getattr(target, key):
            problems.append(f"{key} {meta[key]} != {getattr(target, key)}")
    bad = [i for i in meta.get("layer_ids", []) if not 0 <= i < target.num_layers]
    if bad:
        problems.append(f"layer ids {bad} do not exist in a {target.num_layers}-layer target")
    if problems:
        hint = " (pass check_name=False if only the name differs, e.g. a local copy of the same model)" \
            if problems[0].startswith("name") and len(problems) == 1 else ""
        raise ValueError(f"drafter {source} was trained for another target: {'; '.join(problems)}. "
                         f"Load it with its own target{hint}.")


def load_drafter(path_or_uri: str, target=None, *, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None, check_name: bool = True) -> Drafter:
    """Load a local checkpoint dir. With `target`, verify it matches and attach it."""
    local = str(path_or_uri)
    _require_local(local, "load_drafter", "load_drafter_ref")
    data = read_checkpoint_config(local)
    cfg = DrafterConfig.model_validate(data["drafter_config"])
    if target is not None:
        check_target(data["target_meta"], target, str(path_or_uri), check_name)
    drafter = drafter_from_config(cfg, data["target_meta"])
    drafter.load_state_dict(load_file(os.path.join(local, WEIGHTS_FILE)), strict=True)
    drafter.calibration = data.get("calibration")
    device = device if device is not None else (target.device if target is not None else "cpu")
    drafter = drafter.to(device=device, dtype=dtype) if dtype is not None else drafter.to(device=device)
    if target is not None:
        drafter.attach_target(target)
    return drafter
