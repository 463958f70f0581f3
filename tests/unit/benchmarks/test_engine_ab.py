"""benchmarks/engine_ab.py on the tiny target: every mode runs its steps interleaved and counts its prefills;
with --max-tokens-spread every mode gets the same seeded budget sequence; --gate-closed leaves every step of the
dynamic engine a skipped one."""
import json

import torch

from benchmarks.engine_ab import Load, main


def _tiny_drafter_dir(tmp_path) -> str:
    from dspark.drafters import DrafterConfig, build_drafter, save_drafter
    from dspark.models.target import load_target

    torch.manual_seed(0)
    target = load_target("tiny")
    drafter = build_drafter(DrafterConfig(algo="dspark", block_size=3, num_layers=1, rank=8), target)
    save_drafter(drafter, str(tmp_path / "drafter"))
    return str(tmp_path / "drafter")


def test_a_closed_gate_skips_every_step_and_prefills_are_counted(tmp_path, capsys):
    out = tmp_path / "ab.json"
    assert main(["--target", "tiny", "--drafter", _tiny_drafter_dir(tmp_path), "--modes", "off,dynamic",
                 "--concurrency", "2", "--steps", "8", "--warmup", "1", "--max-tokens", "6",
                 "--max-tokens-spread", "0.5", "--gate-closed", "--sps-table", '{"1": 50, "8": 40}',
                 "--threads", "1", "--out", str(out)]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report == json.loads(out.read_text()) and report["gate_closed"] and report["max_tokens_spread"] == 0.5
    rows = {r["mode"]: r for r in report["results"]}
    assert rows["dynamic"]["draft_skipped_step_fraction"] == 1.0 and rows["dynamic"]["engine_totals"]["proposed"] == 0
    assert all(r["steps"] == 8 and r["prefill_steps"] >= 1 for r in rows.values())
    assert set(report["dynamic_over_off"]) == {"2"}


def test_every_mode_draws_the_same_budgets():
    class FakeEngine:
        def __init__(self):
            self.active, self.waiting, self.budgets = [], [], []

        def submit(self, prompt, sampling, max_tokens, stop_ids):
            self.budgets.append(max_tokens)
            self.waiting.append(prompt)

    a, b = Load(FakeEngine(), [[1, 2]], 64, 0.5), Load(FakeEngine(), [[1, 2]], 64, 0.5)
    a.top_up(5), b.top_up(5)
    assert a.engine.budgets == b.engine.budgets and len(set(a.engine.budgets)) > 1
    assert all(32 <= n <= 96 for n in a.engine.budgets)
    same = Load(FakeEngine(), [[1, 2]], 64)
    same.top_up(3)
    assert same.engine.budgets == [64, 64, 64]
