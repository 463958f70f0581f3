"""Typed configs: pydantic models that reject unknown keys, loaded from YAML with dotted overrides.

Every job config is a `StrictModel`; `load_config(Model, path, ["train.lr=3e-4"])` reads the YAML,
applies the overrides and validates. Errors name the offending key and how to fix it.
"""
from __future__ import annotations

import json
import os
import posixpath
import re
from pathlib import Path
from typing import Annotated, Any, Callable, TypeVar

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError


class StrictModel(BaseModel):
    """Base for every config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


# ---- sections shared by the job configs ------------------------------------------------------------
def absolute_if_local(ref: str | None) -> str | None:
    """A relative path naming a file or directory here becomes absolute, so Ray workers and Serve replicas
    (whose working directory is not the driver's) find it; URIs, names and paths not here pass unchanged."""
    if ref and "://" not in ref and ":/" not in ref and not os.path.isabs(ref) and os.path.exists(ref):
        return os.path.abspath(ref)
    return ref


# an input reference (local path | s3:// | runs:/ | models:/ | a name), made absolute when it is a local
# path relative to where the config is loaded
ModelRef = Annotated[str, AfterValidator(absolute_if_local)]


def check_alias(alias: str) -> str:
    """MLflow's rules for a registered-model alias, checked when a config loads (MLflow itself only checks
    at registration, i.e. after training): 1-255 letters, digits, '_' or '-'; not 'latest' (any case), not
    'v<N>'/'V<N>' (both reserved for versions)."""
    if not re.fullmatch(r"[\w-]{1,255}", alias):
        raise ValueError(f"alias {alias!r} is not a valid MLflow alias: use 1-255 letters, digits, '_' or '-'")
    if alias.lower() == "latest" or re.fullmatch(r"[vV]\d+", alias):
        raise ValueError(f"alias {alias!r} is reserved by MLflow ('latest' and v<N> name versions); choose another")
    return alias


# a registered-model alias (e.g. champion, trained), validated by MLflow's rules at config load
ModelAlias = Annotated[str, AfterValidator(check_alias)]


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


BASE_KEY = "base"  # a config file may name the file(s) it extends: `base: smollm2-135m.yaml`


def read_yaml(path: str | Path, read_text: Callable[[str], str] | None = None, _seen: tuple = ()) -> dict:
    """A config file as a mapping, its `base:` file(s) (relative to it, read first, in order) merged
    under it key by key (mappings merge, anything else is replaced). `read_text` reads other sources
    (the jobs pass dspark.io.storage.read_text for s3:// configs); default: the local file."""
    path = str(path)
    if path in _seen:
        raise ConfigError(f"config files extend each other in a loop: {' -> '.join(_seen + (path,))}")
    try:
        text = read_text(path) if read_text else Path(path).read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    bases = data.pop(BASE_KEY, None) or []
    merged: dict = {}
    for base in [bases] if isinstance(bases, str) else bases:
        base_path = base if "://" in base or base.startswith("/") else posixpath.join(posixpath.dirname(path), base)
        merged = deep_merge(merged, read_yaml(base_path, read_text, _seen + (path,)))
    return deep_merge(merged, data)


def deep_merge(base: dict, overlay: dict) -> dict:
    """`overlay` over `base`: nested mappings merge key by key; lists and scalars replace."""
    out = dict(base)
    for key, value in overlay.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load_config(model: type[M], path: str | Path | None = None, overrides: list[str] | None = None,
                read_text: Callable[[str], str] | None = None) -> M:
    """Load YAML (optional; `base:` files merged under it), apply dotted overrides, validate into `model`."""
    data = read_yaml(path, read_text) if path else {}
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
