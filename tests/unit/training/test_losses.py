"""Drafter losses against hand-computed values (2 positions, 4-token vocabulary) and the wiring of
drafter_loss (labels = token t+k, target distribution = target logits at t+k-1)."""
import math

import pytest
import torch
from torch import nn

from dspark.drafters import DrafterConfig
from dspark.drafters.base import DraftTrainOut
from dspark.training.losses import (acceptance_label, acceptance_metrics, ce_loss, conf_loss, position_weights, tv_l1,
                           tv_loss)
from dspark.models.target import TargetOutput
from dspark.training.loss import drafter_loss, supervised_pairs

# Hand example: one anchor block, γ = 2 positions, vocabulary of 4 tokens.
P_DRAFT = torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.5, 0.25, 0.125, 0.125]])
P_TARGET = torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.5, 0.5, 0.0, 0.0]])
LABELS = torch.tensor([0, 1])
CONF_LOGITS = torch.tensor([0.0, math.log(3.0)])  # sigmoid -> 0.5, 0.75
W2 = math.exp(-0.5)  # paper weight of position 2 at γ = 2
CE = math.log(4) * (1 + W2)  # -log 0.25 at both positions
TV = 0.9 + W2 * 0.5  # ‖p_d - p_t‖₁ = 0.45 + 3·0.15 = 0.9 and 0 + 0.25 + 0.125 + 0.125 = 0.5
C_STAR = [0.55, 0.75]  # 1 - ½‖·‖₁
CONF = math.log(2) + W2 * -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))


def test_position_weights():
    assert torch.allclose(position_weights(2, "paper"), torch.tensor([1.0, W2]))
    assert torch.allclose(position_weights(3, "reference"), torch.tensor([1.0, math.exp(-0.25), math.exp(-0.5)]))
    with pytest.raises(ValueError, match="position_weight"):
        position_weights(2, "linear")


def test_each_loss_matches_hand_value():
    w = position_weights(2)
    assert ce_loss(P_DRAFT.log(), LABELS, w, denom=1.0).item() == pytest.approx(CE, rel=1e-6)
    assert torch.allclose(tv_l1(P_DRAFT, P_TARGET), torch.tensor([0.9, 0.5]))
    assert tv_loss(P_DRAFT, P_TARGET, w, denom=1.0).item() == pytest.approx(TV, rel=1e-6)
    c_star = acceptance_label(P_DRAFT, P_TARGET)
    assert torch.allclose(c_star, torch.tensor(C_STAR))
    assert conf_loss(CONF_LOGITS, c_star, w, denom=1.0).item() == pytest.approx(CONF, rel=1e-6)
    # the normaliser divides every term: the same pairs over two blocks ("block" norm) halve the loss
    assert tv_loss(P_DRAFT, P_TARGET, w, denom=2.0).item() == pytest.approx(TV / 2, rel=1e-6)


def test_acceptance_metrics_hand_value():
    m = acceptance_metrics(torch.tensor([C_STAR]), torch.ones(1, 2, dtype=torch.bool))
    assert m["acc_pos_1"] == pytest.approx(0.55)
    assert m["acc_pos_2"] == pytest.approx(0.75)
    assert m["expected_accept_len"] == pytest.approx(1 + 0.55 + 0.55 * 0.75)
    # an incomplete block does not enter the expected length when a complete one exists
    m = acceptance_metrics(torch.tensor([C_STAR, [1.0, 0.0]]), torch.tensor([[True, True], [True, False]]))
    assert m["acc_pos_1"] == pytest.approx((0.55 + 1.0) / 2)
    assert m["acc_pos_2"] == pytest.approx(0.75)
    assert m["expected_accept_len"] == pytest.approx(1.9625)


def test_supervised_pairs_labels_rule():
    loss_mask = torch.tensor([[0, 1, 1, 1, 0, 1]])
    anchors, valid = torch.tensor([[1, 3, 0]]), torch.tensor([[True, True, False]])
    pos, sel = supervised_pairs(loss_mask, torch.ones_like(loss_mask), anchors, valid, steps=3)
    assert pos.tolist() == [[[2, 3, 4], [4, 5, 5], [1, 2, 3]]]  # t+k, clamped at T-1
    # anchor 1: tokens 2, 3 supervised, token 4 is not; anchor 3: token 4 not, 5 yes, 6 past the end
    assert sel.tolist() == [[[True, True, False], [False, True, False], [False, False, False]]]


