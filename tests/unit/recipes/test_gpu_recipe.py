"""The GPU recipe's pieces on tiny models: a failing phase leaves a valid partial recipe.json, the deadline
stops training mid-phase, drafter bundles round-trip, the target's two-call transfer joins exactly, and (slow) the whole
recipe on the simulated GPU machine (recipes.gpu_sim) on `tiny`."""
from __future__ import annotations

import json
import os
import subprocess
import sys

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


def test_a_drafter_capture_that_fell_back_is_a_problem_of_the_simulated_run(tmp_path):
    """recipe.json names, per drafter, the captures that failed and ran eager; `make gpu-sim` reports them."""
    from types import SimpleNamespace

    from dspark.drafters import chain_capture

    captured, fell_back = SimpleNamespace(), SimpleNamespace(_block_capture_failed=True)
    assert chain_capture.fell_back(captured) == [] and chain_capture.fell_back(fell_back) == ["block"]
    r = Recipe(recipe_config(), tmp_path)
    r.summary["drafter_capture_fell_back"] = {"dspark": [], "eagle3": chain_capture.fell_back(fell_back)}
    assert r.phase("noop", lambda: None) and r.summary["graph_caches_full"] == {}  # refreshed after every phase
    r.summary["graph_caches_full"] = {"dspark.decoding.static_core._step": 64}
    r.write()
    assert check_output(tmp_path, json.dumps(json.loads((tmp_path / "recipe.json").read_text()))) == [
        "drafter eagle3's block capture fell back to eager (see the log)",
        "dspark.decoding.static_core._step's graph cache is full (64 graphs): its new shape buckets run eager"]


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


@pytest.mark.heavy
def test_the_profile_phase_times_decoding_steps_at_batch_1_and_the_rollout_batch(tiny, tmp_path):
    from recipes.gpu_recipe import profile_phase

    r = Recipe(recipe_config(), tmp_path)
    r.target, r.rows, r.summary["rollout_batch"] = tiny, _rows(tiny, n=5), 6  # fewer rows than the batch: reused
    profile_phase(r)
    for name, steps in (("batch1", 16), ("batch6", 4)):
        got = r.results["profile"][name]
        assert got["steps"] == steps and got["wall_ms"] > 0 and got["host_ms"] > 0 and got["device_ms"] == 0.0
        assert got["top_ops"] and all(op["calls"] >= 1 for op in got["top_ops"])
        assert r.summary["ms_per_step"][name] == {k: got[k] for k in ("wall_ms", "host_ms", "device_ms")}


@pytest.mark.parametrize("compile_fails", [False, True])
def test_the_decode_core_phase_times_batch_1_and_falls_back_to_eager_saying_why(tiny, tmp_path, monkeypatch,
                                                                               compile_fails):
    from types import SimpleNamespace

    from dspark.decoding.static_core import DecodeCore
    from recipes.gpu_recipe import decode_core_phase

    r = Recipe(recipe_config(), tmp_path)
    r.target, r.prompts = tiny, [SimpleNamespace(turns=["What is 2 + 2?"])]
    r.cfg.eval.decode.decode_core = "compiled" if compile_fails else "eager"
    if compile_fails:
        def no_compiler(self):
            raise RuntimeError("no C++ compiler")
        monkeypatch.setattr(DecodeCore, "_compiled_step", no_compiler)
    decode_core_phase(r)
    info = r.summary["decode_core"]
    assert info["mode"] == "eager" and r.cfg.eval.decode.decode_core == "eager"  # what evaluation then decodes with
    assert ("no C++ compiler" in info["fallback"]) if compile_fails else "fallback" not in info
    assert r.summary["target_ms_per_token_batch1"] > 0


def test_the_accept_rows_phase_records_row_by_row_over_batched_on_the_device(tiny, tmp_path):
    from recipes.gpu_recipe import accept_rows_phase

    r = Recipe(recipe_config(), tmp_path)
    r.target = tiny
    accept_rows_phase(r)  # the benchmark checks that both ways give the same tokens (it exits otherwise)
    report = r.results["accept_rows"]
    assert report["device"] == "cpu" and report["vocab"] == tiny.vocab_size
    assert report["default_on_this_device"] == "row_by_row"
    assert set(r.summary["accept_rows_row_over_batched"]) == {"1", "16", "64"}
    assert all(ratio > 0 for ratio in r.summary["accept_rows_row_over_batched"].values())


