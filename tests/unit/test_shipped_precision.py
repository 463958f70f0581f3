"""Precision is chosen by the hardware, everywhere we ship (dspark/models/precision.py): no YAML under configs/,
no demo profile's `--set`-style override and no learning-curve profile pins a weights dtype or a training
precision. Each says `auto` (or leaves the key out, and its default is `auto`), which resolves to bfloat16 where
the device computes it natively (a bf16 GPU; a CPU with avx512_bf16 or AMX) and to float32 where bf16 would be
emulated (an AVX2-only CPU, ~6x slower batched)."""
from __future__ import annotations

import importlib
import re

import pytest
import yaml

from dspark.config import load_config
from tests.paths import REPO
from tests.unit.jobs import test_committed_configs as committed_configs
from tests.unit.jobs.test_committed_configs import JOB_OF_FOLDER

CONFIGS = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "configs").rglob("*.yaml"))
# a key that sets a dtype or a precision: dtype, target_forward_dtype, data_dtype, precision, torch_dtype, ...
PRECISION_KEY = re.compile(r"(dtype|precision)$", re.I)
# `key.path=value` (a --set override, a demo profile's budget) or `key: value` in a flow mapping or comment
ASSIGNMENT = re.compile(r"""(?P<key>[\w.]*(?:dtype|precision))\s*[=:]\s*['"]?(?P<value>[\w.-]+)""", re.I)
FORCED = {"bf16", "bfloat16", "float16", "fp16", "half", "torch.bfloat16", "torch.float16"}
# configs/<folder>/*.yaml -> the job config model that reads them: the map the committed-configs test keeps
JOB_OF_FILE = {f"configs/{name}": job for name, job in committed_configs.JOB_OF_FILE.items()}
JOB_OF_FOLDER_EXTRA = {"recipes": ("recipes.gpu_recipe", "RecipeConfig")}  # precision: auto by default
STAGE_MODEL = {"generate": JOB_OF_FOLDER["generate"], "train": JOB_OF_FOLDER["train"],
               "calibrate": JOB_OF_FOLDER["calibrate"], "evaluate": JOB_OF_FOLDER["evaluate"],
               "serve": JOB_OF_FOLDER["serve"]}


def precision_settings(value, path: str = "") -> dict[str, object]:
    """Every dtype/precision-like key in a parsed YAML or a config dump, by dotted path."""
    found = {}
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            if PRECISION_KEY.search(str(key)) and not isinstance(item, (dict, list)):
                found[where] = item
            found.update(precision_settings(item, where))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found.update(precision_settings(item, f"{path}[{i}]"))
    return found


def strings_in(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for item in value.values() for s in strings_in(item)]
    if isinstance(value, list):
        return [s for item in value for s in strings_in(item)]
    return []


def model_of(module: str, name: str):
    return getattr(importlib.import_module(module), name)


def test_the_scan_sees_every_config_folder():
    assert {c.split("/")[1] for c in CONFIGS} >= set(JOB_OF_FOLDER) | {"demo", "recipes"}


@pytest.mark.parametrize("name", CONFIGS)
def test_no_shipped_yaml_pins_a_dtype(name):
    """Keys say auto; no string value (a --set override such as `compute.dtype=bfloat16`) and no comment
    (a usage line) forces bf16 or fp16."""
    text = (REPO / name).read_text()
    data = yaml.safe_load(text)
    keys = precision_settings(data)
    assert all(v == "auto" for v in keys.values()), f"{name}: {keys} (say auto, or leave the key out)"
    overrides = {m["key"]: m["value"] for s in strings_in(data) for m in ASSIGNMENT.finditer(s)}
    assert all(v == "auto" for v in overrides.values()), f"{name}: overrides {overrides} pin a dtype"
    forced = [m.group(0) for m in ASSIGNMENT.finditer(text) if m["value"].lower() in FORCED]
    assert not forced, f"{name}: {forced} forces bf16/fp16 (comments included: users copy them)"


@pytest.mark.parametrize("name", [c for c in CONFIGS if c.split("/")[1] in {**JOB_OF_FOLDER, **JOB_OF_FOLDER_EXTRA}
                                  and "/base/" not in c])
def test_every_job_config_resolves_auto_with_its_defaults(name):
    """The loaded config (the file over the model's defaults): every dtype/precision field is auto."""
    folder = name.split("/")[1]
    module, model = JOB_OF_FILE.get(name) or {**JOB_OF_FOLDER, **JOB_OF_FOLDER_EXTRA}[folder]
    cfg = load_config(model_of(module, model), str(REPO / name), [])
    settings = precision_settings(cfg.model_dump())
    assert all(v == "auto" for v in settings.values()), f"{name}: {settings}"


def test_the_config_models_default_to_auto():
    from dspark.serve.config import ModelSection
    from dspark.training.config import DeepSpeedSection, TrainJobConfig
    from pipelines.eval_decode import WorkersConfig
    from pipelines.generate import ComputeConfig

    assert ComputeConfig().dtype == WorkersConfig().dtype == ModelSection().dtype == "auto"
    assert ComputeConfig(dtype=None).dtype == "auto"  # the old default, null, still reads
    assert DeepSpeedSection().precision == "auto"
    assert TrainJobConfig(run_name="r", data={"rollouts": "x"}).target_forward_dtype == "auto"


def test_demo_profiles_stage_configs_say_auto_after_their_overrides():
    """What `make demo` runs: each stage's config file with the profile's overrides applied."""
    from jobs.demo.runner import PROFILES, STAGE_CONFIG

    checked = 0
    for profile in PROFILES.values():
        for stage, template in STAGE_CONFIG.items():
            for algo in profile.algos if "{algo}" in template else [None]:
                config = template.format(target=profile.target, algo=algo)
                cfg = load_config(model_of(*STAGE_MODEL[stage]), str(REPO / config), profile.budget(stage))
                settings = precision_settings(cfg.model_dump())
                assert all(v == "auto" for v in settings.values()), f"demo {profile.name} {stage}: {settings}"
                checked += 1
    assert checked >= 3 * len(STAGE_CONFIG)


def test_learning_curve_profiles_resolve_the_dtype():
    from recipes.learning_curve.profiles import PROFILES

    for name, prof in PROFILES.items():
        settings = precision_settings(prof.model_dump(exclude_unset=True))  # the keys the profile sets
        assert settings.get("dtype") == "auto" and all(v == "auto" for v in settings.values()), (name, settings)


def test_learning_curve_target_dtype_follows_the_hardware(monkeypatch):
    from dspark.models import precision
    from recipes.learning_curve.profiles import PROFILES, target_dtype

    monkeypatch.setattr(precision, "bf16_is_native", lambda device: False)  # an AVX2-only CPU
    assert target_dtype(PROFILES["cpu"]) == "float32"
    assert target_dtype(PROFILES["cpu"], "bfloat16") == "bfloat16"  # --data-dtype bfloat16 still pins it
    monkeypatch.setattr(precision, "bf16_is_native", lambda device: True)  # avx512_bf16 / AMX, or a bf16 GPU
    assert target_dtype(PROFILES["cpu"]) == target_dtype(PROFILES["gpu"]) == "bfloat16"
    assert target_dtype(PROFILES["cpu"].model_copy(update={"dtype": "float32"})) == "float32"  # --dtype float32
