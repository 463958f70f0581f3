"""jobs/demo/next_steps.py: the demo's "where next" paragraph from the committed learning curve and drafter figures."""
import json

from jobs.demo import next_steps


def test_demo_next_step_reads_the_committed_curve_and_says_when_it_extrapolates(tmp_path):
    from tests.paths import REPO

    text = next_steps.next_step(REPO, tau=3.0)
    assert "τ 3" in text and "dspark plan --curve benchmarks/results/learning_curve/cpu-5k.json" in text
    assert "not a forecast" in text  # τ 3 is far beyond the CPU curve's 623k tokens

    # a steep synthetic curve (τ 1 -> 2.5 over 1k -> 100k tokens): τ 2 is inside the measured range
    (tmp_path / next_steps.CPU_CURVE).parent.mkdir(parents=True)
    (tmp_path / next_steps.CPU_ROLLOUTS).parent.mkdir(parents=True)
    points = [{"algo": "dspark", "rollout_tokens": t, "expected_tau": v,
               "training": {"tokens_per_s": 100.0}} for t, v in [(1e3, 1.0), (1e4, 1.75), (1e5, 2.5)]]
    (tmp_path / next_steps.CPU_CURVE).write_text(json.dumps({"benchmark": "learning_curve", "device": "cpu",
                                                          "points": points, "rollouts": {}}))
    (tmp_path / next_steps.CPU_ROLLOUTS).write_text(json.dumps({"device": "cpu", "tokens_per_s": {"engine": 50.0}}))
    text = next_steps.next_step(tmp_path, tau=2.0, workers=1, epochs=1.0)
    assert "τ 2 needs ~2.15e+04 rollout tokens" in text and "EXTRAPOLATED" not in text  # 10^(4 + 1/3)



def test_the_demo_shows_what_the_committed_drafter_measured(tmp_path):
    from tests.paths import REPO

    text = next_steps.best_drafter_line(REPO)
    assert "chain τ 1.74, 1.30× [1.25, 1.36] target-only; tree 2: τ 1.90, 1.39×" in text  # the fastest tree
    assert f"--set model.drafter={next_steps.BEST_CPU_DRAFTER}" in text

    chain_only = {"temperature": 1.0, "gamma": 3, "modes": {
        "target": {"tau": None, "speedup": 1.0, "speedup_ci95": [1.0, 1.0]},
        "dspark:x": {"tau": 1.5, "speedup": 1.1, "speedup_ci95": [1.0, 1.2]}}}
    (tmp_path / next_steps.BEST_CPU_DECODE).parent.mkdir(parents=True)
    (tmp_path / next_steps.BEST_CPU_DECODE).write_text(json.dumps(chain_only))
    text = next_steps.best_drafter_line(tmp_path)
    assert "chain τ 1.50, 1.10× [1.00, 1.20] target-only (" in text and "; tree" not in text


def test_the_demo_paragraph_says_what_it_could_not_read(tmp_path):

    text = next_steps.demo_next_steps(tmp_path, "smollm2-135m")
    assert text.startswith("where next: no learning-curve figures") and "no committed drafter figures" in text
    assert "committed drafter" not in next_steps.demo_next_steps(tmp_path, "tiny")