def test_the_draft_block_phase_records_per_position_over_up_front_on_the_device(tiny, tmp_path):
    from recipes.gpu_recipe import draft_block_phase

    r = Recipe(recipe_config(), tmp_path)
    r.target = tiny
    draft_block_phase(r)  # the benchmark asserts that both ways draw the same tokens
    report = r.results["draft_block"]
    assert report["device"] == "cpu" and report["vocab"] == tiny.vocab_size
    assert set(r.summary["draft_block_per_position_over_up_front"]) == {"1", "16", "64"}
    assert all(row["same_tokens"] and row["ops_per_pass"]["up_front"] < row["ops_per_pass"]["per_position"]
               for row in report["rows"][1:])


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


def test_init_from_continues_a_saved_drafter_with_its_draft_vocabulary_and_refuses_architecture_changes(tiny, tmp_path):
    from dspark.drafters import save_drafter
    from dspark.drafters.checkpoint import saved_draft_ids
    from recipes.gpu_recipe import RecipeDrafter, continued_drafter

    ids = torch.arange(0, tiny.vocab_size, 2)
    cfg = DrafterConfig(algo="dspark", block_size=3, num_layers=1, rank=8, anchors_per_seq=4, draft_vocab_size=len(ids))
    saved = build_drafter(cfg, tiny, draft_ids=ids)
    save_drafter(saved, str(tmp_path / "d"))
    entry = RecipeDrafter(train_config="configs/train/tiny-dspark.yaml", init_from=str(tmp_path / "d"),
                         drafter={"anchors_per_seq": 16, "loss_tv": 0.5})
    got_cfg, got = continued_drafter(entry, tiny)
    assert got_cfg.anchors_per_seq == 16 and got_cfg.loss_tv == 0.5 and got_cfg.num_layers == 1 and got_cfg.rank == 8
    assert torch.equal(saved_draft_ids(str(tmp_path / "d")), ids)
    for (k, v), w in zip(saved.state_dict().items(), got.state_dict().values()):
        assert torch.equal(v, w), k
    with pytest.raises(ValueError, match=r"\['num_layers', 'rank'\] would change its architecture"):
        continued_drafter(entry.model_copy(update={"drafter": {"rank": 4, "num_layers": 2}}), tiny)


def test_target_split_over_two_calls_joins_exactly_and_names_a_missing_stage_part(tmp_path):
    from recipes import gpu_transfer

    src = tmp_path / "model.whl"
    src.write_bytes(np.random.default_rng(0).integers(0, 256, 250_000, dtype=np.uint8).tobytes())
    stage, bundle = tmp_path / ".gpu-stage", tmp_path / "bundle"
    manifest = gpu_transfer.split(src, stage, bundle, stage_part_bytes=100_000, bundle_part_bytes=60_000)
    assert [(p["where"], p["bytes"]) for p in manifest["parts"]] == [
        ("stage/00", 100_000), ("stage/01", 100_000), ("bundle", 50_000)]
    assert gpu_transfer.check(stage / "00") == [] and gpu_transfer.check(stage / "01") == []
    out = gpu_transfer.join_parts(stage, bundle, tmp_path / "dest")
    assert out.read_bytes() == src.read_bytes()

    out.unlink()
    (stage / "01" / "model.whl.part01").write_bytes(b"x")  # damaged in transfer
    assert "damaged" in gpu_transfer.check(stage / "01")[0]
    with pytest.raises(RuntimeError, match="part01 is damaged"):
        gpu_transfer.join_parts(stage, bundle, tmp_path / "dest")
    (stage / "01" / "model.whl.part01").unlink()  # the machine was given back between two calls
    with pytest.raises(RuntimeError, match=r"part01 is missing.*Make the stage calls first.*'bash \.gpu-stage/01/stage\.sh'"):
        gpu_transfer.join_parts(stage, bundle, tmp_path / "dest")
    assert not (tmp_path / "dest" / "model.whl").exists()


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
