"""The static-shape decoding core (dspark.decoding.static_core): eager and compiled steps decode exactly
as HF `generate` greedily, and a crop drops rejected columns (the stale-column invariant)."""
import pytest
import torch

from dspark.decoding.static_core import CoreSequence, DecodeCore, window_bucket
from dspark.models.target import load_target


@pytest.fixture(scope="module")
def target():
    return load_target("tiny", dtype=torch.float32)


def _greedy(core: DecodeCore, ids: list[int], n: int) -> list[int]:
    seq = CoreSequence(core)
    tok = int(seq.extend(ids, logits="last").logits[0, -1].argmax())
    out = [tok]
    for _ in range(n - 1):
        tok = int(seq.extend([tok], logits="last").logits[0, -1].argmax())
        out.append(tok)
    return out


def _hf_greedy(target, ids: list[int], n: int) -> list[int]:
    out = target.model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def test_window_bucket():
    assert window_bucket(1, 1024) == 128 and window_bucket(129, 1024) == 256 and window_bucket(900, 1024) == 1024


def test_eager_static_core_equals_hf_greedy(target):
    ids = target.tokenizer("The quick brown fox", add_special_tokens=False)["input_ids"]
    assert _greedy(DecodeCore(target, mode="eager"), ids, 16) == _hf_greedy(target, ids, 16)


def test_static_cache_crop_drops_rejected_columns(target):
    """Verify-like step: append 4 drafts, keep 1 (crop), continue: same logits as never having drafted."""
    ids = target.tokenizer("Hello world, this is", add_special_tokens=False)["input_ids"]
    core = DecodeCore(target, mode="eager")
    seq = CoreSequence(core)
    seq.extend(ids)
    seq.extend([5, 6, 7, 8])
    seq.crop(len(ids) + 1)
    after = seq.extend([9], logits="last").logits[0, -1]
    fresh = CoreSequence(DecodeCore(target, mode="eager"))
    fresh.extend(ids + [5])
    ref = fresh.extend([9], logits="last").logits[0, -1]
    torch.testing.assert_close(after, ref, rtol=1e-4, atol=1e-4)


def _doubled(x):
    return x * 2


def test_a_full_graph_cache_is_named_with_its_graph_count():
    """Dynamo runs a shape bucket past a function's graph limit eager and raises nothing: full_graph_caches is
    where that shows (recipe.json's graph_caches_full, the engine's stats)."""
    from torch._dynamo import config as dynamo_config

    from dspark.decoding.static_core import compile_static, full_graph_caches

    name = f"{__name__}._doubled"
    step = compile_static(_doubled, torch.device("cpu"), backend="eager")
    with dynamo_config.patch(recompile_limit=3):
        for n in (1, 2):
            assert step(torch.ones(n)).tolist() == [2.0] * n
        assert name not in full_graph_caches()  # 2 graphs of 3
        for n in (3, 4, 5):  # the 4th and 5th buckets get no graph: eager, same result
            assert step(torch.ones(n)).tolist() == [2.0] * n
        assert full_graph_caches()[name] == 3


def test_a_compiled_core_holds_a_graph_for_every_bucket_it_can_meet(target):
    """The engine's default store (32 slots, 2,048 positions) can meet 6 row counts x 7 token buckets x 2 layouts
    (chains, trees) x 15 (window, capacity) pairs (capacities 1,024, 2,048 and 3,072: 4 + 5 + 6 windows): dynamo's
    per-function graph cache (8 by default, 64 before) is raised to hold them all, so no bucket of a long-running
    server falls back to eager for want of room."""
    from torch._dynamo import config as dynamo_config

    from dspark.decoding.static_core import CoreSlots, graph_grid

    assert graph_grid(32, 2048) == 6 * 7 * 2 * 15 and graph_grid(6, 1000) == 4 * 7 * 2 * (4 + 5)
    with dynamo_config.patch(recompile_limit=8, accumulated_recompile_limit=256):  # (monkeypatch would delete them)
        CoreSlots(target, 32, "compiled", 2048).core._compiled_step()
        assert dynamo_config.recompile_limit == 1260 and dynamo_config.accumulated_recompile_limit == 1260 + 256
