"""benchmarks/gpu_drafter_compare.py (the GPU recipe) end to end on the tiny target (CPU, --smoke sizes):
decontaminated prompts -> rollouts -> three drafters trained in lockstep through the library step ->
evaluation (τ per benchmark, per-position acceptance, batch-1 speedup) -> recipe.json -> bf16
drafters -> unpack -> loadable checkpoints."""
import json

import torch

from benchmarks import gpu_drafter_compare as gc
from dspark.drafters import load_drafter
from dspark.models.target import load_target


def test_smoke_recipe_trains_all_three_in_lockstep_and_writes_recipe_json(tmp_path, capsys):
    out = tmp_path / "out"
    assert gc.main(["--target", "tiny", "--device", "cpu", "--smoke", "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    recipe = json.loads((out / "recipe.json").read_text())
    assert recipe == summary and recipe["device"] == "cpu" and recipe["precision"] == "fp32"
    assert recipe["rollout_tokens"] > 0 and recipe["train_steps"] == 3
    assert set(recipe["tau"]) == set(recipe["tau_mean"]) == set(recipe["speedup_batch1"]) == set(gc.ALGOS)
    for algo in gc.ALGOS:
        assert set(recipe["tau"][algo]) == set(gc.BENCHMARKS)  # one prompt of each benchmark in the smoke run
        assert all(1.0 <= t <= 8.0 for t in recipe["tau"][algo].values())
        assert recipe["speedup_batch1"][algo] > 0 and recipe["accept_by_position"][algo]
    assert recipe["greedy_equal"] == {a: True for a in gc.ALGOS}
    results = json.loads((out / "results.json").read_text())
    assert all(c[-1]["step"] == 3 for c in results["training"]["curves"].values())  # same steps for every drafter
    assert results["prompts"]["source"] == "data/train" and results["training"]["sequences_per_drafter"] == 12
    cfg = results["training"]["recipes"]["eagle3"]["drafter"]
    assert cfg["dense_ttt"] and cfg["ce_target"] == "soft"  # the baseline as its reference trains it

    assert gc.main(["--out", str(out), "--unpack", str(tmp_path / "u")]) == 0
    target = load_target("tiny")
    for algo in gc.ALGOS:
        drafter = load_drafter(str(tmp_path / "u" / "bundle" / algo), target=target)
        assert drafter.algo == algo
        assert all(p.dtype == torch.float32 for p in drafter.parameters())  # bf16 on disk, fp32 when loaded


def test_missing_synthesis_module_falls_back_and_a_present_one_is_used():
    assert gc.load_hook("dspark.no_such_synthesis_module:synthesize_prompts") is None
    assert gc.load_hook("dspark.data.decontamination:words")("A b") == ["a", "b"]
