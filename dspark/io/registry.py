"""MLflow model-registry calls of the flywheel: aliases, version tags, and the run a decision is
recorded in. (dspark.io.tracking holds runs and registration; this module only reads and moves.)"""
from __future__ import annotations

from dspark.io import tracking

BASELINE_PREFIX = "dspark.baseline."  # dspark.baseline.<domain>.tau = τ measured by jobs.evaluate


def version_of(name: str, alias: str) -> str:
    """The version an alias points to (raises when the alias does not exist)."""
    return str(tracking.registry_client().get_model_version_by_alias(name, alias).version)


def version_tags(name: str, version: str) -> dict[str, str]:
    return dict(tracking.registry_client().get_model_version(name, str(version)).tags or {})


def set_alias(name: str, alias: str, version: str) -> None:
    tracking.registry_client().set_registered_model_alias(name, alias, str(version))


def baseline(name: str, version: str) -> dict[str, float]:
    """{domain: τ} recorded on the version by `record_baseline`."""
    out = {}
    for key, value in version_tags(name, version).items():
        if key.startswith(BASELINE_PREFIX) and key.endswith(".tau"):
            out[key[len(BASELINE_PREFIX):-len(".tau")]] = float(value)
    return out


def record_baseline(name: str, version: str, tau_by_domain: dict[str, float], source: str) -> None:
    """Store the per-domain τ of an evaluation on the version (what the drift job compares with)."""
    tags = {f"{BASELINE_PREFIX}{d}.tau": f"{t:.6f}" for d, t in tau_by_domain.items()}
    tracking.set_model_version_tags(name, version, {**tags, "dspark.baseline.source": source})


def tag_version(name: str, version: str, tags: dict[str, str]) -> None:
    tracking.set_model_version_tags(name, version, tags)
