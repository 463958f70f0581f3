"""compare.json describes each drafter by a name that outlives the machine, what it was trained on, and the
paired difference per benchmark."""
import json

import pytest

from recipes.learning_curve.measure import drafter_label, paired_by_group, training_summary
from recipes.learning_curve.profiles import REPO


def saved_run(tmp_path, init=None):
    folder = tmp_path / "run7" / "epochs" / "e01-from-x" / "dspark"
    (folder / "drafter").mkdir(parents=True)
    (folder / "train.json").write_text(json.dumps({"rows": 10, "rollout_tokens": 900, "steps": 3, "epochs": 1,
                                                   "init_from": init, "curve": [1, 2]}))
    return folder / "drafter"


def test_label_names_the_run_or_the_repository_path(tmp_path):
    assert drafter_label(saved_run(tmp_path)) == "run7/epochs/e01-from-x"
    assert drafter_label(REPO / "benchmarks" / "results") == "benchmarks/results"
    other = tmp_path / "loose"
    other.mkdir()
    assert drafter_label(other) == str(other.resolve())


def test_training_summary_keeps_the_counts_and_labels_the_init(tmp_path):
    init = saved_run(tmp_path)
    summary = training_summary(saved_run(tmp_path / "b", init=str(init)))
    assert summary["rows"] == 10 and summary["rollout_tokens"] == 900 and summary["steps"] == 3
    assert summary["init_from"] == "run7/epochs/e01-from-x" and "curve" not in summary
    assert training_summary(tmp_path) is None


def test_paired_by_group_splits_the_prompts_by_benchmark():
    # per prompt: [anchors, tau_sum]; drafter a is +1 on gsm8k's prompts and equal on mbpp's
    a = {"g1": [2, 6.0], "g2": [2, 4.0], "m1": [1, 2.0], "m2": [1, 1.0]}
    b = {"g1": [2, 4.0], "g2": [2, 2.0], "m1": [1, 2.0], "m2": [1, 1.0]}
    groups = {"g1": "gsm8k", "g2": "gsm8k", "m1": "mbpp", "m2": "mbpp"}
    out = paired_by_group(a, b, groups)
    assert set(out) == {"gsm8k", "mbpp"}
    assert out["gsm8k"]["difference"] == pytest.approx(1.0) and out["gsm8k"]["prompts"] == 2
    assert out["mbpp"]["difference"] == pytest.approx(0.0) and out["mbpp"]["ci95"] == [0.0, 0.0]
