"""Drafter checkpoints: an HF-style directory with `config.json` + `model.safetensors`.

config.json = {"format": "dspark-drafter", "format_version": 1, "algo", "drafter_config" (resolved
DrafterConfig), "target_meta" (name, revision, hidden_size, vocab_size, num_layers, layer_ids),
"calibration" (STS temperatures or null), "draft_temperature" (Drafter.draft_sampling; 1 when absent)}.
model.safetensors holds the drafter's own state_dict only: the target's embedding and LM head are shared
by reference and never written. A drafter with a draft vocabulary (drafter_config.draft_vocab_size = N)
also stores its maps there as buffers, in the
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
            "calibration": None if drafter.calibration is None else [float(t) for t in drafter.calibration],
            "draft_temperature": float(drafter.draft_temperature)}


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


def saved_draft_ids(local_dir: str) -> torch.Tensor | None:
    """The draft vocabulary (ascending target ids) a checkpoint was trained with, from its d2t/t2d maps;
    None when it drafts over the full vocabulary."""
    from safetensors import safe_open

    from dspark.drafters.draft_vocab import check_maps

    _require_local(local_dir, "saved_draft_ids", "load_drafter_ref")
    with safe_open(os.path.join(local_dir, WEIGHTS_FILE), framework="pt") as f:
        if "d2t" not in f.keys():
            return None
        return check_maps(f.get_tensor("d2t"), f.get_tensor("t2d"))


def checked_draft_temperature(value, source: str) -> float:
    """A saved draft temperature: a finite number > 0 (Drafter.draft_sampling), else one clear error."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < float(value) < float("inf"):
        raise ValueError(f"{source}: draft_temperature {value!r} must be a number > 0 (1 = the request's temperature)")
    return float(value)


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


def load_weights(drafter: Drafter, local: str) -> None:
    """The checkpoint's tensors into `drafter` (built from its config.json): ValueError naming the file and
    the first mismatches when the file is unreadable or does not fit the config (corrupt or edited)."""
    path = os.path.join(local, WEIGHTS_FILE)
    try:
        state = load_file(path)
    except FileNotFoundError:
        raise ValueError(f"drafter {local}: {WEIGHTS_FILE} is missing; the checkpoint is incomplete") from None
    except Exception as err:  # noqa: BLE001 - safetensors raises its own error types for truncated files
        raise ValueError(f"drafter {local}: {WEIGHTS_FILE} is unreadable ({err}); the file is corrupt or "
                         f"truncated — copy or export the drafter again") from None
    try:
        drafter.load_state_dict(state, strict=True)
    except RuntimeError as err:
        details = "; ".join(line.strip() for line in str(err).splitlines()[1:4])
        raise ValueError(f"drafter {local}: {WEIGHTS_FILE} does not match its config.json ({details}); the "
                         f"checkpoint is corrupt or was edited — export it again") from None


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
    load_weights(drafter, local)
    drafter.calibration = data.get("calibration")
    drafter.draft_temperature = checked_draft_temperature(data.get("draft_temperature", 1.0), local)
    device = device if device is not None else (target.device if target is not None else "cpu")
    drafter = drafter.to(device=device, dtype=dtype) if dtype is not None else drafter.to(device=device)
    if target is not None:
        drafter.attach_target(target)
    return drafter


# ---------------------------------------------------------------- bundles (a few files that travel)
BUNDLE_PREFIX = "drafters.tar."


def save_bundle(drafters: dict[str, Drafter], dest: str, part_bytes: int, dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """Every drafter's checkpoint (floating weights cast to `dtype`; the frozen target parts are never in
    a drafter's state) in one tar under `<name>/`, cut into as few `drafters.tar.NN` parts of at most
    `part_bytes` as fit; -> the part paths. `load_bundle` reverses it."""
    import io
    import tarfile
    import tempfile

    buf = io.BytesIO()
    with tempfile.TemporaryDirectory() as tmp, tarfile.open(fileobj=buf, mode="w") as tar:
        for name, drafter in drafters.items():
            drafter = getattr(drafter, "module", drafter)
            write_local(drafter, os.path.join(tmp, name))
            path = os.path.join(tmp, name, WEIGHTS_FILE)
            state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in load_file(path).items()}
            save_file(state, path, metadata={"format": "pt", "dspark": FORMAT})
            tar.add(os.path.join(tmp, name), arcname=name)
    data, parts = buf.getvalue(), []
    os.makedirs(dest, exist_ok=True)
    for i in range(0, len(data), part_bytes):
        parts.append(os.path.join(dest, f"{BUNDLE_PREFIX}{i // part_bytes:02d}"))
        with open(parts[-1], "wb") as f:
            f.write(data[i:i + part_bytes])
    return parts


def load_bundle(src: str, target=None, device: str | torch.device | None = None) -> dict[str, Drafter]:
    """The drafters of a bundle written by `save_bundle` (its parts joined in order), by name."""
    import io
    import tarfile
    import tempfile

    parts = sorted(p for p in os.listdir(src) if p.startswith(BUNDLE_PREFIX))
    if not parts:
        raise FileNotFoundError(f"{src} holds no {BUNDLE_PREFIX}NN parts")
    data = b"".join(open(os.path.join(src, p), "rb").read() for p in parts)
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            tar.extractall(tmp, filter="data")
        return {name: load_drafter(os.path.join(tmp, name), target=target, device=device)
                for name in sorted(os.listdir(tmp))}
