"""Export as a first-class step: one drafter -> the serving engines' checkpoint layouts.

    export_drafter(drafter, "out/vllm", "vllm")              # an in-memory drafter (target attached)
    export_ref("models:/tiny-dspark@latest", "out/vllm", "vllm")  # any drafter reference
    attach_exports(drafter_or_dir, run_id, model_name, version)   # jobs: log + tag a registered version

Formats (see dspark/export/vllm.py and sglang_export.py for the exact layouts):
  vllm         speculators-format config for vLLM's DFlash / DSpark / Eagle3 loaders
  speculators  the same layout as the `speculators` library loads it (MASK must be a vocab row)
  sglang       SGLang's LlamaForCausalLMEagle3 / DFlashDraftModel layouts (no DSpark loader)
A drafter whose shape a format cannot express raises ExportError naming the field.
"""
from __future__ import annotations

import logging
import os
import tempfile
from typing import Literal

import torch

from dspark.drafters.base import Drafter
from dspark.export.sglang import export_sglang
from dspark.export.vllm import ExportError, export_vllm

log = logging.getLogger(__name__)

Format = Literal["speculators", "vllm", "sglang"]
FORMATS: tuple[str, ...] = ("vllm", "speculators", "sglang")
EXPORTS_ARTIFACT = "exports"  # run artifact folder: exports/<format>/{config.json, model.safetensors}


def export_drafter(drafter: Drafter, out_dir: str, fmt: str, *, dtype: torch.dtype | None = None,
                   verifier: str | None = None) -> str:
    """Write `drafter` to `out_dir` (local or s3://) in format `fmt`; returns out_dir."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if fmt == "sglang":
        return export_sglang(drafter, out_dir, dtype=dtype)
    return export_vllm(drafter, out_dir, dtype=dtype, flavor=fmt, verifier_name=verifier)


def load_for_export(ref: str, target: str | None = None) -> Drafter:
    """Load a drafter reference (local dir, s3://, runs:/, models:/) with its target attached (the
    target named in the checkpoint unless `target` overrides it: exports copy its embedding rows)."""
    from dspark.io.drafter_source import load_drafter_ref, local_dir
    from dspark.drafters.checkpoint import read_checkpoint_config
    from dspark.models.target import load_target

    meta = read_checkpoint_config(local_dir(ref))["target_meta"]
    spec = target or meta.get("name")
    if not spec:
        raise ValueError(f"drafter {ref}: its checkpoint names no target; pass --target")
    return load_drafter_ref(ref, load_target(spec))


def export_ref(ref: str, out_dir: str, fmt: str, *, target: str | None = None, verifier: str | None = None,
               dtype: torch.dtype | None = None) -> str:
    """`dspark export`: resolve `ref`, load it against its target and write the export."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    return export_drafter(load_for_export(ref, target), out_dir, fmt, dtype=dtype, verifier=verifier)


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
            tag_version(model_name, str(version), results)
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


def tag_version(name: str, version: str, results: dict[str, str]) -> None:
    from dspark.io import tracking

    tracking.set_model_version_tags(name, version, {
        f"dspark.export.{fmt}" + (".skipped" if value.startswith("skipped") else ""): value
        for fmt, value in results.items()})
