"""dspark/training/step.py LossModule with a lower-precision forward target (TrainJobConfig.target_forward_dtype):
the same loss as the target's own forward (exactly when it is the same model, within bf16 rounding for a
bf16 copy), fp32 gradients, and the rule that decides when the bf16 copy runs."""
import copy

import pytest
import torch

from dspark.drafters import DrafterConfig, build_drafter
from dspark.training.session import bf16_forward
from dspark.training.step import LossModule
from tests.tiny_models import build_tiny_model

V = 16


@pytest.fixture(scope="module")
def target():
    return build_tiny_model(vocab_size=V)


def batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (3, 14), generator=g)
    mask = torch.ones_like(ids)
    mask[:, :3] = 0
    return ids, mask, torch.ones_like(ids)


def loss_of(module):
    loss, metrics = module(*batch(), torch.Generator().manual_seed(1))
    return loss, metrics


def drafter_of(target):
    torch.manual_seed(0)
    return build_drafter(DrafterConfig(algo="dspark", block_size=3, num_layers=1, num_context_layers=2, rank=8,
                                       anchors_per_seq=64), target)


def test_forward_target_feeds_the_drafter(target):
    drafter = drafter_of(target)
    own, metrics = loss_of(LossModule(drafter, target))
    assert metrics["n_supervised"] > 0
    same, _ = loss_of(LossModule(drafter, target, forward_target=target))
    assert float(same.detach()) == float(own.detach())  # the plumbing alone changes nothing

    bf16 = copy.deepcopy(target)
    bf16.model.to(torch.bfloat16)
    module = LossModule(drafter, target, forward_target=bf16)
    loss, _ = loss_of(module)
    assert loss.dtype == torch.float32 and float(loss.detach()) == pytest.approx(float(own.detach()), rel=2e-2)
    loss.backward()
    grads = [p.grad for p in drafter.parameters() if p.requires_grad and p.grad is not None]
    assert grads and all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)
    assert all(p.grad is None for p in bf16.model.parameters())  # the copy stays frozen


def test_when_the_bf16_copy_runs(monkeypatch):
    from dspark.models import precision

    monkeypatch.setattr(precision, "bf16_is_native", lambda device: device == "cpu")
    assert bf16_forward("bfloat16", "fp32", "cuda") and bf16_forward("auto", "fp32", "cpu")
    assert not bf16_forward("auto", "fp32", "cuda")  # not native there: the fp32 target runs it
    assert not bf16_forward("same", "fp32", "cpu")
    assert not bf16_forward("bfloat16", "bf16", "cuda")  # a bf16 run's target is bf16 already


def test_config_rejects_other_dtypes():
    from pydantic import ValidationError

    from dspark.training.config import TrainJobConfig

    base = {"run_name": "r", "data": {"rollouts": "x"}}
    assert TrainJobConfig(**base).target_forward_dtype == "auto"  # bf16 copy where native, else same
    assert TrainJobConfig(**base, target_forward_dtype="same").target_forward_dtype == "same"
    with pytest.raises(ValidationError):
        TrainJobConfig(**base, target_forward_dtype="float16")
