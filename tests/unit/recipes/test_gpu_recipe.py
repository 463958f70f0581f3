"""The GPU recipe's pieces on tiny models: a failing phase leaves a valid partial recipe.json, the deadline
stops training mid-phase, drafter bundles and the compact model pack round-trip, and (slow) the whole
recipe on the simulated GPU machine (recipes.gpu_sim) on `tiny`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dspark.drafters import DrafterConfig, build_drafter
from dspark.training.budget import Deadline, epoch_batches, probe_batches, train_for
from dspark.training.config import OptimSection
from dspark.training.loop import LocalTrainer
from recipes.gpu_recipe import Recipe, RecipeConfig
from recipes.gpu_sim import FIELDS, check_output
from tests.paths import REPO


@pytest.fixture(scope="module")
def tiny():
    from dspark.models.target import load_target

    return load_target("tiny")


def recipe_config(**over) -> RecipeConfig:
    return RecipeConfig.model_validate({"run": "t", "target": "tiny", "prompts": [{"uri": "data/train/math.jsonl"}],
                                        "drafters": {"dspark": {"train_config": "configs/train/tiny-dspark.yaml"}},
                                        **over})


def test_a_phase_that_raises_leaves_a_valid_partial_summary(tmp_path):
    r = Recipe(recipe_config(), tmp_path)
    assert r.phase("load", lambda: r.summary.update(device="cpu"))

    def boom():
        raise RuntimeError("out of memory in the rollouts")

    assert not r.phase("rollouts", boom)  # fatal: the driver stops here
    summary = json.loads((tmp_path / "recipe.json").read_text())
    assert all(k in summary for k in FIELDS) and summary["device"] == "cpu"
    assert summary["phases"]["load"]["status"] == "ok"
    assert summary["phases"]["rollouts"]["status"] == "failed" and summary["phases"]["rollouts"]["seconds"] >= 0
    assert "out of memory" in summary["errors"]["rollouts"]
    assert "RuntimeError" in json.loads((tmp_path / "results.json").read_text())["tracebacks"]["rollouts"]
    assert r.phase("plot", boom, fatal=False)  # a non-fatal phase lets the run go on
    assert check_output(tmp_path, json.dumps(json.loads((tmp_path / "recipe.json").read_text()))) == [
        "phase rollouts: {'status': 'failed', 'seconds': %s}" % summary["phases"]["rollouts"]["seconds"],
        "phase plot: %s" % json.loads((tmp_path / "recipe.json").read_text())["phases"]["plot"]]


class CountingDeadline(Deadline):
    """A deadline that passes at its n-th check: the steps it lets through are exactly counted."""

    def __init__(self, checks: int):
        object.__setattr__(self, "at", float("inf"))
        object.__setattr__(self, "left_checks", [checks])

    def within(self, seconds):
        return self

    def left(self):
        return 1e9

    def passed(self):
        self.left_checks[0] -= 1
        return self.left_checks[0] < 0


def _rows(target, n=12, seed=0):
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(0, target.vocab_size, 24).tolist(), "loss_mask": [0] * 6 + [1] * 18}
            for _ in range(n)]


def test_the_deadline_stops_training_mid_phase(tiny):
    rows = _rows(tiny)
    cfg = DrafterConfig(algo="dflash", block_size=3, num_layers=1, anchors_per_seq=4)
    trainer = LocalTrainer("dflash", tiny, build_drafter(cfg, tiny), OptimSection(lr=1e-2, warmup_ratio=0.0))
    before = [p.detach().clone() for p in trainer.params]
    probe = probe_batches(rows, 4, 32, tiny.pad_token_id)  # the probe checks the deadline before each batch too
    report = train_for(trainer, epoch_batches(rows, 4, 32, tiny.pad_token_id, 2, 0), probe, seconds=1e9,
                       deadline=CountingDeadline(len(probe) + 3), max_steps=50)
    assert report.planned_steps == 50 and report.steps == 3 and report.stopped_by == "deadline"
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.params))  # the 3 steps did update
    # a real clock: no time left after the probe -> no step starts
    trainer = LocalTrainer("dflash", tiny, build_drafter(cfg, tiny), OptimSection(lr=1e-2))
    report = train_for(trainer, epoch_batches(rows, 4, 32, tiny.pad_token_id, 2, 0),
                       probe_batches(rows, 4, 32, tiny.pad_token_id), seconds=0.0, deadline=Deadline.after(3600))
    assert report.steps == 0 and report.stopped_by == "deadline" and report.step_s > 0


def test_drafter_bundle_round_trips_in_bf16_parts(tiny, tmp_path):
    from dspark.drafters.checkpoint import load_bundle, save_bundle

    drafters = {"a": build_drafter(DrafterConfig(algo="dspark", block_size=3, num_layers=1, rank=8), tiny),
                "b": build_drafter(DrafterConfig(algo="eagle3", ttt_steps=2), tiny)}
    parts = save_bundle(drafters, str(tmp_path), part_bytes=40_000)
    assert len(parts) >= 2 and all(os.path.getsize(p) <= 40_000 for p in parts)
    back = load_bundle(str(tmp_path), target=tiny)
    assert set(back) == {"a", "b"}
    for name, d in drafters.items():
        for (k, v), w in zip(d.state_dict().items(), back[name].state_dict().values()):
            want = v.to(torch.bfloat16).float() if v.is_floating_point() else v
            assert torch.equal(want, w.float() if w.is_floating_point() else w), k


def test_model_pack_round_trip_is_within_half_a_quantisation_step(tmp_path):
    from safetensors.numpy import load_file

    from dspark.models import builtin as models_builtin

    src = Path(models_builtin.prepare("tiny"))
    parts = models_builtin.pack_model(src, tmp_path / "pack", "tiny", part_bytes=20_000)
    assert len(parts) >= 2
    models_builtin.unpack_model(tmp_path / "pack", tmp_path / "out", "tiny")
    a, b = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "out" / "model.safetensors"))
    assert a.keys() == b.keys() and (tmp_path / "out" / "tokenizer.json").exists()
    for key, w in a.items():
        if w.ndim == 1:
            assert np.array_equal(w, b[key])
            continue
        bits, group = models_builtin.PACK_BITS(key, w.shape)
        x = w.reshape(-1, group)
        step = (x.max(1) - x.min(1)) / (2 ** bits - 1)
        err = np.abs(x - b[key].reshape(-1, group)).max(1)
        assert (err <= step * 0.5 + 1e-3 * np.abs(x).max(1) + 1e-6).all(), key  # fp16 scale/min rounding


@pytest.mark.slow
def test_the_recipe_runs_on_the_simulated_gpu_machine_on_tiny():
    """`python -m recipes.gpu_sim tiny`: the image's Python 3.12 / torch 2.11 / transformers 5.17 without
    pydantic, only the transferred files, the one-line launcher; output within the device's limits."""
    from recipes import gpu_image

    if not (gpu_image.sim_root() / "venv" / ".image-installed").exists() or not (REPO / ".gpu-bundle").exists():
        pytest.skip("simulated image or .gpu-bundle missing: run `make gpu-sim` once (downloads ~2.7 GB)")
    proc = subprocess.run([sys.executable, "-m", "recipes.gpu_sim", "tiny"], cwd=REPO, capture_output=True,
                          text=True, timeout=1500)
    result = json.loads(proc.stdout.strip().splitlines()[0])
    assert proc.returncode == 0 and result["ok"], result["problems"]
    summary = result["summary"]
    assert summary["rollout_tokens"] > 0 and set(summary["tau"]) == {"dspark", "dflash", "eagle3"}
    assert all(v["steps"] >= 1 for v in summary["train"].values())
