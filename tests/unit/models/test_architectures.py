"""dspark/models/architectures.py: every tiny architecture (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Gemma 3) runs
each stage's library path — rollouts (the continuous-batching generator), training of all three drafters,
evaluation (batch-1 speculative decoding), serving (the engine) and export — with greedy outputs equal to the
target's own; feature layers come from the config; a sliding window caps the engine's context, and soft-capped
logits (Gemma 2) are refused by name."""
import json

import pytest
import torch

from dspark.decoding.engine import Engine, EngineConfig
from dspark.decoding.generator import BatchGenerator
from dspark.decoding.sampling import SamplingParams
from dspark.decoding.scheduler import SchedulerConfig
from dspark.decoding.specdec import speculative_generate, target_generate
from dspark.drafters import DrafterConfig, build_drafter
from dspark.export import export_drafter
from dspark.models.architectures import NAMES, tiny_config
from dspark.models.target import Target, load_target, spread_layer_ids
from dspark.training.config import OptimSection
from dspark.training.loop import LocalTrainer

GREEDY = SamplingParams(temperature=0.0)


@pytest.mark.parametrize("name", NAMES)
def test_architectures_run_every_stage(name, tmp_path):
    target = load_target(name)
    assert target.default_layer_ids(3) == spread_layer_ids(target.model.config.num_hidden_layers, 3)
    prompt = target.chat_ids([{"role": "user", "content": "the word is"}])
    ref = target_generate(target, prompt, GREEDY, 10, stop_ids=[]).token_ids

    (rollout, _), _ = BatchGenerator(target).generate([prompt, prompt[:4]], GREEDY, [0, 1], 10, [])
    assert rollout == ref  # rollouts

    ids = torch.tensor([prompt + ref])
    loss_mask = torch.ones_like(ids)
    loss_mask[:, : len(prompt)] = 0
    batch = {"input_ids": ids, "loss_mask": loss_mask, "attention_mask": torch.ones_like(ids)}
    for algo in ("dspark", "dflash", "eagle3"):
        torch.manual_seed(0)
        drafter = build_drafter(DrafterConfig(algo=algo, block_size=3, num_layers=1), target)
        trainer = LocalTrainer(algo, target, drafter, OptimSection(lr=3e-3), "fp32")
        losses = [trainer.step(batch, seed=0)["loss"] for _ in range(3)]
        assert losses[-1] < losses[0], (algo, losses)  # training
        drafter.eval()
        assert speculative_generate(target, drafter, prompt, GREEDY, max_new_tokens=10,
                                    stop_ids=[]).token_ids == ref, algo  # evaluation
        engine = Engine(target, drafter, EngineConfig(scheduler=SchedulerConfig(mode="fixed")))
        (served,) = engine.generate([prompt], GREEDY, max_new_tokens=10, stop_ids=[])
        assert served.tokens == ref, algo  # serving
    out = export_drafter(drafter, str(tmp_path / "vllm"), "vllm", verifier=f"org/{name}")  # export
    exported = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert exported and (tmp_path / "vllm" / "model.safetensors").exists() and out


def test_moe_target_routes_tokens_through_its_experts():
    target = load_target("tiny-qwen3-moe")
    config = target.model.config
    assert config.num_experts == 4 and config.num_experts_per_tok == 2
    routed = []
    gate = target.model.model.layers[0].mlp.gate
    handle = gate.register_forward_hook(lambda _m, _i, out: routed.append(out))
    try:
        target.forward(torch.tensor([[1, 2, 3, 4]]), layer_ids=[1], logits_at=None)
    finally:
        handle.remove()
    assert routed, "the router ran"


def test_a_sliding_window_caps_the_engines_context():
    from transformers import AutoModelForCausalLM

    config = tiny_config("mistral", vocab_size=64)
    config.sliding_window = 48
    target = Target(AutoModelForCausalLM.from_config(config), None, name="windowed")
    assert target.sliding_window == 48
    assert Engine(target, None, EngineConfig(scheduler=SchedulerConfig(mode="off"))).max_model_len == 48
    config.sliding_window = None
    assert Target(AutoModelForCausalLM.from_config(config), None, name="full").sliding_window is None


def test_soft_capped_logits_are_refused_by_name():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gemma2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    with pytest.raises(NotImplementedError, match="final_logit_softcapping"):
        Target(AutoModelForCausalLM.from_config(config), None, name="gemma2")
