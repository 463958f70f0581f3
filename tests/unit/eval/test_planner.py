"""The cost planner's arithmetic (dspark/eval/planner.py) and the `dspark plan` CLI on small JSONs."""
import json
import math

import pytest

from dspark.cli import main
from dspark.eval import planner


def test_loglinear_fit_inverts_exactly():
    tokens = [1e4, 3e4, 1e5, 3e5]
    curve = planner.fit_curve(tokens, [1.2 + 0.1 * math.log(t) for t in tokens])
    assert curve.a == pytest.approx(1.2) and curve.b == pytest.approx(0.1)
    assert curve.tokens_for(3.0) == pytest.approx(math.exp((3.0 - 1.2) / 0.1))
    assert curve.tau(curve.tokens_for(2.5)) == pytest.approx(2.5)
    assert not curve.extrapolated(5e4) and curve.extrapolated(1e6)
    flat = planner.Curve("loglinear", 2.0, 0.0)
    assert math.isinf(flat.tokens_for(3.0))  # a flat curve never reaches a higher tau


def test_power_fit_and_ceiling():
    tokens = [1e3, 4e3, 1.6e4, 6.4e4, 2.56e5]
    truth = planner.Curve("power", 3.0, 20.0, 0.5)
    curve = planner.fit_curve(tokens, [truth.tau(t) for t in tokens], "power")
    assert curve.a == pytest.approx(3.0, rel=1e-3) and curve.c == pytest.approx(0.5, rel=1e-3)
    assert curve.tokens_for(2.5) == pytest.approx((0.5 / 20.0) ** (-1 / 0.5), rel=1e-3)
    assert math.isinf(curve.tokens_for(3.5))  # above the ceiling a: unreachable


def test_plan_row_arithmetic():
    curve = planner.Curve("loglinear", 0.0, 1.0, t_min=1.0, t_max=1e9)
    tp = planner.DeviceThroughput("cpu", rollout_tok_s=100.0, train_tok_s=400.0)
    row = planner.plan_row("x", 2.0, 3.6e5, tp, workers=4, epochs=2, prompt_per_generated=0.5, curve=curve)
    assert row.training_tokens == pytest.approx(3.6e5 * 1.5 * 2)  # prompt + answer tokens, 2 epochs
    assert row.rollout_hours == pytest.approx(1.0)  # 3.6e5 / 100 / 3600
    assert row.training_hours == pytest.approx(0.75)  # 1.08e6 / 400 / 3600
    assert row.device_hours == pytest.approx(1.75) and row.wall_clock_hours == pytest.approx(1.75 / 4)
    rows = planner.make_plan(curve, [tp], [2.0], 4, 2, 0.5, tokens_per_prompt=200)
    paper = rows[-1]
    assert paper.rollout_tokens == pytest.approx(1.3e6 * 200) and paper.training_tokens == pytest.approx(2.6e8 * 1.5 * 10)
    assert paper.tau == pytest.approx(math.log(2.6e8))


def test_cli_plan_reads_benchmark_jsons(tmp_path, capsys):
    report = {"benchmark": "learning_curve", "device": "2 CPU cores (shared)", "device_kind": "cpu", "rollouts": {"generated_tokens": 1000, "prompt_tokens": 500, "rows": 10},
              "points": [{"algo": "dspark", "rollout_tokens": t, "expected_tau": 1.0 + 0.1 * math.log(t),
                          "training": {"tokens_per_s": 300.0}} for t in (1e3, 1e4, 1e5)]}
    (tmp_path / "curve.json").write_text(json.dumps(report))
    (tmp_path / "roll.json").write_text(json.dumps({"device": "cpu", "tokens_per_s": {"engine": 200.0, "sequential": 20.0}}))
    assert main(["plan", "--curve", str(tmp_path / "curve.json"), "--rollout-bench", str(tmp_path / "roll.json"),
                 "--train-bench", str(tmp_path / "curve.json"), "--tau", "2", "--workers", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    row = out["rows"][0]
    want_tokens = math.exp(10.0)  # 2 = 1 + 0.1 ln T
    assert row["rollout_tokens"] == pytest.approx(want_tokens, rel=1e-6)
    assert row["rollout_hours"] == pytest.approx(want_tokens / 200 / 3600, rel=1e-6)
    assert row["training_tokens"] == pytest.approx(want_tokens * 1.5 * 2, rel=1e-6)  # prompt/gen 0.5, 2 epochs
    assert row["extrapolated"] is False  # e^10 = 22 k tokens lies inside the measured 1e3..1e5
    paper = out["rows"][-1]
    assert paper["label"].startswith("paper") and paper["extrapolated"] is True  # 1.3e6 x 100 tokens
    assert paper["rollout_tokens"] == pytest.approx(1.3e6 * 100)  # generated tokens per prompt: 1000 / 10 rows


def test_a_gpu_recipe_summary_gives_both_throughputs_of_its_device(tmp_path):
    from dspark.eval.planner import rollout_tok_s_of, train_tok_s_of

    summary = {"device": "NVIDIA H200", "rollout_tok_per_s": 20000.0,
               "train": {"dspark_1l": {"algo": "dspark", "init_from": "some/drafter", "tokens_per_s": 9e5},
                         "dspark": {"algo": "dspark", "init_from": None, "tokens_per_s": 4e5},
                         "eagle3": {"algo": "eagle3", "tokens_per_s": 3e5}}}
    (tmp_path / "recipe.json").write_text(json.dumps(summary))
    assert rollout_tok_s_of(str(tmp_path / "recipe.json")) == ("NVIDIA H200", 20000.0)
    assert train_tok_s_of(str(tmp_path / "recipe.json")) == ("NVIDIA H200", 4e5)  # the DSpark trained from scratch
