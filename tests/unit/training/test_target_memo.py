"""dspark/training/target_memo.py: a batch served from the memo equals a fresh target forward, whatever batch
and padding the rows come back in; the budget is respected; training two epochs with the memo gives the same
losses as without it, with the target run only in the first epoch."""
import pytest
import torch

from dspark.drafters import DrafterConfig, build_drafter
from dspark.training.config import OptimSection
from dspark.training.loop import LocalTrainer
from dspark.training.target_memo import TargetMemo
from tests.tiny_models import build_tiny_model

V = 16
LAYERS = [0, 1]


@pytest.fixture(scope="module")
def target():
    return build_tiny_model(vocab_size=V)


def rows(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (int(length),), generator=g) for length in torch.randint(6, 14, (n,), generator=g)]


def batch_of(seqs, length=None):
    length = length or max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), length, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for b, s in enumerate(seqs):
        ids[b, :len(s)], attention[b, :len(s)] = s, 1
    loss_mask = attention.clone()
    loss_mask[:, :2] = 0
    return {"input_ids": ids, "loss_mask": loss_mask, "attention_mask": attention}


def forward(target, b):
    return lambda: target.forward(b["input_ids"], attention_mask=b["attention_mask"], layer_ids=LAYERS, logits_at=None)


def test_rows_come_back_equal_in_another_batch_and_padding(target):
    seqs, memo = rows(), TargetMemo.of_gb(1.0)
    first = batch_of(seqs)
    memo.outputs(first["input_ids"], first["attention_mask"], LAYERS, forward(target, first))
    assert (memo.stats.misses, memo.stats.rows_held) == (1, 4)
    again = batch_of(seqs[::-1], length=20)  # other order, more padding
    calls = []
    got = memo.outputs(again["input_ids"], again["attention_mask"], LAYERS, lambda: calls.append(1))
    assert not calls and memo.stats.hits == 1 and got.features.shape[:2] == (4, 20)
    fresh = forward(target, again)()
    real = again["attention_mask"].bool()
    torch.testing.assert_close(got.features[real], fresh.features[real])
    torch.testing.assert_close(got.final_hidden[real], fresh.final_hidden[real])
    # other feature layers are another key: a miss
    memo.outputs(again["input_ids"], again["attention_mask"], [1], lambda: forward(target, again)())
    assert memo.stats.misses == 2


def test_the_budget_bounds_what_is_kept(target):
    seqs = rows(6, seed=1)
    b = batch_of(seqs)
    per_token = (len(LAYERS) + 1) * target.hidden_size * 4  # fp32 features + final
    memo = TargetMemo(budget_bytes=per_token * (len(seqs[0]) + len(seqs[1])))
    memo.outputs(b["input_ids"], b["attention_mask"], LAYERS, forward(target, b))
    assert memo.stats.rows_held >= 2 and memo.stats.rows_over_budget == 6 - memo.stats.rows_held
    assert memo.stats.bytes_held <= memo.budget_bytes
    memo.outputs(b["input_ids"], b["attention_mask"], LAYERS, forward(target, b))  # a row missing: recomputed
    assert memo.stats.misses == 2 and memo.stats.hits == 0
    assert TargetMemo.of_gb(0) is None


def test_two_epochs_with_the_memo_train_like_two_without(target):
    batches = [batch_of(rows(3, seed=s)) for s in (2, 3)]

    def train(memo):
        torch.manual_seed(0)
        drafter = build_drafter(DrafterConfig(algo="dspark", block_size=3, num_layers=1, num_context_layers=2,
                                              rank=8, anchors_per_seq=64), target)
        trainer = LocalTrainer("dspark", target, drafter, OptimSection(lr=1e-3), "fp32", memo=memo)
        return [trainer.step(b, seed=i)["loss"] for i, b in enumerate(batches * 2)]

    memo = TargetMemo.of_gb(1.0)
    with_memo, without = train(memo), train(None)
    assert with_memo == pytest.approx(without, rel=1e-5)
    assert (memo.stats.misses, memo.stats.hits) == (2, 2)  # the target ran in the first epoch only
