"""Resolve a drafter reference to a local checkpoint directory and load it against a target.

Accepted references (the same everywhere a job or the server takes a drafter):
  /path/to/dir                     a local HF-style dir (config.json + model.safetensors)
  s3://bucket/prefix               copied once into the storage cache (dspark.io.storage.local_copy)
  runs:/<run_id>/<artifact_path>   an MLflow run artifact directory
  models:/<name>/<version>         a registered model version
  models:/<name>@<alias>           a registered model alias (`@champion`: the serving one, moved by jobs.promote)
  models:/<name>/latest            MLflow's own keyword: the newest version
A registered version is an MLflow model (dspark.io.tracking.drafter_model): its checkpoint is the model's
artifacts/drafter/ folder. `models:/<name>@latest` (MLflow reserves "latest": no such alias can exist)
still resolves to the newest version, with a DeprecationWarning; write `@champion` or `/latest`.

Usage:  drafter = load_drafter_ref("models:/tiny-dspark@champion", target)
MLflow references are downloaded once into $DSPARK_CACHE/drafters/<key>, where <key> names the bytes,
not just the reference: the tracking server URI, the reference and, for a model version, the run id
and artifact source it was registered from. Two servers (two stacks, a wiped and recreated stack, a
cluster and a laptop) that both hold `models:/x/1` therefore never share a cache entry. Loading against a target raises ValueError (naming the reference) when
the drafter was trained for another target (name, hidden/vocab size, layer ids).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

_MODEL_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[^/]+)|/(?P<version>[^/]+))(?P<path>/.*)?$")


@dataclass(frozen=True)
class DrafterRef:
    kind: str  # "local" | "s3" | "run" | "model"
    uri: str
    model_name: str | None = None  # kind "model": registered model name
    model_version: str | None = None  # kind "model": version number (after resolve_ref), alias before


def parse_ref(ref: str) -> DrafterRef:
    """Classify a reference without touching the network."""
    ref = str(ref).strip()
    if ref.startswith("s3://"):
        return DrafterRef("s3", ref)
    if ref.startswith("runs:/"):
        return DrafterRef("run", ref)
    if ref.startswith("models:/"):
        match = _MODEL_URI.match(ref)
        if not match:
            raise ValueError(f"drafter reference {ref!r}: expected models:/<name>/<version> or models:/<name>@<alias>")
        return DrafterRef("model", ref, match["name"], match["version"] or f"@{match['alias']}")
    if re.match(r"^[a-z][a-z0-9+.-]*://", ref):
        raise ValueError(f"drafter reference {ref!r}: unsupported scheme; use a local dir, s3://, runs:/ or models:/")
    return DrafterRef("local", ref)


def resolve_ref(ref: str | DrafterRef) -> DrafterRef:
    """For models:/ references, turn an alias (or `latest`) into a concrete version number."""
    ref = parse_ref(ref) if isinstance(ref, str) else ref
    if ref.kind != "model":
        return ref
    client = _mlflow_client()
    if not ref.model_version.startswith("@") and ref.model_version != "latest":  # pinned: check it exists
        try:
            client.get_model_version(ref.model_name, ref.model_version)
        except Exception as err:  # noqa: BLE001 - MLflow raises RestException / MlflowException
            raise ValueError(f"drafter reference {ref.uri!r}: {err}") from None
        return ref
    alias = ref.model_version.lstrip("@")
    if ref.model_version == "@latest":
        warnings.warn(f"drafter reference {ref.uri!r}: MLflow reserves 'latest', so other MLflow tools cannot "
                      f"resolve @latest; use models:/{ref.model_name}@champion (the serving alias) or "
                      f"models:/{ref.model_name}/latest (the newest version)", DeprecationWarning, stacklevel=3)
    if alias == "latest":  # MLflow's `models:/<name>/latest`, and the deprecated `@latest`
        versions = client.search_model_versions(f"name='{ref.model_name}'")
        if not versions:
            raise ValueError(f"drafter reference {ref.uri!r}: registered model {ref.model_name!r} "
                             f"has no versions")
        version = str(max(int(v.version) for v in versions))
    else:
        try:
            version = str(client.get_model_version_by_alias(ref.model_name, alias).version)
        except Exception as err:  # noqa: BLE001 - MLflow raises RestException / MlflowException
            raise ValueError(f"drafter reference {ref.uri!r}: {err}") from None
    suffix = _MODEL_URI.match(ref.uri)["path"] or ""
    return DrafterRef("model", f"models:/{ref.model_name}/{version}{suffix}", ref.model_name, version)


def local_dir(ref: str | DrafterRef) -> str:
    """A local directory holding the drafter checkpoint (downloading and caching when needed)."""
    ref = resolve_ref(ref)
    if ref.kind == "local":
        if not os.path.isdir(ref.uri):
            raise FileNotFoundError(f"drafter directory not found: {ref.uri}")
        return _checkpoint_dir(ref.uri, ref.uri)
    if ref.kind == "s3":
        from dspark.io import storage

        return _checkpoint_dir(storage.local_copy(ref.uri), ref.uri)
    source = mlflow_source(ref)
    cached = _cache_root() / hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest()[:20]
    if not cached.is_dir():
        _download_mlflow(ref.uri, cached, source)
    return _checkpoint_dir(str(cached), ref.uri)


def mlflow_source(ref: DrafterRef) -> dict[str, str]:
    """What an MLflow reference resolves to on the current tracking server: its URI, the reference and,
    for a registered version, the run id, artifact source and creation time behind it. Run ids are
    random per server, so a re-registered `models:/x/1` (another server, a wiped store) differs."""
    from dspark.io import tracking

    source = {"tracking_uri": tracking.tracking_uri(), "ref": ref.uri}
    if ref.kind == "model":
        try:
            version = _mlflow_client().get_model_version(ref.model_name, ref.model_version)
        except Exception as err:  # noqa: BLE001 - MLflow raises RestException / MlflowException
            raise ValueError(f"drafter reference {ref.uri!r} on {source['tracking_uri']}: {err}") from None
        source.update(run_id=version.run_id or "", artifact_source=version.source or "",
                      created=str(version.creation_timestamp))
    return source


def load_drafter_ref(ref: str, target=None, device=None):
    """Resolve `ref`, load the drafter (attached to `target` when given) and check it fits the target.
    device None: the target's device (cpu without a target)."""
    from dspark.drafters import load_drafter

    try:
        return load_drafter(local_dir(ref), target, device=device)  # checks target name, sizes and layer ids
    except ValueError as err:
        raise ValueError(f"drafter {ref}: {err}") from None


