"""Building blocks shared by the drafters: RMSNorm, RoPE, attention with KV injection, SwiGLU MLP,
and a growable per-layer K/V buffer for the inference state.

Attention masks are boolean (True = may attend) and built from indices (see dspark/drafters/anchors.py), so
many anchor blocks of one sequence run as one batch without padding each block to the context; training
attends them chunk by chunk (dspark/drafters/block_attention.py).
Module and parameter names follow the Qwen3 / vLLM draft checkpoints (q_proj, k_norm, mlp.gate_proj,
input_layernorm, ...), which keeps the vLLM export a plain rename table.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dspark.drafters.block_attention import BlockLayout, attend_chunks


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Rotary(nn.Module):
    """Rotary position embedding (rotate-half layout, as Qwen3/Llama); positions may be any LongTensor."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions [..., S] -> (cos, sin) each [..., S, head_dim], float32."""
        freqs = positions.to(self.inv_freq.device).float().unsqueeze(-1) * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, H, S, hd]; cos/sin [B, S, hd] or [S, hd]."""
    if cos.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Attention(nn.Module):
    """Multi-head attention with grouped K/V heads. Queries, keys and values are produced by
    separate calls so a caller can inject extra keys/values (target context) before `attend`."""

    def __init__(self, in_dim: int, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 eps: float, qk_norm: bool):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(in_dim, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(in_dim, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(in_dim, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else None

    def _heads(self, x: Tensor, n: int) -> Tensor:  # [B, S, n*hd] -> [B, n, S, hd]
        return x.view(*x.shape[:-1], n, self.head_dim).transpose(-3, -2)

    def queries(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        q = self._heads(self.q_proj(x), self.num_heads)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return apply_rope(q, cos, sin)

    def keys_values(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        k = self._heads(self.k_proj(x), self.num_kv_heads)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return apply_rope(k, cos, sin), self._heads(self.v_proj(x), self.num_kv_heads)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """q [B, H, Sq, hd], k/v [B, KV, Sk, hd], mask bool [B, 1, Sq, Sk] or None -> [B, Sq, hidden]."""
        return self.project(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.gqa))

    def attend_blocks(self, q: Tensor, ctx_k: Tensor, ctx_v: Tensor, blk_k: Tensor, blk_v: Tensor,
                      layout: BlockLayout) -> Tensor:
        """Packed anchor blocks (training): `attend` over [context ; block keys] with the packed block rule,
        computed chunk by chunk (dspark/drafters/block_attention.py) -> [B, N·Lq, hidden]."""
        return self.project(attend_chunks(q, ctx_k, ctx_v, blk_k, blk_v, layout, self.gqa))

    @property
    def gqa(self) -> bool:
        return self.num_heads != self.num_kv_heads

    def project(self, out: Tensor) -> Tensor:  # [B, H, S, hd] -> o_proj([B, S, H*hd])
        return self.o_proj(out.transpose(-3, -2).reshape(*out.shape[:-3], out.shape[-2], self.num_heads * self.head_dim))


    def attend_diagonal(self, q: Tensor, ctx_k: Tensor, ctx_v: Tensor, ctx_mask: Tensor,
                        own_k: list[Tensor], own_v: list[Tensor]) -> Tensor:
        """Dense training-time test: query n (the block anchored at position n) attends to the context
        keys ctx_mask[b, n] allows and to its OWN block's earlier steps (own_k[i][:, :, n], i = 0..k),
        never to another anchor's steps. Equivalent to `attend` over [ctx ; all blocks' steps] with the
        packed block mask (dspark/drafters/anchors.py), in O(T·(T + k)) scores instead of O(T·(T + T·k)).

        q [B, H, T, hd]; ctx_k/ctx_v [B, KV, T, hd]; ctx_mask bool [B, T, T]; own_k/own_v lists of
        [B, KV, T, hd] -> [B, T, hidden]. Every query sees at least its own step, so no row is empty."""
        rep = self.num_heads // self.num_kv_heads
        heads = (lambda t: t.repeat_interleave(rep, dim=1)) if rep > 1 else (lambda t: t)
        scale = self.head_dim ** -0.5
        s_ctx = (q @ heads(ctx_k).transpose(-1, -2)).float() * scale  # [B, H, T, T]
        s_ctx = s_ctx.masked_fill(~ctx_mask.unsqueeze(1), float("-inf"))
        own_v_all = torch.stack([heads(v) for v in own_v], dim=-2)  # [B, H, T, k+1, hd]
        s_own = (q.unsqueeze(-2) * torch.stack([heads(k) for k in own_k], dim=-2)).sum(-1).float() * scale
        p = torch.softmax(torch.cat([s_ctx, s_own], dim=-1), dim=-1).to(q.dtype)
        T = ctx_k.shape[-2]
        return self.project(p[..., :T] @ heads(ctx_v) + (p[..., T:].unsqueeze(-1) * own_v_all).sum(-2))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class InjectedLayer(nn.Module):
    """DFlash decoder layer with KV injection (paper eq. 2-3).

    Invariant: keys/values = [W_K H_ctx ; W_K h_block] and [W_V H_ctx ; W_V h_block]; queries come only
    from the block. H_ctx (already normed) bypasses input_layernorm, as in the reference DFlash.
    """

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, intermediate: int, eps: float):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = Attention(hidden, hidden, num_heads, num_kv_heads, head_dim, eps, qk_norm=True)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = MLP(hidden, intermediate)

    def context_kv(self, h_ctx: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        return self.self_attn.keys_values(h_ctx, cos, sin)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx_k: Tensor, ctx_v: Tensor,
                mask: Tensor | BlockLayout | None) -> Tensor:
        """mask: a BlockLayout for packed training blocks, else a key mask over [context ; block] or None."""
        h = self.input_layernorm(x)
        q = self.self_attn.queries(h, cos, sin)
        k, v = self.self_attn.keys_values(h, cos, sin)
        if isinstance(mask, BlockLayout):
            x = x + self.self_attn.attend_blocks(q, ctx_k, ctx_v, k, v, mask)
        else:
            k, v = torch.cat([ctx_k, k], dim=-2), torch.cat([ctx_v, v], dim=-2)
            x = x + self.self_attn.attend(q, k, v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class KVBuffer:
    """Per-layer K/V of the verified context, [KV, n, hd] each, grown by doubling (amortised O(1) append).
    Columns past `length` are zeros or stale values, never uninitialised memory: a captured pass reads a whole
    window of them under a mask (dspark.drafters.block_capture), and a masked NaN would still poison it."""

    def __init__(self):
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        self.length = 0

    def append(self, k: Tensor, v: Tensor) -> None:
        n = k.shape[-2]
        if self.k is None:
            cap = max(16, n)
            self.k = k.new_zeros(*k.shape[:-2], cap, k.shape[-1])
            self.v = v.new_zeros(*v.shape[:-2], cap, v.shape[-1])
        elif self.length + n > self.k.shape[-2]:
            cap = max(2 * self.k.shape[-2], self.length + n)
            self.k = _grow(self.k, self.length, cap)
            self.v = _grow(self.v, self.length, cap)
        self.k[..., self.length:self.length + n, :] = k
        self.v[..., self.length:self.length + n, :] = v
        self.length += n

    def reserve(self, columns: int, like: Tensor, chunk: int) -> None:
        """At least `columns` columns, grown to a multiple of `chunk` (zeros past `length`); like [KV, 0, hd]."""
        if self.k is not None and columns <= self.k.shape[-2]:
            return
        cap = -(-columns // chunk) * chunk
        if self.k is None:
            self.k = like.new_zeros(*like.shape[:-2], cap, like.shape[-1])
            self.v = torch.zeros_like(self.k)
        else:
            self.k, self.v = _grow(self.k, self.length, cap), _grow(self.v, self.length, cap)

    def view(self, like: Tensor, last: int | None = None) -> tuple[Tensor, Tensor]:
        """(k, v) [KV, n, hd] (the `last` positions only, when given); empty tensors shaped/typed like
        `like` when nothing is held yet."""
        if self.k is None:
            empty = like.new_empty(*like.shape[:-2], 0, like.shape[-1])
            return empty, empty
        first = max(0, self.length - last) if last else 0
        return self.k[..., first:self.length, :], self.v[..., first:self.length, :]

    def crop(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a drafter state of {self.length} positions to {length}")
        self.length = length


def batch_kv(buffers: list[KVBuffer], like: Tensor, last: int | None = None) -> tuple[Tensor, Tensor]:
    """R per-request contexts (each its `last` positions, when given) as one right-padded batch (k, v)
    [R, KV, N, hd], N = the longest; columns past a request's context are zeros that `padding_mask` hides
    from attention. `like` [KV, 0, hd] gives the shape/dtype of an empty context. One request: a view."""
    if len(buffers) == 1:
        k, v = buffers[0].view(like, last)
        return k.unsqueeze(0), v.unsqueeze(0)
    views = [buf.view(like, last) for buf in buffers]
    n = max(k.shape[-2] for k, _ in views)
    k = like.new_zeros(len(buffers), *like.shape[:-2], n, like.shape[-1])
    v = torch.zeros_like(k)
    for r, (held_k, held_v) in enumerate(views):
        k[r, ..., :held_k.shape[-2], :], v[r, ..., :held_v.shape[-2], :] = held_k, held_v
    return k, v


def padding_mask(lengths: list[int], extra: int, device=None) -> Tensor | None:
    """Key mask bool [R, 1, 1, N + extra] (True = may attend) for `batch_kv` contexts followed by
    `extra` keys every query may see; None when no request is padded (every length is N)."""
    n = max(lengths, default=0)
    if all(length == n for length in lengths):
        return None
    ctx = torch.arange(n, device=device) < torch.tensor(lengths, device=device).unsqueeze(-1)  # [R, N]
    mask = torch.cat([ctx, ctx.new_ones(len(lengths), extra)], dim=-1)
    return mask[:, None, None, :]


def _grow(buf: Tensor, used: int, cap: int) -> Tensor:
    new = buf.new_zeros(*buf.shape[:-2], cap, buf.shape[-1])
    new[..., :used, :] = buf[..., :used, :]
    return new


def init_weights(module: nn.Module, std: float) -> None:
    """Normal(0, std) for every linear/embedding weight, zero biases; norms keep their ones."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=std)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
