"""Frozen-target feature cache (dspark/training/feature_cache.py): the loss from cached features equals
the online loss (up to the bf16 rounding of the cache), builds resume shard by shard, and a cache of
another target/layers is refused."""
import pytest
import torch

from dspark.drafters import DrafterConfig, build_drafter
from dspark.training.feature_cache import build_cache, collate_cached, load_cache
from dspark.training.loss import drafter_loss
from tests.tiny_models import build_tiny_model

V = 16


@pytest.fixture(scope="module")
def target():
    return build_tiny_model(vocab_size=V)


def rows(n=5):
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        length = 6 + 3 * i
        ids = torch.randint(0, V, (length,), generator=g).tolist()
        out.append({"input_ids": ids, "loss_mask": [0, 0, 0] + [1] * (length - 3)})
    return out


def test_cached_loss_equals_online_loss(tmp_path, target):
    torch.manual_seed(0)
    drafter = build_drafter(DrafterConfig(algo="dspark", block_size=3, num_layers=1, num_context_layers=2, rank=8,
                                          anchors_per_seq=64), target)
    data = rows()
    build_cache(target, data, drafter.layer_ids, str(tmp_path), max_len=64, rows_per_shard=2, batch_size=2)
    cache = load_cache(str(tmp_path), target, drafter.layer_ids, 64)
    assert len(cache) == len(data) and cache.input_ids == [r["input_ids"] for r in data]
    batch = collate_cached(cache, [0, 3, 4], target.pad_token_id, target.device)
    args = (batch["input_ids"], batch["loss_mask"], batch["attention_mask"])
    online = drafter_loss(drafter, target, *args, torch.Generator().manual_seed(1))
    cached = drafter_loss(drafter, target, *args, torch.Generator().manual_seed(1), target_out=batch["target_out"])
    assert cached.metrics["n_supervised"] == online.metrics["n_supervised"] > 0
    assert float(cached.loss) == pytest.approx(float(online.loss), rel=2e-2)  # bf16 features, fp32 maths


def test_build_resumes_and_refuses_another_target(tmp_path, target):
    data = rows(4)
    build_cache(target, data, [0, 1], str(tmp_path), max_len=64, rows_per_shard=2)
    shards = sorted(tmp_path.glob("shard-*.pt"))
    assert len(shards) == 2
    stamp = shards[0].stat().st_mtime_ns
    shards[1].unlink()  # a build killed before its second shard
    build_cache(target, data, [0, 1], str(tmp_path), max_len=64, rows_per_shard=2)
    assert shards[0].stat().st_mtime_ns == stamp and shards[1].exists()
    assert len(load_cache(str(tmp_path), target, [0, 1], 64, limit_rows=3)) == 3
    with pytest.raises(ValueError, match="another target/layers"):
        build_cache(target, data, [1, 2], str(tmp_path), max_len=64)