def save_drafter_to(drafter, uri: str) -> str:
    """Save a drafter checkpoint to a local dir or an s3:// prefix (written locally, then uploaded)."""
    import tempfile

    from dspark.drafters import save_drafter
    from dspark.io import storage

    if not storage.is_s3(uri):
        return save_drafter(drafter, uri)
    with tempfile.TemporaryDirectory(prefix="dspark-ckpt-") as tmp:
        storage.upload_dir(save_drafter(drafter, tmp), uri)
    return uri


# ---- helpers ---------------------------------------------------------------------------------------
def _cache_root() -> Path:
    from dspark.settings import settings

    return settings().cache / "drafters"


def _mlflow_client():
    from dspark.io.tracking import registry

    return registry.registry_client()  # of MLFLOW_TRACKING_URI or the local default store


def _download_mlflow(uri: str, dest: Path, source: dict[str, str]) -> None:
    """Download into a temp dir next to `dest`, then rename (a half-downloaded dir is never visible).
    `source` is kept beside the files as _source.json (which server and run they came from)."""
    from dspark.io.tracking import registry

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=dest.parent, prefix=".download-")
    try:
        registry.download_artifacts(uri, tmp)
        Path(tmp, "_source.json").write_text(json.dumps(source, indent=2))
        os.rename(tmp, dest)
    except OSError:
        if not dest.is_dir():  # a concurrent download that won the rename is fine
            raise
    except Exception as err:
        raise FileNotFoundError(f"cannot download drafter {uri}: {err}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _checkpoint_dir(path: str, label: str) -> str:
    """The directory that holds config.json: `path` itself, its single sub-directory that does, or (an
    MLflow model directory, with an MLmodel file) its artifacts/drafter/ folder."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    pattern = "artifacts/*/config.json" if os.path.isfile(os.path.join(path, "MLmodel")) else "*/config.json"
    found = sorted(str(p.parent) for p in Path(path).glob(pattern))
    if len(found) == 1:
        return found[0]
    raise FileNotFoundError(f"drafter {label}: no config.json in {path} (expected a dir saved by save_drafter)")
