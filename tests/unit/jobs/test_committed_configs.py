"""Every committed job config validates against its job's config model, as `--config FILE` would load it:
a renamed field or a typo in a YAML file under configs/ fails here, not on a user's cluster."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from dspark.config import load_config

ROOT = Path(__file__).resolve().parents[3]
# configs/<folder>/*.yaml -> the job that reads them (module, config model)
JOB_OF_FOLDER = {
    "synthesize": ("jobs.synthesize", "SynthesizeJobConfig"),
    "generate": ("jobs.generate", "GenerateConfig"),
    "train": ("jobs.train", "TrainJobConfig"),
    "calibrate": ("jobs.calibrate", "CalibrateConfig"),
    "evaluate": ("jobs.evaluate", "EvalConfig"),
    "serve": ("jobs.serve", "ServeJobConfig"),
    "flywheel": ("jobs.demo.flywheel", "FlywheelDemoConfig"),
}
JOB_OF_FILE = {"flywheel/tiny-promote.yaml": ("jobs.promote", "PromoteConfig")}
CONFIGS = sorted(str(p.relative_to(ROOT / "configs")) for folder in JOB_OF_FOLDER
                 for p in (ROOT / "configs" / folder).glob("*.yaml"))


def test_every_job_folder_has_configs():
    assert {c.split("/")[0] for c in CONFIGS} == set(JOB_OF_FOLDER)


@pytest.mark.parametrize("name", CONFIGS)
def test_committed_config_validates(name):
    module, model = JOB_OF_FILE.get(name) or JOB_OF_FOLDER[name.split("/")[0]]
    config_model = getattr(importlib.import_module(module), model)
    cfg = load_config(config_model, str(ROOT / "configs" / name), [])
    assert type(cfg) is config_model