class StubTarget:
    """Final hidden state at position i = log p_t of the token at i+1; identity LM head."""
    device = torch.device("cpu")

    def __init__(self, hidden):
        self.hidden = hidden

    def forward(self, input_ids, *, attention_mask=None, layer_ids=None, logits_at=None, **_):
        return TargetOutput(features=torch.zeros(1, input_ids.shape[1], 3), final_hidden=self.hidden,
                            logits=None, cache=None)

    def lm_logits(self, h):
        return h


class StubDrafter(nn.Module):
    """Returns fixed draft logits / confidence logits for the supervised pairs, in (anchor, k) order."""

    def __init__(self, algo, logits, conf_logits, loss_norm="token"):
        super().__init__()
        self.config = DrafterConfig(algo=algo, block_size=2, anchors_per_seq=4, loss_norm=loss_norm)
        self.layer_ids = [0]
        self.trains_every_position = False  # sampled anchors, as DSpark/DFlash train
        self.bias = nn.Parameter(torch.zeros(()))
        self.logits, self.conf_logits = logits, conf_logits
        self.seen = None

    def forward(self, features, input_ids, ctx_valid, anchors, select):
        self.seen = (anchors.clone(), select.clone())
        conf = self.conf_logits if self.config.algo == "dspark" else None
        return DraftTrainOut(logits=self.logits + self.bias, conf_logits=conf)


@pytest.mark.parametrize("algo", ["dspark", "dflash"])
@pytest.mark.parametrize("loss_norm", ["block", "token"])
def test_drafter_loss_wiring_matches_hand_value(algo, loss_norm):
    # tokens x = [3, 2, 0, 1], loss_mask [0, 1, 1, 1]: eligible anchors t=1 and t=2 (both drawn).
    # Pairs (t, k): (1,1) label x2=0, p_t from position 1; (1,2) label x3=1, p_t from position 2;
    # (2,1) label x3=1, p_t from position 2; (2,2) is past the end. n_blocks = 2.
    input_ids = torch.tensor([[3, 2, 0, 1]])
    loss_mask = torch.tensor([[0, 1, 1, 1]])
    hidden = torch.zeros(1, 4, 4)
    hidden[0, 1], hidden[0, 2] = P_TARGET[0].log(), P_TARGET[1].clamp_min(1e-30).log()
    hidden[0, 0] = hidden[0, 3] = torch.tensor([9.0, -9, -9, -9])  # would break the value if misused
    third = P_TARGET[1].clamp_min(1e-30)  # draft = target for pair (2,1): TV 0, c* = 1, CE = ln 2
    logits = torch.cat([P_DRAFT.log(), third.log().unsqueeze(0)])
    conf_logits = torch.cat([CONF_LOGITS, torch.tensor([math.log(3.0)])])  # BCE(0.75, 1) = -ln 0.75
    drafter = StubDrafter(algo, logits, conf_logits, loss_norm)
    out = drafter_loss(drafter, StubTarget(hidden), input_ids, loss_mask, None, torch.Generator().manual_seed(0))
    anchors, select = drafter.seen
    assert anchors.tolist() == [[1, 2]]
    assert select.tolist() == [[[True, True], [True, False]]]
    # "block": sums over 2 blocks; "token": weighted mean over the 3 pairs, weights 1, W2, 1
    denom = 2.0 if loss_norm == "block" else 2.0 + W2
    ce, tv = (CE + math.log(2)) / denom, TV / denom  # pair (2,1): draft = target, TV 0
    conf = (CONF - math.log(0.75)) / denom if algo == "dspark" else 0.0
    assert out.metrics["loss_ce"] == pytest.approx(ce, rel=1e-5)
    assert out.metrics["loss_tv"] == pytest.approx(tv, rel=1e-5)
    assert out.metrics["loss_conf"] == pytest.approx(conf, rel=1e-5)
    assert out.loss.item() == pytest.approx(0.1 * ce + 0.9 * tv + conf, rel=1e-5)
    assert out.metrics["acc_pos_1"] == pytest.approx((0.55 + 1.0) / 2, rel=1e-5)
    assert out.metrics["acc_pos_2"] == pytest.approx(0.75, rel=1e-5)
    assert out.metrics["expected_accept_len"] == pytest.approx(1.9625, rel=1e-5)  # complete block only
    out.loss.backward()
    assert drafter.bias.grad is not None


