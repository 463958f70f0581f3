"""Chunked attention of packed anchor blocks == the dense packed-mask form, values and gradients."""
import pytest
import torch

from dspark.drafters.anchors import block_mask, packed_mask, sample_anchors
from dspark.drafters.block_attention import BlockLayout, attend_chunks
from dspark.drafters.layers import Attention


def _dense(q, ctx_k, ctx_v, blk_k, blk_v, mask, gqa):
    k, v = torch.cat([ctx_k, blk_k], -2), torch.cat([ctx_v, blk_v], -2)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def _anchors(B=3, T=40, n=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    loss_mask = torch.ones(B, T, dtype=torch.long)
    attention = torch.ones(B, T, dtype=torch.long)
    attention[1, 30:] = 0  # a right-padded row: fewer anchors, padded slots (valid False, anchor 0)
    loss_mask[2, :25] = 0  # a row whose anchors all sit late
    anchors, _ = sample_anchors(loss_mask, attention, n, g)
    return anchors, attention


@pytest.mark.parametrize("own_keys", [1, 8, 1000])  # one block per chunk, a few, one chunk
def test_dflash_blocks_equal_the_dense_mask(own_keys):
    anchors, ctx_valid = _anchors()
    B, N, L, T = anchors.shape[0], anchors.shape[1], 4, ctx_valid.shape[1]
    H, KV, hd = 4, 2, 8
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, H, N * L, hd, generator=g, requires_grad=True)
    ctx_k, ctx_v, blk_k, blk_v = (torch.randn(B, KV, n, hd, generator=g, requires_grad=True)
                                  for n in (T, T, N * L, N * L))
    layout = BlockLayout.build(anchors, ctx_valid, L, L, own_keys_per_chunk=own_keys)
    assert len(layout.chunks) == (N if own_keys == 1 else 1 if own_keys == 1000 else N // 2 + N % 2)
    got = attend_chunks(q, ctx_k, ctx_v, blk_k, blk_v, layout, enable_gqa=True)
    want = _dense(q, ctx_k, ctx_v, blk_k, blk_v, block_mask(anchors, ctx_valid, L), True)
    torch.testing.assert_close(got, want)
    grads = torch.autograd.grad(got.square().sum(), (q, ctx_k, blk_v))
    want_grads = torch.autograd.grad(want.square().sum(), (q, ctx_k, blk_v))
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b)
    # a chunk never scores context past its last anchor
    for chunk in layout.chunks:
        assert chunk.context == int(anchors[:, chunk.first:chunk.end].max())


def test_eagle3_step_blocks_equal_the_dense_mask():
    """One query per block (step k), k+1 keys per block laid out block-major vs the step-major dense form."""
    anchors, ctx_valid = _anchors(seed=3)
    B, N, T, k = anchors.shape[0], anchors.shape[1], ctx_valid.shape[1], 2
    attn = Attention(16, 16, 2, 1, 8, 1e-6, qk_norm=False)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(B, 2, N, 8, generator=g)
    ctx_k, ctx_v = torch.randn(B, 1, T, 8, generator=g), torch.randn(B, 1, T, 8, generator=g)
    steps_k = [torch.randn(B, 1, N, 8, generator=g) for _ in range(k + 1)]
    steps_v = [torch.randn(B, 1, N, 8, generator=g) for _ in range(k + 1)]
    blk_k, blk_v = (torch.stack(t, -2).flatten(-3, -2) for t in (steps_k, steps_v))
    got = attn.attend_blocks(q, ctx_k, ctx_v, blk_k, blk_v,
                             BlockLayout.build(anchors, ctx_valid, 1, k + 1, own_keys_per_chunk=6))
    q_block = torch.arange(N)
    mask = packed_mask(anchors, ctx_valid, q_block, torch.full_like(q_block, k), q_block.repeat(k + 1),
                       torch.arange(k + 1).repeat_interleave(N), causal=True)
    want = attn.attend(q, torch.cat([ctx_k, *steps_k], -2), torch.cat([ctx_v, *steps_v], -2), mask)
    torch.testing.assert_close(got, want)
