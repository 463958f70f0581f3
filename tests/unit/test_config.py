"""Config system: unknown keys and wrong types rejected with a clear message; overrides applied."""
from typing import Literal

import pytest

from dspark.config import ConfigError, StrictModel, apply_overrides, dump_config, flatten, load_config
from tests.paths import REPO


class Optim(StrictModel):
    lr: float = 1e-3
    betas: list[float] = [0.9, 0.95]


class Job(StrictModel):
    name: str = "run"
    algo: Literal["dspark", "dflash"] = "dspark"
    optim: Optim = Optim()


def write(tmp_path, text):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


def test_yaml_and_overrides(tmp_path):
    path = write(tmp_path, "name: a\noptim:\n  lr: 0.1\n")
    cfg = load_config(Job, path, ["optim.lr=3e-4", "algo=dflash", "optim.betas=[0.8, 0.9]"])
    assert cfg.name == "a" and cfg.algo == "dflash"
    assert cfg.optim.lr == pytest.approx(3e-4) and cfg.optim.betas == [0.8, 0.9]


def test_unknown_key_named(tmp_path):
    path = write(tmp_path, "optim:\n  lrr: 0.1\n")
    with pytest.raises(ConfigError, match=r"unknown key 'optim.lrr'"):
        load_config(Job, path)


def test_unknown_override_named():
    with pytest.raises(ConfigError, match=r"unknown key 'bogus'"):
        load_config(Job, None, ["bogus=1"])


def test_wrong_type_named(tmp_path):
    path = write(tmp_path, "optim:\n  lr: fast\n")
    with pytest.raises(ConfigError, match=r"'optim.lr'.*got 'fast'"):
        load_config(Job, path)
    with pytest.raises(ConfigError, match=r"'algo'"):
        load_config(Job, None, ["algo=medusa"])


def test_bad_override_syntax_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="key.path=value"):
        apply_overrides({}, ["optim.lr"])
    with pytest.raises(ConfigError, match="not found"):
        load_config(Job, tmp_path / "nope.yaml")


def test_dump_roundtrip_and_flatten(tmp_path):
    cfg = load_config(Job, None, ["optim.lr=0.5"])
    again = load_config(Job, write(tmp_path, dump_config(cfg)))
    assert again == cfg
    assert flatten({"a": {"b": 1}, "c": 2}) == {"a.b": 1, "c": 2}


def test_config_reference_is_current():
    """docs/config-reference.md is generated from the job configs; regenerate it when they change:
    `python -m jobs.config_reference > docs/config-reference.md`."""

    from jobs.config_reference import render

    committed = (REPO / "docs" / "config-reference.md").read_text()
    assert committed.strip() == render().strip()


def test_every_job_config_field_is_described_and_types_render_in_one_cell():
    """Each row of the config reference has a description, and `int | None` does not split the table."""
    import importlib

    from jobs.config_reference import JOB_CONFIGS, rows

    for module, cls_name, _ in JOB_CONFIGS:
        for row in rows(getattr(importlib.import_module(module), cls_name)):
            cells = [c.strip() for c in row.replace("\\|", "¦").split("|")[1:-1]]
            assert len(cells) == 4, f"{cls_name}: {row} does not have 4 cells"
            assert cells[3], f"{cls_name}: {cells[0]} has no Field(description=...)"


def test_a_config_extends_its_base_files(tmp_path):
    """`base:` files are read first (relative to the overlay), nested mappings merge key by key,
    lists and scalars are replaced, and a loop is an error naming the files."""
    from dspark.config import ConfigError, read_yaml

    (tmp_path / "target.yaml").write_text("model: {name: t, layers: 2}\nsources: [a, b]\nseed: 1\n")
    (tmp_path / "algo.yaml").write_text("base: target.yaml\nmodel: {layers: 5}\nsources: [c]\n")
    assert read_yaml(tmp_path / "algo.yaml") == {"model": {"name": "t", "layers": 5}, "sources": ["c"], "seed": 1}
    (tmp_path / "loop.yaml").write_text("base: loop.yaml\n")
    with pytest.raises(ConfigError, match="loop"):
        read_yaml(tmp_path / "loop.yaml")


def test_relative_input_paths_become_absolute_where_the_config_is_loaded(tmp_path, monkeypatch):
    """Serve replicas and Ray workers do not share the driver's working directory: a relative drafter dir
    (as the README's commands give it) is made absolute on load; URIs and missing paths pass unchanged."""
    from jobs.evaluate import DrafterEntry
    from dspark.serve.config import ModelSection

    (tmp_path / "drafters" / "mine").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert ModelSection(drafter="drafters/mine").drafter == str(tmp_path / "drafters" / "mine")
    assert DrafterEntry(ref="drafters/mine").ref == str(tmp_path / "drafters" / "mine")
    for ref in ("models:/x@champion", "runs:/abc/drafter", "s3://bucket/drafter", "not/here", "/abs/path"):
        assert ModelSection(drafter=ref).drafter == ref
    assert ModelSection().drafter is None
    from dspark.training.config import DataSection

    (tmp_path / "rows.parquet").write_bytes(b"")
    assert DataSection(rollouts="rows.parquet").rollouts == str(tmp_path / "rows.parquet")


@pytest.mark.parametrize("alias", ["latest", "V2", "my alias", "a/b"])
def test_bad_aliases_fail_when_the_config_loads_naming_them(alias):
    """MLflow would refuse them only at registration, after training: the job configs refuse them first."""
    from dspark.training.config import TrainJobConfig
    from jobs.calibrate import CalibrateConfig
    from jobs.promote import PromoteConfig

    base = REPO / "configs" / "train" / "tiny-dspark.yaml"
    for field in ("tracking.alias", "tracking.promote_to"):
        with pytest.raises(ConfigError, match=f"{field}.*{alias}"):
            load_config(TrainJobConfig, base, [f"{field}={alias}"])
    with pytest.raises(ConfigError, match=alias):
        load_config(CalibrateConfig, REPO / "configs" / "calibrate" / "tiny.yaml", [f"aliases=[{alias}]"])
    with pytest.raises(ConfigError, match=alias):
        load_config(PromoteConfig, REPO / "configs" / "flywheel" / "tiny-promote.yaml", [f"serving_alias={alias}"])
    ok = load_config(TrainJobConfig, base, ["tracking.promote_to=champion"])
    assert ok.tracking.promote_to == "champion" and ok.tracking.alias == "trained"
