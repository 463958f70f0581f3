"""dspark.training.session.load_initial_weights: what a continued drafter takes from its checkpoint."""
import torch

from dspark.drafters import DrafterConfig, build_drafter, save_drafter
from dspark.models.target import load_target
from dspark.training.session import load_initial_weights


def test_continuing_a_drafter_keeps_its_weights_and_draft_temperature_not_its_calibration(tmp_path):
    target = load_target("tiny")
    cfg = DrafterConfig(algo="dspark", block_size=4, num_layers=1, rank=16)
    torch.manual_seed(3)
    source = build_drafter(cfg, target)
    source.draft_temperature, source.calibration = 0.8, [1.0, 1.1, 1.2]
    save_drafter(source, str(tmp_path / "d"))
    torch.manual_seed(4)
    fresh = build_drafter(cfg, target)
    load_initial_weights(fresh, str(tmp_path / "d"), target)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), source.state_dict().values()))
    assert fresh.draft_temperature == 0.8  # a decoding setting chosen by measurement: kept
    assert fresh.calibration is None  # fitted to the old weights: the continued drafter is calibrated anew
