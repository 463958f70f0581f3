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


def test_decode_setting_keeps_the_benchmarks_and_cuts_each_answer():
    import torch

    from dspark.models.target import TargetOutput
    from recipes.learning_curve.measure import decode_setting

    def row(pid, domain, prompt_len, answer_len):
        n = prompt_len + answer_len
        return {"prompt_id": pid, "domain": domain, "input_ids": list(range(n)),
                "loss_mask": [0] * prompt_len + [1] * answer_len}

    rows = [row("g", "gsm8k", 3, 10), row("m", "mbpp", 2, 10), row("t", "mt-bench", 4, 2)]
    rows[2]["input_ids"] += [90, 91, 92, 93, 94]  # a second turn: user text, then an answer
    rows[2]["loss_mask"] += [0, 0, 1, 1, 1]
    outs = [TargetOutput(features=torch.randn(1, len(r["input_ids"]), 6),
                         final_hidden=torch.randn(1, len(r["input_ids"]), 2), logits=None, cache=None) for r in rows]
    cut_rows, cut_outs, sp = decode_setting((rows, outs, "sp"), ["gsm8k", "mt-bench"], 5)
    assert [r["prompt_id"] for r in cut_rows] == ["g", "t"] and sp == "sp"
    assert [len(r["input_ids"]) for r in cut_rows] == [3 + 5, 4 + 2]  # the short first answer is kept whole, no more
    assert cut_rows[0]["loss_mask"] == [0, 0, 0, 1, 1, 1, 1, 1]
    assert torch.equal(cut_outs[0].features, outs[0].features[:, :8])
    assert torch.equal(cut_outs[1].final_hidden, outs[2].final_hidden[:, :6])
    assert [len(r["input_ids"]) for r in decode_setting((rows, outs, sp), None, None)[0]] == [13, 12, 11]
    with pytest.raises(SystemExit, match="no held-out rows"):
        decode_setting((rows, outs, sp), ["humaneval"], None)


def test_a_decode_setting_run_writes_its_own_file():
    from recipes.learning_curve import parse_args
    from recipes.learning_curve.measure import compare_file

    plain = parse_args(["compare", "--drafters", "a", "b"])
    assert compare_file(plain) == "compare.json"
    decode = parse_args(["compare", "--drafters", "a", "b", "--gamma", "3", "--answer-tokens", "64",
                         "--benchmarks", "gsm8k", "mt-bench"])
    assert compare_file(decode) == "compare-g3-a64-gsm8k+mt-bench.json"
    with pytest.raises(SystemExit):
        parse_args(["compare", "--drafters", "a", "b", "--gamma", "0"])


def test_compare_plot_draws_every_drafter_with_and_without_the_renewal_estimate(tmp_path):
    from recipes.learning_curve.compare_plot import plot_compare

    def row(tau, renewal=None, vs=None):
        extra = {} if renewal is None else {"decoded_tau_estimate": renewal,
                                            "decoded_tau_estimate_ci95": [renewal - 0.1, renewal + 0.1],
                                            "decoded_vs_baseline": vs}
        return {"expected_tau": tau, "expected_tau_ci95": [tau - 0.1, tau + 0.1], "vs_baseline": vs, **extra}

    paired = {"difference": 0.02, "ci95": [0.01, 0.03], "prompts": 9}
    for name, rows in (("plain", [row(1.9), row(1.92, vs=paired)]),
                       ("renewal", [row(1.9, 1.8), row(1.92, 1.81, paired), row(1.95, 1.83, paired)])):
        report = {"held_out_rows": 9, "setting": {"gamma": {"a": 3}, "answer_tokens": 64 if name == "renewal" else None},
                  "drafters": {f"d{i}": r for i, r in enumerate(rows)}}
        path = tmp_path / f"{name}.png"
        plot_compare(report, [f"d{i}" for i in range(len(rows))], path)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_renewal_estimate_against_a_baseline_without_one_has_no_paired_difference():
    from recipes.learning_curve.measure import decoded_estimate

    renewal = {"decoded_tau": 1.5, "decoded_tau_ci95": [1.4, 1.6], "per_group": {"gsm8k": {"decoded_tau": 1.5}},
               "per_prompt": [("p0", "gsm8k", 10, 6.0), ("p1", "gsm8k", 10, 7.0)]}
    eagle = {"alpha": {}, "renewal": renewal}  # estimated at every anchor (it trains every position)
    strided_base = {"alpha": {}}  # a DSpark baseline subsampled: no renewal estimate
    got = decoded_estimate(eagle, strided_base, is_base=False)
    assert got["decoded_tau_estimate"] == 1.5 and got["decoded_vs_baseline"] is None
    assert decoded_estimate(strided_base, strided_base, is_base=True) == {}
