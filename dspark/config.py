"""Typed configs: pydantic models that reject unknown keys, loaded from YAML with dotted overrides.

Every job config is a `StrictModel`; `load_config(Model, path, ["train.lr=3e-4"])` reads the YAML,
applies the overrides and validates. Errors name the offending key and how to fix it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError


class StrictModel(BaseModel):
    """Base for every config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


# ---- sections shared by the job configs ------------------------------------------------------------
class RayConfig(StrictModel):
    address: str | None = Field(None, description="None: $RAY_ADDRESS if set, else start a (new) local Ray on 127.0.0.1")
    num_cpus: int | None = Field(None, description="CPUs of a local Ray (ignored when connecting to a cluster)")
    num_gpus: int | None = Field(None, description="GPUs of a local Ray")


class TrackingConfig(StrictModel):
    enabled: bool = Field(True, description="log to MLflow (MLFLOW_TRACKING_URI, else the local store under .dspark/mlruns)")
    experiment: str = Field("dspark", description="MLflow experiment")
    run_name: str | None = Field(None, description="None: the job picks one")


class ConfigError(ValueError):
    """A config could not be loaded; the message names the key and the fix."""


M = TypeVar("M", bound=StrictModel)


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a","b","c"], value parsed as YAML scalar/list/dict)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key.path=value (e.g. train.lr=3e-4)")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {text!r} has an empty key")
    value = yaml.safe_load(raw) if raw.strip() else ""
    return key.split("."), value


def apply_overrides(data: dict, overrides: list[str] | None) -> dict:
    """Set each dotted key in a nested dict (creating intermediate dicts)."""
    for text in overrides or []:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {part!r} is a value, not a section")
            node = child
        node[path[-1]] = value
    return data


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<root>"
        if e["type"] == "extra_forbidden":
            lines.append(f"unknown key '{loc}' (check the spelling; see the config reference in README.md)")
        else:
            lines.append(f"'{loc}': {e['msg']} (got {e.get('input')!r})")
    return f"invalid config {source}: " + "; ".join(lines)


def validate_config(model: type[M], data: dict, source: str = "") -> M:
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, source)) from None


def read_yaml(path: str | Path) -> dict:
    from dspark.io import storage  # local import: storage pulls optional S3 deps

    try:
        text = storage.read_text(str(path))
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return data


def load_config(model: type[M], path: str | Path | None = None, overrides: list[str] | None = None) -> M:
    """Load YAML (optional), apply dotted overrides, validate into `model`."""
    data = read_yaml(path) if path else {}
    data = apply_overrides(data, overrides)
    return validate_config(model, data, source=str(path or "<defaults>"))


def config_to_dict(cfg: StrictModel) -> dict:
    return json.loads(cfg.model_dump_json())


def dump_config(cfg: StrictModel) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """Nested dict -> {"a.b": v} (for MLflow params)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out
