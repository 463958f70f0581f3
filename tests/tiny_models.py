"""Micro targets for the math tests: a random Qwen3 with a tiny vocabulary and no tokenizer, built in
memory (the built-in "tiny" target the jobs load is a saved model with a tokenizer: dspark.models.builtin)."""
from __future__ import annotations

from dspark.models import builtin as models_builtin
from dspark.models.target import Target


def build_tiny_model(vocab_size: int = 16, seed: int = 0, num_layers: int = 4, hidden_size: int = 32,
                     init_std: float = 0.3) -> Target:
    """A micro Qwen3 with no tokenizer, for math tests that want a tiny vocabulary."""
    model = models_builtin.tiny_qwen3(vocab_size=vocab_size, seed=seed, num_layers=num_layers,
                                      hidden_size=hidden_size, init_std=init_std)
    return Target(model, None, name=f"micro-v{vocab_size}-s{seed}", revision="builtin")
