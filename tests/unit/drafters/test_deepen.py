"""Deepening a trained drafter (dspark/drafters/deepen.py): the deeper drafter drafts exactly what the
source drafted, its added layers train, and clashing sources are refused."""
import pytest
import torch

from dspark.drafters import DrafterConfig, build_drafter, save_drafter
from dspark.drafters.deepen import deepen_from
from dspark.training.session import load_initial_weights
from tests.tiny_models import build_tiny_model

V = 16


@pytest.fixture(scope="module")
def target():
    return build_tiny_model(vocab_size=V)


def make(target, algo="dspark", head="markov", layers=1, **over):
    torch.manual_seed(layers)
    cfg = DrafterConfig(algo=algo, head=head, rank=8, block_size=4, num_layers=layers, **over)
    drafter = build_drafter(cfg, target)
    with torch.no_grad():
        for p in drafter.parameters():  # away from the initialisation, so copying weights is what is tested
            p.add_(0.05 * torch.randn_like(p))
    return drafter


def train_args(target, drafter):
    ids = torch.randint(0, V, (1, 14), generator=torch.Generator().manual_seed(5))
    feats = target.forward(ids, layer_ids=drafter.layer_ids, logits_at=None).features
    return (feats, ids, torch.ones_like(ids, dtype=torch.bool), torch.tensor([[3, 6]]),
            torch.ones(1, 2, 4, dtype=torch.bool))


@pytest.mark.parametrize("algo,head", [("dflash", "markov"), ("dspark", "markov"), ("dspark", "rnn")])
def test_a_deepened_drafter_drafts_what_its_source_drafted(target, algo, head):
    source = make(target, algo, head, layers=1)
    deeper = make(target, algo, head, layers=3)
    assert deepen_from(deeper, source) == 2
    args = train_args(target, source)
    with torch.no_grad():
        same = deeper(*args), source(*args)
    assert torch.allclose(same[0].logits, same[1].logits, atol=1e-6)
    if same[1].conf_logits is not None:
        assert torch.allclose(same[0].conf_logits, same[1].conf_logits, atol=1e-6)
    added = deeper.layers[2]
    assert added.self_attn.o_proj.weight.abs().sum() == 0 and added.mlp.down_proj.weight.abs().sum() == 0
    assert torch.equal(added.self_attn.q_proj.weight, source.layers[0].self_attn.q_proj.weight)
    # the added layers learn: one step moves their zero output projections
    deeper(*args).logits.logsumexp(-1).sum().backward()
    assert added.self_attn.o_proj.weight.grad.abs().sum() > 0 and added.mlp.down_proj.weight.grad.abs().sum() > 0


def test_init_from_a_shallower_saved_drafter_deepens_it(target, tmp_path):
    source = make(target, layers=1)
    save_drafter(source, str(tmp_path / "d"))
    deeper = make(target, layers=2)
    load_initial_weights(deeper, str(tmp_path / "d"), target)
    args = train_args(target, source)
    with torch.no_grad():
        assert torch.allclose(deeper(*args).logits, source(*args).logits, atol=1e-6)


def test_deepening_refuses_other_configs_shallower_targets_and_eagle3(target):
    with pytest.raises(ValueError, match="rank"):
        deepen_from(build_drafter(DrafterConfig(algo="dspark", rank=4, block_size=4, num_layers=2), target),
                    make(target, layers=1))
    with pytest.raises(ValueError, match="fewer layers to more"):
        deepen_from(make(target, layers=1), make(target, layers=2))
    with pytest.raises(ValueError, match="only"):
        deepen_from(make(target, "eagle3"), make(target, "eagle3"))


def test_a_training_job_may_ask_for_more_layers_than_its_init_checkpoint_but_not_other_changes():
    from dspark.config import ConfigError
    from dspark.training.config import TrainJobConfig
    from dspark.training.plan import init_from_checkpoint

    saved = DrafterConfig(algo="dspark", rank=16, block_size=4, num_layers=1).model_dump()
    base = {"run_name": "r", "data": {"rollouts": "x"}, "scaling": {"num_workers": 1},
            "optim": {"micro_batch_size": 4, "global_batch_size": 4}}

    def job(**drafter):
        return TrainJobConfig.model_validate({**base, "drafter": drafter})

    assert init_from_checkpoint(job(num_layers=2), saved, "d").drafter.num_layers == 2
    assert init_from_checkpoint(job(), saved, "d").drafter.num_layers == 1
    with pytest.raises(ConfigError, match="num_layers"):  # fewer layers than trained: weights would be lost
        init_from_checkpoint(job(num_layers=1), {**saved, "num_layers": 2}, "d")
    with pytest.raises(ConfigError, match="rank"):
        init_from_checkpoint(job(num_layers=2, rank=8), saved, "d")


def test_training_only_fields_may_differ_from_the_source(target):
    deeper = make(target, layers=2, loss_ce=0.5, anchors_per_seq=8)
    assert deepen_from(deeper, make(target, layers=1)) == 1
