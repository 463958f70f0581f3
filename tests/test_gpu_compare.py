"""benchmarks/gpu_drafter_compare.py end to end on the tiny target (CPU, --smoke sizes):
rollouts -> three drafters trained in lockstep -> checks -> bundle -> unpack -> loadable checkpoints."""
import json

import torch

from benchmarks import gpu_drafter_compare as gc
from dspark.drafters import load_drafter
from dspark.target import load_target


def test_smoke_run_trains_all_three_in_lockstep_and_bundles_loadable_checkpoints(tmp_path, capsys):
    out = tmp_path / "out"
    assert gc.main(["--target", "tiny", "--device", "cpu", "--smoke", "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 3 and set(summary["final"]) == set(gc.ALGOS)
    assert all(c["step"] == 3 for c in summary["final"].values())  # same step budget for every drafter
    assert summary["checks"]["greedy_equal"] == {a: True for a in gc.ALGOS}
    assert all(1.0 <= t <= 8.0 for t in summary["checks"]["tau_t1"].values())
    results = json.loads((out / "results.json").read_text())
    assert results["rollouts"]["sequences"] > 0 and results["training"]["sequences_per_drafter"] == 12

    assert gc.main(["--out", str(out), "--unpack", str(tmp_path / "u")]) == 0
    target = load_target("tiny")
    for algo in gc.ALGOS:
        drafter = load_drafter(str(tmp_path / "u" / "bundle" / algo), target=target)
        assert drafter.algo == algo
        assert all(p.dtype == torch.float32 for p in drafter.parameters())  # bf16 on disk, fp32 when loaded
