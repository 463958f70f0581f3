"""Micro targets shared by the engine tests (test_tree_specdec keeps its own 6-token one)."""
from __future__ import annotations

import pytest

from tests.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def micro_target():
    """8 tokens, gentle logits: small enough for χ² against the exact joint of a few tokens."""
    return build_tiny_model(vocab_size=8, seed=0, num_layers=3, hidden_size=32, init_std=0.3)


@pytest.fixture(scope="module")
def wide_target():
    """64 tokens, sharper logits: for greedy, seeded and batching checks."""
    return build_tiny_model(vocab_size=64, seed=1, num_layers=3, hidden_size=32, init_std=0.8)
