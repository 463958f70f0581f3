"""small_batch_linear is F.linear (same product, another summation order) on every path, keeps autograd
for training, and a patched target/drafter computes what it computed before."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import copy
import pickle
import time

from dspark.models.small_batch_linear import MAX_ROWS, SmallBatchLinear, small_batch_linear, use_small_batch_linear
from tests.tiny_models import build_tiny_model


@pytest.mark.parametrize("shape", [(1, 16), (2, 16), (1, 5, 16), (3, 4, 16), (MAX_ROWS, 16), (MAX_ROWS + 1, 16), (0, 16)])
@pytest.mark.parametrize("bias", [False, True])
def test_equals_f_linear_for_any_rows(shape, bias):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(*shape, generator=g), torch.randn(24, 16, generator=g)
    b = torch.randn(24, generator=g) if bias else None
    with torch.no_grad():
        out = small_batch_linear(x, w, b)
    assert out.shape == F.linear(x, w, b).shape
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_only_fp32_takes_the_other_order(monkeypatch):
    """bf16 weights keep F.linear (measured faster for a few rows there); fp32 with 2+ rows takes torch.mm."""
    import dspark.models.small_batch_linear as sbl

    calls = []
    monkeypatch.setattr(sbl.torch, "mm", lambda a, b: calls.append(a.dtype) or torch.matmul(a, b))
    x, w = torch.randn(4, 16), torch.randn(24, 16)
    with torch.no_grad():
        sbl.small_batch_linear(x, w)
        out = sbl.small_batch_linear(x.bfloat16(), w.bfloat16())
    assert calls == [torch.float32] and out.dtype == torch.bfloat16


@pytest.fixture
def other_order_wins(monkeypatch):
    """Routing as on a machine where the other order measured faster (the 2-core EPYC of 2026-12-02)."""
    import dspark.models.small_batch_linear as sbl

    monkeypatch.setattr(sbl, "small_batch_wins", lambda weight: True)


def test_training_calls_keep_the_autograd_path(monkeypatch, other_order_wins):
    import dspark.models.small_batch_linear as sbl

    monkeypatch.setattr(sbl, "MIN_WEIGHT_NUMEL", 0)
    lin = nn.Linear(16, 8)
    assert use_small_batch_linear(lin) == 1 and type(lin) is SmallBatchLinear
    x = torch.randn(4, 16)
    lin(x).sum().backward()  # the patched forward still builds a graph when the weights train
    assert lin.weight.grad is not None and lin.weight.grad.abs().sum() > 0


def _slowed(fn, seconds):
    def slow(*args, **kw):
        time.sleep(seconds)
        return fn(*args, **kw)
    return slow


@pytest.mark.parametrize("slower", ["other order", "F.linear"])
def test_a_shape_is_routed_only_where_the_other_order_measures_faster(monkeypatch, slower):
    """The routing is measured, not assumed: with one order made 2 ms slower per call, the other is chosen,
    and the decision is kept for the shape (measured once)."""
    import types

    import dspark.models.small_batch_linear as sbl

    monkeypatch.setattr(sbl, "_WINS", {})
    if slower == "other order":
        monkeypatch.setattr(sbl, "small_batch_linear", _slowed(sbl.small_batch_linear, 0.002))
    else:
        monkeypatch.setattr(sbl, "F", types.SimpleNamespace(linear=_slowed(F.linear, 0.002)))
    lin = nn.Linear(576, 1536)
    assert sbl.use_small_batch_linear(nn.Sequential(lin)) == (slower == "F.linear")
    assert type(lin) is (SmallBatchLinear if slower == "F.linear" else nn.Linear)
    assert list(sbl._WINS.values()) == [slower == "F.linear"]
    bf16 = nn.Linear(576, 1536).bfloat16()
    assert sbl.use_small_batch_linear(bf16) == 0 and len(sbl._WINS) == 1  # bf16 keeps F.linear, unmeasured


def test_large_linears_are_routed_and_compute_the_same(other_order_wins):
    import dspark.models.small_batch_linear as sbl

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(576, 1536), nn.SiLU(), nn.Linear(1536, 576), nn.Linear(64, 32))
    x = torch.randn(1, 4, 576)
    with torch.no_grad():
        slow = model[2](model[1](model[0](x)))
        assert use_small_batch_linear(model) == 2  # the 64x32 layer is too small to gain: left alone
        assert [type(m) for m in model] == [SmallBatchLinear, nn.SiLU, SmallBatchLinear, nn.Linear]
        assert [sbl.routable(m) for m in model] == [True, False, True, False]  # routed ones stay routable
        fast = model[2](model[1](model[0](x)))
        one = model[0](x[:, :1])  # a single row takes F.linear itself
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(one, F.linear(x[:, :1], model[0].weight, model[0].bias))
    for clone in (copy.deepcopy(model[0]), pickle.loads(pickle.dumps(model[0]))):  # Ray and DeepSpeed copy modules
        assert type(clone) is SmallBatchLinear and torch.equal(clone.weight, model[0].weight)


def test_the_target_and_drafters_route_their_linears(monkeypatch, other_order_wins):
    import dspark.models.small_batch_linear as sbl
    from dspark.drafters import DrafterConfig, build_drafter

    monkeypatch.setattr(sbl, "MIN_WEIGHT_NUMEL", 0)  # the tiny model's layers count as large here
    target = build_tiny_model(vocab_size=64, seed=1, num_layers=3, hidden_size=32)
    assert all(type(m) is SmallBatchLinear for m in target.model.modules() if isinstance(m, nn.Linear))
    drafter = build_drafter(DrafterConfig(algo="dspark", block_size=3, num_layers=1, rank=8), target)
    assert any(type(m) is SmallBatchLinear for m in drafter.modules())
