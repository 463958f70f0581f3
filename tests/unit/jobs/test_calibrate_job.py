"""Calibration job (jobs/calibrate.py): held-out prompts, STS fit, a new drafter version, the report."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dspark.drafters import DrafterConfig, build_drafter, load_drafter, save_drafter
from dspark.decoding.specdec import RoundStats
from dspark.models.target import load_target
from jobs import calibrate
from tests.mlflow_store import new_sqlite_store, register_drafter_dir


@pytest.fixture(scope="module")
def tiny():
    return load_target("tiny")


def tiny_drafter(target, algo="dspark"):
    torch.manual_seed(0)
    return build_drafter(DrafterConfig(algo=algo, block_size=3, num_layers=1, num_context_layers=2, rank=8), target)


def test_fit_cuts_the_ece_of_overconfident_rounds():
    """Confidences say 0.9, drafts survive with probability 0.5 each: STS must pull a_k down to 0.5^k."""
    rng = np.random.default_rng(0)
    rounds = []
    for _ in range(3000):
        accepted = int(np.argmin(np.append(rng.random(3) < 0.5, False)))  # geometric prefix, capped at 3
        conf = list(np.clip(0.9 + rng.normal(0, 0.02, 3), 0.01, 0.99))
        rounds.append(RoundStats(3, 3, accepted, [True] * accepted + [False] * (accepted < 3), conf))
    result, curves = calibrate.fit(rounds, n_bins=15)
    for p in result.positions:
        assert p["ece_after"] < 0.3 * p["ece_before"]
        assert p["temperature"] > 1  # overconfident -> softened
    after_k2 = curves[2]["after"][0]
    assert abs(after_k2.mean() - 0.25) < 0.05 and len(curves[2]["after"][1]) == 3000
    rows = calibrate.report_rows(result)
    assert [r["k"] for r in rows] == [1, 2, 3]
    assert {"ece_before", "ece_after", "auc_after", "brier_after"} <= set(rows[0])


def test_rollout_prompts_read_only_the_holdout_split(tmp_path):
    from dspark.io.storage.rollout_store import commit_chunk

    def row(pid, split, messages):
        return {"prompt_id": pid, "source": "s", "domain": "", "split": split, "messages": messages,
                "input_ids": [1, 2], "loss_mask": [0, 1], "num_prompt_tokens": 1, "num_generated_tokens": 1,
                "num_turns": 1, "finish_reason": "stop", "turn_finish_reasons": ["stop"], "target": "tiny",
                "target_revision": "", "sampling": "{}", "chunk": 0, "error_reason": None, "error_detail": None,
                "location": None, "raw": None}

    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q1"},
            {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "a2"}]
    commit_chunk(str(tmp_path), 0, [row("a" * 32, "train", conv[1:3]), row("b" * 32, "holdout", conv)])
    assert calibrate.rollout_prompts(str(tmp_path), "holdout") == [("be brief", ["q1", "q2"])]
    with pytest.raises(ValueError, match="no rows with split == 'valid'"):
        calibrate.rollout_prompts(str(tmp_path), "valid")


def test_config_and_drafter_checks(tiny, tmp_path):
    from dspark.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="exactly one of data.rollouts"):
        load_config(calibrate.CalibrateConfig, None, ["drafter=x", "data={}"])
    with pytest.raises(ConfigError, match="gamma must stay null"):
        load_config(calibrate.CalibrateConfig, None, ["drafter=x", "data.prompts=p.jsonl", "decode.gamma=2"])
    dflash = save_drafter(tiny_drafter(tiny, "dflash"), str(tmp_path / "dflash"))
    (tmp_path / "p.jsonl").write_text('{"turns": ["hi"]}\n')
    cfg = load_config(calibrate.CalibrateConfig, None, [f"drafter={dflash}", f"data.prompts={tmp_path / 'p.jsonl'}",
                                                        f"output={tmp_path / 'out'}", "tracking.enabled=false"])
    with pytest.raises(ValueError, match="no confidence head"):
        calibrate.run(cfg)


def test_calibration_job_writes_a_new_registered_version(tiny, tmp_path, monkeypatch, capsys):
    """Source = a registered model version; the job registers version 2 (alias `calibrated`) with the
    temperatures, leaves version 1 untouched, and logs report + reliability diagrams to MLflow."""
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", new_sqlite_store(tmp_path))
    monkeypatch.setenv("DSPARK_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))
    source = save_drafter(tiny_drafter(tiny), str(tmp_path / "source"))
    register_drafter_dir(source, tmp_path / "artifacts", "src", "tiny-d")
    client = mlflow.MlflowClient()
    prompts = tmp_path / "holdout.jsonl"
    prompts.write_text('{"turns": ["what is 2 + 3?"]}\n{"turns": ["def f(x):", "and g?"]}\n{"turns": ["one two"]}\n')
    cfg = calibrate.CalibrateConfig.model_validate({
        "target": "tiny", "drafter": "models:/tiny-d@latest", "data": {"prompts": str(prompts)},
        "decode": {"max_new_tokens": 16}, "output": str(tmp_path / "out"), "workers": {"num_workers": 0},
        "tracking": {"experiment": "calib-test"}, "min_rounds": 10})

    report = calibrate.run(cfg)

    assert report["registered"] == {"name": "tiny-d", "aliases": ["calibrated"], "version": "2"}
    new = load_drafter(str(tmp_path / "out" / "drafter"), tiny)
    assert new.calibration == pytest.approx(report["temperatures"]) and len(new.calibration) == 3
    assert load_drafter(source, tiny).calibration is None  # the source is untouched
    from dspark.io.drafter_source import load_drafter_ref

    assert load_drafter_ref("models:/tiny-d@calibrated", tiny).calibration == pytest.approx(new.calibration)
    assert load_drafter_ref("models:/tiny-d/1", tiny).calibration is None
    first = report["positions"][0]
    assert first["n"] == report["rounds"] > 10 and first["ece_after"] <= first["ece_before"] + 1e-12
    saved = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [p["k"] for p in saved["positions"]] == [1, 2, 3] and saved["registered"]["version"] == "2"
    assert "| k | n | temperature |" in capsys.readouterr().out

    run_id = report["mlflow_run_id"]
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"report.json", "report.md", "drafter", "config.yaml"} <= artifacts
    assert {"reliability/reliability_k1.png", "reliability/reliability_k3.png"} <= {
        a.path for a in client.list_artifacts(run_id, "reliability")}
    # engine exports ride along, logged and tagged on version 2: the library's default MASK is the row the
    # target reserves, so every engine's layout is written (a learned MASK would skip speculators and SGLang)
    assert {a.path for a in client.list_artifacts(run_id, "exports")} == {"exports/vllm", "exports/speculators",
                                                                           "exports/sglang"}
    tags = client.get_model_version("tiny-d", "2").tags
    for fmt in ("vllm", "speculators", "sglang"):
        assert tags[f"dspark.export.{fmt}"] == f"runs:/{run_id}/exports/{fmt}"
    version = client.get_model_version("tiny-d", "2")  # an MLflow model, tagged
    assert version.source.startswith("models:/m-") and tags["dspark.algo"] == "dspark"
    assert float(tags["dspark.tau"]) >= 1.0 and tags["dspark.calibrated"] == "True"
    assert "champion" not in client.get_registered_model("tiny-d").aliases  # serving moves through jobs.promote
    exported = json.loads(Path(mlflow.artifacts.download_artifacts(f"runs:/{run_id}/exports/vllm/config.json",
                                                                   dst_path=str(tmp_path / "dl"))).read_text())
    assert exported["dspark_calibration"] == pytest.approx(report["temperatures"])
    metrics = client.get_run(run_id).data.metrics
    assert {"ece_before.k1", "ece_after.k1", "temperature.k3", "mean.ece_after"} <= set(metrics)
    inputs = client.get_run(run_id).inputs.dataset_inputs  # lineage: the calibration set
    assert [(d.dataset.name, {t.key: t.value for t in d.tags}["mlflow.data.context"]) for d in inputs] == [
        ("holdout.jsonl", "calibration")]
    assert str(prompts) in inputs[0].dataset.source
