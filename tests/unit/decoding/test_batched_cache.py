"""grouped_sdpa: the ragged forward's attention without repeat_kv equals attention over repeated KV heads."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dspark.decoding.batched_cache import grouped_sdpa


@pytest.mark.parametrize("heads,kv_heads,n", [(9, 3, 1), (9, 3, 5), (4, 4, 3)])
def test_grouped_sdpa_equals_attention_over_repeated_kv_heads(heads, kv_heads, n):
    g = torch.Generator().manual_seed(0)
    rows, length, dim = 3, 11, 8
    q = torch.randn(rows, heads, n, dim, generator=g)
    k, v = (torch.randn(rows, kv_heads, length, dim, generator=g) for _ in range(2))
    starts = torch.tensor([2, 5, 6])  # row r, query i sees keys 0..start_r + i (the ragged causal mask)
    mask = (torch.arange(length)[None, None, :] <= (starts[:, None] + torch.arange(n)[None, :])[..., None])[:, None]
    rep = heads // kv_heads
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                          attn_mask=mask, scale=0.3).transpose(1, 2)
    got = grouped_sdpa(q, k, v, mask, 0.3)
    assert got.shape == (rows, n, heads, dim)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
