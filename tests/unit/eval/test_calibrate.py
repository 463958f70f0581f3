"""ECE / ROC-AUC / Brier on hand examples and STS on synthetic overconfident confidences."""
import numpy as np
import pytest

from dspark.eval.calibrate import (apply_sts, brier, ece, fit_sts, reliability_curve, roc_auc, rounds_to_arrays,
                                to_logits, write_reliability_diagram)
from dspark.decoding.specdec import RoundStats


def test_ece_hand_example():
    probs = [0.1, 0.1, 0.9, 0.9]
    labels = [0, 1, 1, 1]
    # 2 bins: low bin mean p .1 vs freq .5 (gap .4), high bin .9 vs 1 (gap .1) -> ECE = .5·.4 + .5·.1
    assert ece(probs, labels, n_bins=2) == pytest.approx(0.25)
    assert ece([0.0, 1.0], [0, 1]) == 0.0
    assert ece([1.0, 1.0], [0, 0], n_bins=10) == pytest.approx(1.0)  # p = 1 falls in the last bin


def test_roc_auc_hand_examples_with_ties():
    assert roc_auc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.75)
    assert roc_auc([0.5, 0.5, 0.5, 0.5], [0, 1, 0, 1]) == pytest.approx(0.5)  # all tied
    assert roc_auc([0.2, 0.5, 0.5, 0.9], [0, 0, 1, 1]) == pytest.approx(0.875)  # one tied pair counts ½
    assert np.isnan(roc_auc([0.1, 0.2], [1, 1]))


def test_brier():
    assert brier([1.0, 0.0, 0.5], [1, 1, 0]) == pytest.approx((0 + 1 + 0.25) / 3)


def _synthetic_rounds(n: int = 20000, gamma: int = 4, seed: int = 0):
    """True conditional acceptance q_k = σ(z_k); the head reports σ(3 z_k): overconfident."""
    rng = np.random.default_rng(seed)
    z = rng.normal(1.0, 1.5, size=(n, gamma))
    q = 1 / (1 + np.exp(-z))
    survive = rng.uniform(size=(n, gamma)) < q
    accepted = np.argmin(np.concatenate([survive, np.zeros((n, 1), bool)], axis=1), axis=1)
    reported = 1 / (1 + np.exp(-3 * z))
    return reported, accepted


def test_sts_fixes_overconfident_prefix_survival():
    conf, accepted = _synthetic_rounds()
    result = fit_sts(conf, accepted)
    print("STS temperatures", [round(t, 2) for t in result.temperatures])
    for pos in result.positions:
        print(f"k={pos['k']} ECE {pos['ece_before']:.3f} -> {pos['ece_after']:.3f} AUC {pos['auc_after']:.3f}")
        assert pos["ece_after"] < 0.5 * pos["ece_before"] and pos["ece_after"] < 0.03
        assert pos["brier_after"] < pos["brier_before"]
        assert abs(pos["auc_after"] - pos["auc_before"]) < 0.02  # ranking of the products barely moves
    assert all(2.0 < t < 4.5 for t in result.temperatures)  # ≈ 3 undoes the overconfidence
    # order-preserving per position: the ranking of c_k, hence its AUC, is unchanged
    calibrated = apply_sts(conf, result.temperatures)
    for k in range(conf.shape[1]):
        order = np.argsort(conf[:, k], kind="stable")
        assert (np.diff(calibrated[order, k]) >= 0).all()
        reached = accepted >= k
        assert roc_auc(calibrated[reached, k], accepted[reached] > k) == pytest.approx(
            roc_auc(conf[reached, k], accepted[reached] > k))
    assert result.positions[0]["auc_after"] == pytest.approx(result.positions[0]["auc_before"])
    summary = result.summary()
    assert summary["ece_after"] < summary["ece_before"]


def test_sts_only_uses_rounds_that_verified_the_position():
    conf, accepted = _synthetic_rounds(n=4000, gamma=3, seed=1)
    verified = np.full(len(accepted), 3)
    verified[:2000] = 1  # half the rounds never verified positions 2 and 3
    accepted = np.minimum(accepted, verified)
    result = fit_sts(conf, accepted, verified)
    assert [p["n"] for p in result.positions] == [4000, 2000, 2000]


def test_sts_accepts_logits_and_rounds():
    conf, accepted = _synthetic_rounds(n=3000, gamma=2, seed=2)
    a = fit_sts(conf, accepted).temperatures
    b = fit_sts(to_logits(conf), accepted, is_logits=True).temperatures
    assert a == b
    rounds = [RoundStats(2, 2, int(acc), [], list(c)) for c, acc in zip(conf, accepted)]
    conf2, acc2, ver2 = rounds_to_arrays(rounds + [RoundStats(2, 2, 0, [], None)])
    assert conf2.shape == (3000, 2) and np.array_equal(acc2, accepted) and (ver2 == 2).all()
    with pytest.raises(ValueError, match="confidence head"):
        rounds_to_arrays([RoundStats(2, 2, 0, [], None)])


def test_reliability_diagram_png(tmp_path):
    conf, accepted = _synthetic_rounds(n=2000, gamma=1)
    labels = accepted >= 1
    curve = reliability_curve(conf[:, 0], labels, n_bins=10)
    assert sum(curve["count"]) == 2000
    path = write_reliability_diagram(str(tmp_path / "rel.png"), {"raw": (conf[:, 0], labels)}, title="k=1")
    with open(path, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
