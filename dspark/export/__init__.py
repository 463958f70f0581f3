"""Export as a first-class step: one drafter -> the serving engines' checkpoint layouts.

    export_drafter(drafter, "out/vllm", "vllm")              # an in-memory drafter (target attached)
    export_ref("models:/tiny-dspark@champion", "out/vllm", "vllm")  # any drafter reference
    attach_exports(drafter_or_dir, run_id, model_name, version)   # jobs: log + tag a registered version

Formats (see dspark/export/vllm.py and dspark/export/sglang.py for the exact layouts):
  vllm         speculators-format config for vLLM's DFlash / DSpark / Eagle3 loaders
  speculators  the same layout as the `speculators` library loads it (MASK must be a vocab row)
  sglang       SGLang's LlamaForCausalLMEagle3 / DFlashDraftModel / Qwen3DSparkModel layouts
A drafter whose shape a format cannot express raises ExportError naming the field. Weights are
written in `dtype` (default bf16; config.json records `torch_dtype`). Each export lists the engine
features it needs in config.json `dspark_export.requires`; those that older engine builds misread
without an error are also raised as EngineVersionWarning. `portable=True` refuses an export whose
verifier is named by a path on this machine.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
import warnings
from typing import Literal

import torch

from dspark.drafters.base import Drafter
from dspark.export.sglang import export_sglang
from dspark.export.vllm import ExportError, export_vllm, is_local_path

log = logging.getLogger(__name__)

Format = Literal["speculators", "vllm", "sglang"]
FORMATS: tuple[str, ...] = ("vllm", "speculators", "sglang")
EXPORTS_ARTIFACT = "exports"  # run artifact folder: exports/<format>/{config.json, model.safetensors}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class EngineVersionWarning(UserWarning):
    """The export needs an engine feature that older builds of that engine silently misread."""


def export_drafter(drafter: Drafter, out_dir: str, fmt: str, *, dtype: str | torch.dtype = "bf16",
                   verifier: str | None = None, portable: bool = False) -> str:
    """Write `drafter` to `out_dir` (local or s3://) in format `fmt`; returns out_dir."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    check_portable(fmt, verifier, portable)
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    if fmt == "sglang":
        export_sglang(drafter, out_dir, dtype=dtype)
    else:
        export_vllm(drafter, out_dir, dtype=dtype, flavor=fmt, verifier_name=verifier)
    warn_requirements(out_dir)
    return out_dir


def check_portable(fmt: str, verifier: str | None, portable: bool) -> None:
    """--portable: the config must name its verifier so that another machine can open it."""
    if not portable or fmt == "sglang":  # SGLang's configs name no verifier (it is the served model)
        return
    if not verifier:
        raise ExportError("--portable requires --verifier (the target's hub id, or its path on the serving "
                          "machine): without it the export names this machine's copy of the target")
    if is_local_path(verifier):
        raise ExportError(f"--portable: --verifier {verifier!r} is a path on this machine; give the hub id")


def warn_requirements(out_dir: str) -> None:
    """Warn about each engine feature the written export needs that older engines misread silently."""
    from dspark.io import storage

    config = json.loads(storage.read_text(storage.join(str(out_dir), "config.json")))
    for need in [n for n in config.get("dspark_export", {}).get("requires", []) if n.get("silent")]:
        at_least = f" >= {need['min_version']}" if need.get("min_version") else ""
        warnings.warn(f"this export needs {need['engine']}{at_least}: {need['feature']}. {need['older']}.",
                      EngineVersionWarning, stacklevel=3)


def load_for_export(ref: str, target: str | None = None) -> Drafter:
    """Load a drafter reference (local dir, s3://, runs:/, models:/) with its target attached (the
    target named in the checkpoint unless `target` overrides it: exports copy its embedding rows)."""
    from dspark.io import storage
    from dspark.io.drafter_source import load_drafter_ref, local_dir
    from dspark.drafters.checkpoint import read_checkpoint_config
    from dspark.models.target import load_target

    meta = read_checkpoint_config(local_dir(ref))["target_meta"]
    spec = target or meta.get("name")
    if not spec:
        raise ValueError(f"drafter {ref}: its checkpoint names no target; pass --target")
    return load_drafter_ref(ref, load_target(spec, local_copy=storage.local_copy))


def export_ref(ref: str, out_dir: str, fmt: str, *, target: str | None = None, verifier: str | None = None,
               dtype: str | torch.dtype = "bf16", portable: bool = False) -> str:
    """`dspark export`: resolve `ref`, load it against its target and write the export."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    check_portable(fmt, verifier, portable)
    return export_drafter(load_for_export(ref, target), out_dir, fmt, dtype=dtype, verifier=verifier,
                          portable=portable)


def attach_exports(drafter: Drafter | str, run_id: str | None, model_name: str | None, version: str | None,
                   *, target: str | None = None, formats: tuple[str, ...] = FORMATS) -> dict[str, str]:
    """Export to every format the drafter fits, log each under the run's `exports/<format>` artifacts
    and tag the registered model version with its URI (`dspark.export.<format>`); a format that
    cannot express the drafter is tagged `dspark.export.<format>.skipped` with the reason.
    `drafter`: a Drafter with its target attached, or a checkpoint reference loaded with `target`.
    Returns {format: artifact URI or "skipped: <reason>"}; does nothing without a run."""
    if not run_id:
        return {}
    try:  # the drafter is already logged and registered: a failed export warns, never fails the job
        results = log_exports(drafter, run_id, target, formats)
        if model_name and version:
            tag_exports(model_name, str(version), results)
    except Exception as err:  # noqa: BLE001 - target loading, storage and MLflow raise many types
        log.warning("engine exports were not attached to run %s: %s", run_id, err, exc_info=True)
        return {"error": f"{type(err).__name__}: {err}"}
    return results


def log_exports(drafter: Drafter | str, run_id: str, target: str | None, formats: tuple[str, ...]) -> dict[str, str]:
    from dspark.io import tracking

    drafter = load_for_export(drafter, target) if isinstance(drafter, str) else drafter
    results: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="dspark-exports-") as tmp:
        for fmt in formats:
            try:
                export_drafter(drafter, os.path.join(tmp, fmt), fmt)
            except ExportError as err:
                log.warning("drafter not exported as %s: %s", fmt, err)
                results[fmt] = f"skipped: {err}"
                continue
            tracking.log_artifact(os.path.join(tmp, fmt), f"{EXPORTS_ARTIFACT}/{fmt}")
            results[fmt] = f"runs:/{run_id}/{EXPORTS_ARTIFACT}/{fmt}"
    return results


def tag_exports(name: str, version: str, results: dict[str, str]) -> None:
    from dspark.io.tracking import registry

    registry.set_model_version_tags(name, version, {
        f"dspark.export.{fmt}" + (".skipped" if value.startswith("skipped") else ""): value
        for fmt, value in results.items()})
