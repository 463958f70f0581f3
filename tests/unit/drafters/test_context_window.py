"""DrafterConfig.context_window (a sliding window over the target context, dflash / dspark): a block anchored
at t sees only the context t-W .. t-1; the chunked training attention equals the dense windowed mask and scores
no context before its chunk's window; drafting (batch 1 and batched, short and long contexts) gives exactly the
training forward's distributions; the export names the window as speculators does; eagle3 refuses it."""
import json

import pytest
import torch

from dspark.decoding.sampling import SamplingParams
from dspark.drafters import DrafterConfig, build_drafter
from dspark.drafters.anchors import block_layout, packed_mask, sample_anchors
from dspark.drafters.block_attention import BlockLayout, attend_chunks
from tests.tiny_models import build_tiny_model

W = 3


@pytest.fixture(scope="module")
def target():
    return build_tiny_model(vocab_size=16)


def make(target, algo, window=W):
    torch.manual_seed(0)
    return build_drafter(DrafterConfig(algo=algo, rank=8, block_size=4, num_layers=2, context_window=window), target)


def test_a_block_sees_only_the_window_before_its_anchor():
    anchors = torch.tensor([[2, 6]])
    blk, slot = block_layout(2, 1)
    mask = packed_mask(anchors, torch.ones(1, 8, dtype=torch.bool), blk, slot, blk, slot, window=W)[0, 0, :, :8]
    assert mask.int().tolist() == [[1, 1, 0, 0, 0, 0, 0, 0],   # anchor 2: 0, 1 (the window reaches past 0)
                                   [0, 0, 0, 1, 1, 1, 0, 0]]   # anchor 6: 3, 4, 5


@pytest.mark.parametrize("own_keys", [1, 8, 1000])
def test_windowed_chunks_equal_the_dense_windowed_mask(own_keys):
    g = torch.Generator().manual_seed(0)
    B, T, L, H, KV, hd = 2, 60, 4, 4, 2, 8
    ctx_valid = torch.ones(B, T, dtype=torch.long)
    ctx_valid[1, 50:] = 0
    anchors, _ = sample_anchors(torch.ones(B, T, dtype=torch.long), ctx_valid, 9, g)
    N = anchors.shape[1]
    q = torch.randn(B, H, N * L, hd, generator=g)
    ctx_k, ctx_v, blk_k, blk_v = (torch.randn(B, KV, n, hd, generator=g) for n in (T, T, N * L, N * L))
    layout = BlockLayout.build(anchors, ctx_valid, L, L, own_keys_per_chunk=own_keys, window=7)
    got = attend_chunks(q, ctx_k, ctx_v, blk_k, blk_v, layout, enable_gqa=True)
    blk, slot = block_layout(N, L)
    mask = packed_mask(anchors, ctx_valid, blk, slot, blk, slot, window=7)
    k, v = torch.cat([ctx_k, blk_k], -2), torch.cat([ctx_v, blk_v], -2)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(got, want)
    for chunk in layout.chunks:  # no context key before the chunk's earliest window is scored
        assert chunk.start == max(0, int(anchors[:, chunk.first:chunk.end].min()) - 7)


@pytest.mark.parametrize("t", [2, 9])  # a context shorter than the window, and longer
@pytest.mark.parametrize("algo", ["dflash", "dspark"])
def test_windowed_drafting_equals_the_training_forward(target, algo, t):
    drafter = make(target, algo)
    ids = torch.randint(0, 16, (2, 16), generator=torch.Generator().manual_seed(5))
    feats = target.forward(ids, layer_ids=drafter.layer_ids, logits_at=None).features
    states = [drafter.new_state() for _ in range(2)]
    for b, n in enumerate([t, t + 2]):  # batched drafting over contexts of different lengths
        drafter.extend_context(states[b], feats[b, :n], ids[b, :n])
    greedy, sp = SamplingParams(temperature=0), SamplingParams()
    batch = drafter.propose_batch(states, [int(ids[0, t]), int(ids[1, t + 2])], 4, greedy)
    for b, n in enumerate([t, t + 2]):
        assert torch.equal(batch[b].tokens, drafter.propose(states[b], int(ids[b, n]), 4, greedy).tokens)
    single = drafter.propose(states[0], int(ids[0, t]), 4, sp, torch.Generator().manual_seed(1))
    forced = ids[:1].clone()
    forced[0, t + 1:t + 5] = single.tokens
    out = drafter(target.forward(forced, layer_ids=drafter.layer_ids, logits_at=None).features, forced,
                  torch.ones_like(forced, dtype=torch.bool), torch.tensor([[t]]), torch.ones(1, 1, 4, dtype=torch.bool))
    torch.testing.assert_close(torch.softmax(out.logits[:4], -1), single.probs, atol=1e-5, rtol=1e-4)
    if t > W:  # the window matters: the whole-context drafter with the same weights drafts differently
        whole = make(target, algo, window=None)
        whole.load_state_dict(drafter.state_dict())
        other = whole.propose(states[0], int(ids[0, t]), 4, sp, torch.Generator().manual_seed(1))
        assert not torch.allclose(other.probs, single.probs, atol=1e-5)


def test_the_export_names_the_window(target, tmp_path):
    from dspark.export import export_drafter

    export_drafter(make(target, "dflash"), str(tmp_path / "out"), "vllm", verifier="org/tiny")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    layer = config["transformer_layer_config"]
    assert layer["sliding_window"] == W and layer["layer_types"] == ["sliding_attention"] * 2
    assert config["sliding_window_non_causal"] is True  # the block stays bidirectional
    export_drafter(make(target, "dflash", window=None), str(tmp_path / "whole"), "vllm", verifier="org/tiny")
    assert "sliding_window" not in json.loads((tmp_path / "whole" / "config.json").read_text())["transformer_layer_config"]


def test_sglang_export_of_a_windowed_drafter_is_refused_by_name(target, tmp_path):
    from dspark.export import export_drafter
    from dspark.export.vllm import ExportError

    drafter = build_drafter(DrafterConfig(algo="dspark", rank=8, block_size=4, num_layers=2, context_window=W,
                                          mask_token_id=1), target)  # a MASK row SGLang can embed
    with pytest.raises(ExportError, match="context_window=3: SGLang"):
        export_drafter(drafter, str(tmp_path / "sgl"), "sglang", verifier="org/tiny")


def test_eagle3_refuses_a_context_window():
    with pytest.raises(ValueError, match="context_window is a dflash / dspark option"):
        DrafterConfig(algo="eagle3", context_window=64)
