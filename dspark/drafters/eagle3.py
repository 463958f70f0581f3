"""Eagle3: a one-layer autoregressive drafter with training-time test (DESIGN §3 baseline).

Entry at position j: x_j = [RMSNorm(emb(x_j)) ; RMSNorm(g_{j-1})], residual = RMSNorm(g_{j-1}), where
g_{j-1} is the fused target feature W_f·concat(f_{j-1}) (zeros for j = 0) for verified positions, or
the drafter's own previous output (pre-norm) when unrolled. One decoder layer with causal attention
over its own entries; logits = LM_head(RMSNorm(g_j)) predict token j+1.

Drafting from anchor x_n: step 1 uses (x_n, fused f_{n-1}); step k uses (x̂_{k-1}, g of step k-1);
each step attends to the cached context entries 0..n-1 and the block's earlier steps. Cost grows
linearly with γ; many requests step together (one layer pass per position for all of them).
Training (TTT) unrolls `ttt_steps` such steps from every sampled anchor with the tokens
teacher-forced, each step attending to the context strictly before the anchor plus the block's
earlier steps: exactly what inference sees. With `dense_ttt` every position of the sequence is an
anchor (the reference recipe); that path keeps one query per position and step and attends to the
block's own earlier steps through a diagonal (Attention.attend_diagonal), so its cost is that of
ttt_steps causal passes over the sequence rather than of T packed blocks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dspark.drafters import block_capture, chain_capture, eagle3_capture
from dspark.drafters.anchors import is_dense
from dspark.drafters.base import (BlockDraws, DraftProposal, DraftState, DraftTrainOut, Drafter, RowSampling,
                                  split_proposals)
from dspark.drafters.block_attention import BlockLayout
from dspark.drafters.config import DrafterConfig
from dspark.drafters.layers import MLP, Attention, RMSNorm, batch_kv, init_weights, padding_mask
from dspark.decoding.sampling import Generators


class Eagle3Layer(nn.Module):
    """Llama-style Eagle3 mid layer: qkv from the 2d input, norm before residual, SwiGLU MLP."""

    def __init__(self, d: int, num_heads: int, num_kv_heads: int, head_dim: int, intermediate: int, eps: float):
        super().__init__()
        self.input_layernorm = RMSNorm(d, eps)
        self.hidden_norm = RMSNorm(d, eps)
        self.self_attn = Attention(2 * d, d, num_heads, num_kv_heads, head_dim, eps, qk_norm=False)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.mlp = MLP(d, intermediate)

    def inputs(self, emb: Tensor, hidden: Tensor) -> tuple[Tensor, Tensor]:
        residual = self.hidden_norm(hidden)
        return torch.cat([self.input_layernorm(emb), residual], dim=-1), residual

    def forward(self, x: Tensor, residual: Tensor, cos: Tensor, sin: Tensor, k: Tensor, v: Tensor,
                mask: Tensor | None) -> Tensor:
        return self.finish(residual, self.self_attn.attend(self.self_attn.queries(x, cos, sin), k, v, mask))

    def finish(self, residual: Tensor, attn_out: Tensor) -> Tensor:
        r = residual + attn_out
        return r + self.mlp(self.post_attention_layernorm(r))


class Eagle3Drafter(Drafter):
    algo = "eagle3"

    def __init__(self, config: DrafterConfig, target_meta: dict):
        super().__init__(config, target_meta)
        d, c = self.hidden_size, config
        self.fc = nn.Linear(c.num_context_layers * d, d, bias=False)
        self.midlayer = Eagle3Layer(d, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.rms_norm_eps)
        self.norm = RMSNorm(d, c.rms_norm_eps)
        init_weights(self, c.init_std)

    @property
    def slots_per_anchor(self) -> int:
        return self.config.ttt_steps  # the unrolled training-time-test steps

    @property
    def trains_every_position(self) -> bool:
        return self.config.dense_ttt

    def fused(self, features: Tensor) -> Tensor:
        return self.fc(features.to(self.device, self.dtype))

    def fused_before(self, state: DraftState) -> Tensor:
        """The fused feature [d] of the state's last verified position: f_{-1} = 0 for an empty context, as in
        training."""
        if state.last_fused is not None:
            return state.last_fused
        return torch.zeros(self.hidden_size, device=self.device, dtype=self.dtype)

    # ---- training (TTT) -------------------------------------------------------------------
    def forward(self, features: Tensor, input_ids: Tensor, ctx_valid: Tensor, anchors: Tensor,
                select: Tensor) -> DraftTrainOut:
        """Same contract as DFlashDrafter.forward with K = ttt_steps predictions per anchor."""
        B, T = input_ids.shape
        if anchors.shape[1] == T and is_dense(anchors):
            return self._forward_dense(features, input_ids, ctx_valid, select)
        K, layer = select.shape[2], self.midlayer
        prev_feat = F.pad(self.fused(features)[:, :-1], (0, 0, 1, 0))  # entry j uses f_{j-1}; f_{-1} = 0
        x_ctx, _ = layer.inputs(self.embed(input_ids), prev_feat)
        ctx_k, ctx_v = layer.self_attn.keys_values(x_ctx, *self.rotary(torch.arange(T, device=self.device)))
        hidden = prev_feat.gather(1, anchors.unsqueeze(-1).expand(-1, -1, prev_feat.shape[-1]))  # f_{t-1}
        own_k, own_v, outs = [], [], []
        for k in range(K):  # step k+1 sits at position t+k with token x_{t+k} (teacher-forced)
            pos = anchors + k
            x, res = layer.inputs(self.embed(input_ids.gather(1, pos.clamp(max=T - 1))), hidden)
            cos, sin = self.rotary(pos)
            kk, vv = layer.self_attn.keys_values(x, cos, sin)
            own_k.append(kk)
            own_v.append(vv)
            # block keys block-major: anchor n's steps 0..k at n·(k+1) .. n·(k+1)+k (all visible to its step k)
            blk_k, blk_v = (torch.stack(t, dim=-2).flatten(-3, -2) for t in (own_k, own_v))
            layout = BlockLayout.build(anchors, ctx_valid, q_per_block=1, k_per_block=k + 1)
            out = layer.self_attn.attend_blocks(layer.self_attn.queries(x, cos, sin), ctx_k, ctx_v, blk_k, blk_v, layout)
            hidden = layer.finish(res, out)
            outs.append(self.norm(hidden))
        h = torch.stack(outs, dim=2)  # [B, N, K, d]
        return DraftTrainOut(logits=self.lm_logits(h[select]), conf_logits=None)

    def _forward_dense(self, features: Tensor, input_ids: Tensor, ctx_valid: Tensor, select: Tensor) -> DraftTrainOut:
        """TTT from every position n (anchors = 0..T-1, dspark.drafters.anchors.all_anchors): step k+1 of anchor n
        sits at position n+k with token x_{n+k}, attends to context positions < n and to anchor n's own
        steps 0..k. Same values as the packed path with every position drawn as an anchor."""
        T, K, layer, attn = input_ids.shape[1], select.shape[2], self.midlayer, self.midlayer.self_attn
        prev_feat = F.pad(self.fused(features)[:, :-1], (0, 0, 1, 0))  # entry j uses f_{j-1}; f_{-1} = 0
        x_ctx, _ = layer.inputs(self.embed(input_ids), prev_feat)
        positions = torch.arange(T, device=self.device)
        ctx_k, ctx_v = attn.keys_values(x_ctx, *self.rotary(positions))
        ctx_mask = (positions.unsqueeze(0) < positions.unsqueeze(-1)).unsqueeze(0) & ctx_valid.bool().unsqueeze(1)
        hidden, own_k, own_v, outs = prev_feat, [], [], []  # anchor n's step 1 carries f_{n-1}
        for k in range(K):
            pos = positions + k
            x, res = layer.inputs(self.embed(input_ids[:, pos.clamp(max=T - 1)]), hidden)
            cos, sin = self.rotary(pos)
            kk, vv = attn.keys_values(x, cos, sin)
            own_k.append(kk)
            own_v.append(vv)
            out = attn.attend_diagonal(attn.queries(x, cos, sin), ctx_k, ctx_v, ctx_mask, own_k, own_v)
            hidden = layer.finish(res, out)
            outs.append(self.norm(hidden))
        h = torch.stack(outs, dim=2)  # [B, T, K, d]
        return DraftTrainOut(logits=self.lm_logits(h[select]), conf_logits=None)

    # ---- inference ------------------------------------------------------------------------
    @torch.no_grad()
    def extend_context(self, state: DraftState, features: Tensor, token_ids: Tensor) -> None:
        self._check_features(features, token_ids)
        n = features.shape[0]
        if n == 0:
            return
        if n <= block_capture.MAX_NEW and chain_capture.wanted(self, [state], "block"):
            return eagle3_capture.extend_captured(self, [state], [features], [token_ids])
        fused = self.fused(features)
        prev = torch.cat([self.fused_before(state).unsqueeze(0), fused[:-1]], dim=0)
        x, _ = self.midlayer.inputs(self.embed(token_ids.to(self.device)), prev)
        positions = torch.arange(state.length, state.length + n, device=self.device)
        k, v = self.midlayer.self_attn.keys_values(x.unsqueeze(0), *self.rotary(positions))
        state.kv[0].append(k[0], v[0])
        state.last_fused = fused[-1]
        state.length += n

    @torch.no_grad()
    def extend_contexts(self, states: list[DraftState], features: list[Tensor], token_ids: list[Tensor]) -> None:
        """extend_context of every request; on a compiled core the short updates in ONE captured pass."""
        short = [r for r, f in enumerate(features) if 0 < f.shape[0] <= block_capture.MAX_NEW]
        if len(short) > 1 and chain_capture.wanted(self, states, "block"):
            for r in short:
                self._check_features(features[r], token_ids[r])
            eagle3_capture.extend_captured(self, *([seq[r] for r in short] for seq in (states, features, token_ids)))
            states, features, token_ids = ([seq[r] for r in range(len(seq)) if r not in short]
                                           for seq in (states, features, token_ids))
        super().extend_contexts(states, features, token_ids)

    def draft_batch(self, states: list[DraftState], anchors: Tensor, gammas: list[int], rows: RowSampling,
                    generator: Generators) -> list[DraftProposal]:
        """Autoregressive, each step one layer pass for all R requests (`draft_steps`); on a compiled core the
        captured steps (`eagle3_capture`)."""
        draws = BlockDraws(generator, gammas, self.device)
        if rows.single and chain_capture.capturable(draws) and chain_capture.wanted(self, states, "block"):
            tokens, probs = eagle3_capture.draft_captured(self, states, anchors, draws, rows.sps[0])
            return split_proposals(tokens, self.full_vocab_probs(probs), None, gammas)
        c = self.config
        hidden = torch.stack([self.fused_before(s) for s in states]).unsqueeze(1)
        lengths = [s.length for s in states]
        ctx_k, ctx_v = batch_kv([s.kv[0] for s in states], hidden.new_empty(c.num_kv_heads, 0, c.head_dim))
        visible = padding_mask(lengths, 0, self.device)  # [R, 1, 1, N] or None (no request padded)
        tokens, probs = self.draft_steps(ctx_k, ctx_v, None if visible is None else visible[:, 0, 0], hidden, anchors,
                                         torch.tensor(lengths, device=self.device).unsqueeze(-1), max(gammas),
                                         rows.probs, draws.draw)
        return split_proposals(tokens, self.full_vocab_probs(probs), None, gammas)

    def draft_steps(self, ctx_k: Tensor, ctx_v: Tensor, visible: Tensor | None, hidden: Tensor, anchors: Tensor,
                    starts: Tensor, width: int, probs_of, draw) -> tuple[Tensor, Tensor]:
        """The γ-loop: ctx_k/ctx_v [R, KV, C, hd] the requests' context entries, visible [R, C] bool those each may
        see (None: all), hidden [R, 1, d] the fused feature before the anchor, anchors [R], starts [R, 1] the
        anchors' positions; step k sits at starts + k and attends to the visible context and steps 0..k (causal by
        construction: no later step exists yet). probs_of(logits [R, N]) -> probs; draw(probs [R, N], k) -> (rows
        drawn, draft ids). -> tokens [R, width] (target ids), probs [R, width, N]. Tensors only between steps (no
        host reads), so with every draw made before the loop torch.compile captures it whole (`eagle3_capture`)."""
        layer, rows = self.midlayer, anchors.shape[0]
        tokens = torch.zeros(rows, width, dtype=torch.long, device=anchors.device)
        probs = torch.empty(rows, width, self.draft_vocab_size, dtype=torch.float32, device=anchors.device)
        keys, values, tok = [ctx_k], [ctx_v], anchors
        for k in range(width):
            x, res = layer.inputs(self.embed(tok.unsqueeze(-1)), hidden)  # [R, 1, 2d], [R, 1, d]
            cos, sin = self.rotary(starts + k)
            kk, vv = layer.self_attn.keys_values(x, cos, sin)
            keys.append(kk)
            values.append(vv)
            mask = None if visible is None else torch.cat([visible, visible.new_ones(rows, k + 1)], -1)[:, None, None]
            g = layer(x, res, cos, sin, torch.cat(keys, -2), torch.cat(values, -2), mask)
            probs[:, k] = probs_of(self.lm_logits(self.norm(g))[:, 0])
            live, drawn = draw(probs[:, k], k)
            tokens[live, k] = self.to_target_ids(drawn)
            tok, hidden = tokens[:, k], g
        return tokens, probs
