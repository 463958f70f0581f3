"""The lineage phase: distinct rollout tokens add up along the rounds (a pass over seen rows adds none), each
round's τ comes from its compare JSON, and the curve's fit says how many tokens it wanted for the last τ."""
import json
import math

import pytest

from recipes.learning_curve import parse_args
from recipes.learning_curve.lineage import cmd_lineage, lineage_rounds, tokens_for


def compare(path, taus):
    path.write_text(json.dumps({"drafters": {k: {"expected_tau": t, "expected_tau_ci95": [t - 0.05, t + 0.05]}
                                             for k, t in taus.items()}}))


def spec_of(tmp_path):
    compare(tmp_path / "c1.json", {"a": 1.5, "b": 1.7})
    compare(tmp_path / "c2.json", {"b": 1.7, "c": 1.75, "d": 1.9})
    return {"target": "tiny", "rounds": [
        {"label": "A", "compare": "c1.json", "drafter": "a", "new_rollouts": {"x": 1000, "y": 500}},
        {"label": "B", "compare": "c1.json", "drafter": "b", "new_rollouts": {"z": 1500}},
        {"label": "B again", "compare": "c2.json", "drafter": "c", "new_rollouts": {}},
        {"label": "D", "compare": "c2.json", "drafter": "d", "new_rollouts": {"w": 3000}}]}


def test_rounds_add_distinct_tokens_and_take_tau_from_their_compare(tmp_path):
    rounds = lineage_rounds(spec_of(tmp_path), tmp_path)
    assert [r["rollout_tokens"] for r in rounds] == [1500, 3000, 3000, 6000]
    assert [r["expected_tau"] for r in rounds] == [1.5, 1.7, 1.75, 1.9]
    spec = spec_of(tmp_path)
    spec["rounds"][1]["drafter"] = "nope"
    with pytest.raises(SystemExit, match="c1.json has no drafter 'nope'"):
        lineage_rounds(spec, tmp_path)


def test_tokens_for_inverts_the_log_linear_fit():
    fit = {"a": 0.5, "b": 0.1}
    assert tokens_for(fit, 0.5 + 0.1 * math.log(2e6)) == pytest.approx(2e6)
    assert tokens_for({"a": 1.0, "b": 0.0}, 2.0) is None and tokens_for(None, 2.0) is None


def test_phase_writes_json_and_plot_with_the_curve_beside(tmp_path):
    (tmp_path / "spec.json").write_text(json.dumps(spec_of(tmp_path)))
    curve = {"points": [{"rollout_tokens": t, "expected_tau": 1 + 0.1 * math.log(t / 100), "expected_tau_ci95": [1, 2]}
                        for t in (200, 600, 1800)], "fit": {"a": 1 - 0.1 * math.log(100), "b": 0.1}}
    (tmp_path / "curve.json").write_text(json.dumps(curve))
    args = parse_args(["lineage", "--spec", str(tmp_path / "spec.json"), "--curve", str(tmp_path / "curve.json"),
                       "--results", str(tmp_path), "--name", "lin"])
    report = cmd_lineage(args, {})
    assert json.loads((tmp_path / "lin.json").read_text()) == json.loads(json.dumps(report))
    assert (tmp_path / "lin.png").read_bytes()[:4] == b"\x89PNG"
    # the round that re-passed seen rows is replaced by it at its x: the fit has one point per amount of data
    assert report["fit"]["points"] == 3 and report["last"] == {"label": "D", "rollout_tokens": 6000, "expected_tau": 1.9}
    assert report["curve_fit_tokens_for_last_tau"] == pytest.approx(100 * math.exp(9))
