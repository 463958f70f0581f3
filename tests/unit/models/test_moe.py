"""dspark/models/moe.py: an MoE target's parameters per token are its dense ones, its routers and top_k of E
experts (Qwen3-30B-A3B's shape: 30.5 B total, 3.3 B active); the training FLOPs count those, not the total;
`dspark memory` names them and the routers' share; a dense model has no MoE profile."""
import pytest

from dspark.models.moe import active_param_count, moe_profile
from dspark.models.target import load_target


def test_moe_profile_counts_the_experts_a_token_runs():
    model = load_target("tiny-qwen3-moe").model
    profile = moe_profile(model)
    hidden, experts, layers = model.config.hidden_size, model.config.num_experts, model.config.num_hidden_layers
    assert (profile.blocks, profile.experts, profile.top_k) == (layers, 4, 2)
    assert profile.router_params == layers * experts * hidden  # one [E, hidden] router per block
    total = sum(p.numel() for p in model.parameters())
    assert profile.total_params == total
    assert profile.active_params == total - profile.expert_params // 2  # top 2 of 4: half the experts skipped
    assert 0 < profile.router_share < 0.05
    assert active_param_count(model) == profile.active_params


def test_a_dense_model_runs_all_its_parameters():
    model = load_target("tiny-qwen3").model
    assert moe_profile(model) is None
    assert active_param_count(model) == sum(p.numel() for p in model.parameters())


def qwen3_30b_a3b_config():
    from transformers import AutoConfig

    return AutoConfig.for_model("qwen3_moe", vocab_size=151936, hidden_size=2048, moe_intermediate_size=768,
                                num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1,
                                tie_word_embeddings=False)


def test_the_plan_of_a_30b_moe_counts_its_active_parameters():
    from dspark.models.sharded_target import target_memory_plan

    plan = target_memory_plan(qwen3_30b_a3b_config(), dtype_bytes=2, shards=4)  # meta device: nothing allocated
    assert plan["params"] == pytest.approx(30.5e9, rel=0.01)
    assert plan["moe"]["active_params"] == pytest.approx(3.35e9, rel=0.01)  # "A3B"
    assert plan["moe"]["router_params"] == 48 * 128 * 2048


def test_training_flops_count_the_active_parameters():
    from dspark.drafters import DrafterConfig, build_drafter
    from dspark.training.loop import FlopsModel

    target = load_target("tiny-qwen3-moe")
    drafter = build_drafter(DrafterConfig(algo="dspark", block_size=3, num_layers=1), target)
    flops = FlopsModel.of(target, drafter)
    assert flops.target_params == moe_profile(target.model).active_params
    assert flops.target_params < sum(p.numel() for p in target.model.parameters())


def test_dspark_memory_names_the_active_parameters_and_the_routers(capsys):
    from dspark.cli import main

    assert main(["memory", "tiny-qwen3-moe", "--shards", "1", "2"]) == 0
    out = capsys.readouterr().out
    assert "MoE: 6 blocks of 4 experts, top 2" in out and "routers" in out and "of a token's FLOPs" in out