def test_drafter_loss_without_anchors_is_zero_with_grad():
    drafter = StubDrafter("dspark", None, None)
    out = drafter_loss(drafter, StubTarget(torch.zeros(1, 3, 4)), torch.tensor([[1, 2, 3]]),
                       torch.tensor([[0, 0, 1]]), None, torch.Generator().manual_seed(0))
    assert out.loss.item() == 0.0 and out.metrics["n_anchors"] == 0.0
    out.loss.backward()


def test_sequence_step_weights_average_per_sequence_then_over_sequences():
    """Sequence 0 supervises 3 positions at step 1 and 1 at step 2, sequence 1 one position at step 1:
    the loss is (w1·(mean_seq0 + mean_seq1)/2 + w2·seq0) / (w1 + w2), whatever the position counts."""
    import torch

    from dspark.drafters import DrafterConfig
    from dspark.training.losses import sequence_step_weights

    select = torch.zeros(2, 3, 2, dtype=torch.bool)
    select[0, :, 0] = True
    select[0, 0, 1] = True
    select[1, 0, 0] = True
    w = torch.tensor([1.0, 0.5])
    terms = torch.tensor([[[1.0, 7.0], [2.0, 0.0], [3.0, 0.0]], [[10.0, 0.0], [0.0, 0.0], [0.0, 0.0]]])
    weights, denom = sequence_step_weights(select, w)
    got = float((weights * terms[select]).sum() / denom)
    want = (1.0 * ((1 + 2 + 3) / 3 + 10) / 2 + 0.5 * 7) / 1.5
    assert abs(got - want) < 1e-6
    assert DrafterConfig(algo="eagle3").resolved_loss_norm == "sequence_step"
    assert DrafterConfig(algo="dspark").resolved_loss_norm == "token"


def test_target_distributions_run_the_lm_head_once_per_position_and_equal_the_per_pair_softmax():
    """Overlapping anchor blocks label a position several times: target_distributions computes each distinct
    position's softmax once (counted through the LM head) and gives every pair the same rows as the per-pair
    computation, also on a draft vocabulary's columns with the mass outside them."""
    from dspark.training.loss import target_distributions

    torch.manual_seed(0)
    hidden = torch.randn(2, 6, 5)
    calls = []

    class Counting(StubTarget):
        def lm_logits(self, h):
            calls.append(h.shape[0])
            return h

    anchors, valid = torch.tensor([[0, 1, 2], [1, 2, 3]]), torch.ones(2, 3, dtype=torch.bool)
    pos, sel = supervised_pairs(torch.ones(2, 6, dtype=torch.long), torch.ones(2, 6, dtype=torch.long), anchors, valid, 3)
    per_pair = torch.softmax(hidden.gather(1, (pos - 1).flatten(1)[..., None].expand(-1, -1, 5))
                             .view(*pos.shape, 5)[sel], -1)
    probs, lost = target_distributions(Counting(hidden), hidden, pos - 1, sel, None)
    assert lost is None and torch.allclose(probs, per_pair)
    assert calls == [len(torch.unique(((torch.arange(2)[:, None, None] * 6) + pos - 1)[sel]))] and calls[0] < int(sel.sum())
    columns = torch.tensor([4, 0])
    on_cols, lost = target_distributions(Counting(hidden), hidden, pos - 1, sel, columns)
    assert torch.allclose(on_cols, per_pair[:, columns]) and torch.allclose(lost, 1 - per_pair[:, columns].sum(-1))
