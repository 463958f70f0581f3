"""Baselines as the references train them (issue #13 item 1): Eagle3 dense training-time test equals the
packed path with every position anchored, soft-label CE against a hand value, geometric step weights,
and per-token loss normalisation (independent of how pairs group into blocks)."""
import math

import pytest
import torch

from dspark.drafters.anchors import all_anchors, is_dense
from dspark.drafters import DrafterConfig, build_drafter
from dspark.training.losses import loss_denominator, position_weights, soft_ce_loss
from dspark.training.loss import drafter_loss, supervised_pairs
from tests.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def target():
    return build_tiny_model(vocab_size=16)


def eagle3(target, **kw):
    torch.manual_seed(0)
    return build_drafter(DrafterConfig(algo="eagle3", ttt_steps=3, **kw), target)


def test_geometric_step_weights_and_denominators():
    assert torch.allclose(position_weights(4, "geometric", decay=0.8), torch.tensor([1.0, 0.8, 0.64, 0.512]))
    w = torch.tensor([1.0, 0.8, 1.0])
    assert loss_denominator(w, n_blocks=2, kind="token") == pytest.approx(2.8)
    assert loss_denominator(w, n_blocks=2, kind="block") == 2.0
    with pytest.raises(ValueError, match="loss_norm"):
        loss_denominator(w, 2, "sequence")


def test_soft_ce_hand_value():
    # p_d uniform over 4 tokens, p_t = (0.7, 0.1, 0.1, 0.1): −Σ p_t log p_d = log 4 at every pair
    p_t = torch.tensor([[0.7, 0.1, 0.1, 0.1], [1.0, 0.0, 0.0, 0.0]])
    logits = torch.zeros(2, 4)
    w = torch.tensor([1.0, 0.8])
    assert soft_ce_loss(logits, p_t, w, float(w.sum())).item() == pytest.approx(math.log(4), rel=1e-6)
    # a draft equal to the target reaches the target's entropy, the minimum
    ent = -(0.7 * math.log(0.7) + 3 * 0.1 * math.log(0.1))
    assert soft_ce_loss(p_t[:1].log(), p_t[:1], w[:1], 1.0).item() == pytest.approx(ent, rel=1e-5)


def test_all_anchors_layout():
    loss_mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    anchors, valid = all_anchors(loss_mask, torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]))
    assert anchors.tolist() == [[0, 1, 2, 3, 4]] * 2 and is_dense(anchors)
    assert valid.tolist() == [[False, True, True, False, False], [True, True, False, False, False]]
    assert not is_dense(torch.tensor([[1, 2, 3, 4, 0]]))


def test_dense_ttt_equals_packed_path_with_every_position_anchored(target):
    drafter = eagle3(target)
    ids = torch.randint(0, 16, (2, 12), generator=torch.Generator().manual_seed(1))
    loss_mask = torch.ones_like(ids)
    loss_mask[:, :3] = 0
    attention = torch.ones_like(ids)
    attention[1, 9:] = 0
    feats = target.forward(ids, attention_mask=attention, layer_ids=drafter.layer_ids, logits_at=None).features
    dense, valid = all_anchors(loss_mask, attention)
    _, sel_dense = supervised_pairs(loss_mask, attention, dense, valid, 3)
    # the packed path over the same anchors, listed without the dense layout (eligible positions only)
    rows = [r.nonzero().flatten() for r in valid]
    n = max(len(r) for r in rows)
    packed = torch.zeros(2, n, dtype=torch.long)
    pvalid = torch.zeros(2, n, dtype=torch.bool)
    for b, r in enumerate(rows):
        packed[b, :len(r)], pvalid[b, :len(r)] = r, True
    _, sel_packed = supervised_pairs(loss_mask, attention, packed, pvalid, 3)
    with torch.no_grad():
        a = drafter(feats, ids, attention.bool(), dense, sel_dense).logits
        b = drafter(feats, ids, attention.bool(), packed, sel_packed).logits
    assert a.shape == b.shape and a.shape[0] == int(sel_dense.sum()) > 0
    assert torch.allclose(a, b, atol=1e-5)


def test_dense_soft_eagle3_loss_trains_and_uses_every_position(target):
    drafter = eagle3(target, dense_ttt=True, ce_target="soft", position_weight="geometric", loss_ce=1.0,
                     loss_tv=0.0, anchors_per_seq=1)
    ids = torch.randint(0, 16, (2, 16), generator=torch.Generator().manual_seed(0))
    loss_mask = torch.ones_like(ids)
    loss_mask[:, :3] = 0
    opt = torch.optim.AdamW(drafter.parameters(), lr=5e-3)
    losses = []
    for _ in range(15):
        out = drafter_loss(drafter, target, ids, loss_mask, None, torch.Generator().manual_seed(0))
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    assert out.metrics["n_anchors"] == 2 * 12  # every eligible position (3..14) despite anchors_per_seq=1
    assert losses[-1] < 0.9 * losses[0], losses
