"""Tiny random targets of the architectures users train drafters for, built locally (no hub): `tiny-<arch>`.

Each is a 6-layer, 64-wide model of that transformers class with the built-in tiny tokenizer and ChatML
template, seed 0, initialised wide (std 0.8) so its next-token distributions are peaked like a real LM's.
They load like any target (`target: tiny-llama`) and run every stage: rollouts, training of all three drafters,
evaluation, serving and export (tests/unit/models/test_architectures.py; the README's table).

Only the shape-giving fields are set here; everything that differs between architectures (Gemma's scaled
embedding and GeGLU, Qwen3's q/k norms, the MoE router and experts, Mistral's and Gemma's sliding windows)
comes from the transformers class and its config defaults. A sliding window is set wider than the context,
so the engine, which attends to the whole context, is exact (it also caps its context at a target's window:
dspark.models.target.sliding_window_of).
"""
from __future__ import annotations

from pathlib import Path

import torch

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, rope_theta=10000.0,
             tie_word_embeddings=False, initializer_range=0.8)
ARCHITECTURES: dict[str, tuple[str, dict]] = {  # name -> (transformers model_type, fields beyond SHAPE)
    "llama": ("llama", {}),
    "mistral": ("mistral", {"sliding_window": 4096}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "qwen3-moe": ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                                "decoder_sparse_step": 1, "norm_topk_prob": True}),
    "gemma3": ("gemma3_text", {"sliding_window": 4096, "query_pre_attn_scalar": 16}),
}
NAMES = tuple(f"tiny-{arch}" for arch in ARCHITECTURES)


def tiny_config(arch: str, vocab_size: int):
    from transformers import AutoConfig

    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {sorted(ARCHITECTURES)}")
    model_type, extra = ARCHITECTURES[arch]
    return AutoConfig.for_model(model_type, vocab_size=vocab_size, **SHAPE, **extra)


def build_dir(arch: str, out: Path, tokenizer) -> None:
    """Write `tiny-<arch>` (random weights, seed 0, and `tokenizer`) to `out`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, len(tokenizer)))
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
