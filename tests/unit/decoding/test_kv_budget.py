"""dspark/decoding/kv_budget.py: the KV bytes of a batch follow the target's shape, and long generations that would
not fit the device are refused before the first token, naming the knobs and how many rows would fit."""
import pytest

from dspark.decoding import kv_budget
from dspark.decoding.generator import BatchGenerator, GeneratorConfig
from dspark.decoding.sampling import SamplingParams
from tests.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def target():
    return build_tiny_model(vocab_size=16, num_layers=4, hidden_size=32)


def test_kv_bytes_follow_the_targets_shape(target):
    cfg = target.model.config
    per_token = kv_budget.kv_bytes_per_token(target)
    assert per_token == 4 * 2 * cfg.num_key_value_heads * cfg.head_dim * 4  # layers · (k, v) · heads · dim · fp32
    assert kv_budget.check_kv_fits(target, rows=8, tokens=100, free=1 << 30) == 8 * 100 * per_token


def test_long_generations_that_do_not_fit_are_refused_up_front(target, monkeypatch):
    per_token = kv_budget.kv_bytes_per_token(target)
    with pytest.raises(ValueError, match=r"64 sequences of up to 8192 tokens .* 12 rows fit"):
        kv_budget.check_kv_fits(target, rows=64, tokens=8192, free=int(12.5 * 8192 * per_token / 0.8))
    monkeypatch.setattr(kv_budget, "free_bytes", lambda device: 100 * per_token)
    generator = BatchGenerator(target, GeneratorConfig(max_batch=4))
    with pytest.raises(ValueError, match=r"KV store for 4 sequences of up to 1503 tokens.*max_new_tokens"):
        generator.generate([[1, 2, 3]] * 4, SamplingParams(temperature=1.0), [0, 1, 2, 3], max_new_tokens=1500)
    assert generator.stats.steps == 0  # refused before any work
    out = generator.generate([[1, 2, 3]], SamplingParams(temperature=1.0), [0], max_new_tokens=4)  # this one fits
    assert len(out) == 1 and len(out[0][0]) <= 4
