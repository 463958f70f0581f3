"""DFlash: a parallel block drafter with KV injection (paper eq. 2-3; DESIGN §3).

Block for anchor t = [emb(x_t), MASK, ..., MASK] (γ+1 inputs at positions t..t+γ). In every layer the
block's queries attend over [W_K H_ctx(0..t-1) ; W_K h_block] (bidirectional inside the block), with
H_ctx = RMSNorm(W_c [f_{l1}; ...; f_{lm}]) the fused target features. One forward pass gives logits
for the γ MASK slots; slot j predicts token t+j.

Training packs all anchor blocks of a sequence into one dense batch (dspark/drafters/anchors.py); inference
caches W_K H_ctx / W_V H_ctx per layer in the state and appends only newly verified positions, and
drafts the blocks of many requests in one backbone pass (contexts right-padded, padding masked).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from dspark.drafters.anchors import block_positions
from dspark.drafters import block_capture, chain_capture
from dspark.drafters.base import (DraftProposal, DraftState, DraftTrainOut, Drafter, RowSampling, drafted_entries,
                                  split_proposals)
from dspark.drafters.block_attention import BlockLayout
from dspark.drafters.config import DrafterConfig
from dspark.drafters.layers import InjectedLayer, RMSNorm, batch_kv, init_weights, padding_mask
from dspark.decoding.sampling import Generators, rows_generators, sample


class DFlashDrafter(Drafter):
    algo = "dflash"

    def __init__(self, config: DrafterConfig, target_meta: dict):
        super().__init__(config, target_meta)
        d, c = self.hidden_size, config
        self.fc = nn.Linear(c.num_context_layers * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, c.rms_norm_eps)
        self.layers = nn.ModuleList(
            InjectedLayer(d, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.rms_norm_eps)
            for _ in range(c.num_layers))
        self.norm = RMSNorm(d, c.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(d)) if c.mask_token_id is None else None
        init_weights(self, c.init_std)
        if self.mask_embedding is not None:
            nn.init.normal_(self.mask_embedding, std=c.init_std)

    # ---- block geometry (DSpark overrides) ------------------------------------------------
    @property
    def block_len(self) -> int:
        return self.config.block_size + 1  # anchor + γ masks

    @property
    def context_params_per_token(self) -> int:
        """fc, then every layer's K/V projection of the context states (queries, MLPs: block slots only)."""
        kv = sum(p.numel() for layer in self.layers for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj)
                 for p in proj.parameters() if p.requires_grad)
        return super().context_params_per_token + kv

    @property
    def first_pred_slot(self) -> int:
        return 1  # slot j >= 1 predicts token t+j

    # ---- shared math ----------------------------------------------------------------------
    def context_states(self, features: Tensor) -> Tensor:
        """H_ctx = RMSNorm(W_c · concat(target layer states)): [..., m*d] -> [..., d]."""
        return self.hidden_norm(self.fc(features.to(self.device, self.dtype)))

    def mask_vector(self) -> Tensor:
        if self.mask_embedding is not None:
            return self.mask_embedding
        return self.embed(torch.tensor([self.config.mask_token_id], device=self.device))[0]

    def block_inputs(self, anchor_tokens: Tensor) -> Tensor:
        """anchor_tokens [...] -> block input embeddings [..., L, d] = [emb(anchor), MASK, ...]."""
        first = self.embed(anchor_tokens).unsqueeze(-2)
        masks = self.mask_vector().expand(*anchor_tokens.shape, self.block_len - 1, self.hidden_size)
        return torch.cat([first, masks], dim=-2)

    def context_kv(self, h_ctx: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        cos, sin = self.rotary(positions)
        return [layer.context_kv(h_ctx, cos, sin) for layer in self.layers]

    def run_blocks(self, x: Tensor, positions: Tensor, ctx_kv: list[tuple[Tensor, Tensor]],
                   mask: Tensor | BlockLayout | None) -> Tensor:
        cos, sin = self.rotary(positions)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            x = layer(x, cos, sin, k, v, mask)
        return self.norm(x)

    # ---- training -------------------------------------------------------------------------
    def forward(self, features: Tensor, input_ids: Tensor, ctx_valid: Tensor, anchors: Tensor,
                select: Tensor) -> DraftTrainOut:
        """features [B,T,m*d], input_ids [B,T], ctx_valid [B,T], anchors [B,N], select bool [B,N,γ]
        -> logits at the selected (anchor, k) pairs; prediction k of anchor t is for token t+k."""
        B, T = input_ids.shape
        N, L, gamma = anchors.shape[1], self.block_len, self.config.block_size
        kv = self.context_kv(self.context_states(features), torch.arange(T, device=self.device))
        x = self.block_inputs(input_ids.gather(1, anchors)).flatten(1, 2)  # [B, N*L, d]
        h = self.run_blocks(x, block_positions(anchors, L), kv,
                           BlockLayout.build(anchors, ctx_valid, L, L, window=self.config.context_window))
        h = h.view(B, N, L, -1)[:, :, self.first_pred_slot:self.first_pred_slot + gamma]
        return self.predict_train(h, input_ids, anchors, select)

    def predict_train(self, h: Tensor, input_ids: Tensor, anchors: Tensor, select: Tensor) -> DraftTrainOut:
        return DraftTrainOut(logits=self.lm_logits(h[select]), conf_logits=None)

    # ---- inference ------------------------------------------------------------------------
    @torch.no_grad()
    def extend_context(self, state: DraftState, features: Tensor, token_ids: Tensor) -> None:
        self._check_features(features, token_ids)
        n = features.shape[0]
        if n == 0:
            return
        if n <= block_capture.MAX_NEW and chain_capture.wanted(self, [state], "block"):
            return block_capture.extend(self, [state], [features])
        positions = torch.arange(state.length, state.length + n, device=self.device)
        for (k, v), buf in zip(self.context_kv(self.context_states(features).unsqueeze(0), positions), state.kv):
            buf.append(k[0], v[0])
        state.length += n

    @torch.no_grad()
    def extend_contexts(self, states: list[DraftState], features: list[Tensor], token_ids: list[Tensor]) -> None:
        """extend_context of R requests in ONE pass: the context projection works per position, so the
        new positions of all requests are stacked (each with its own RoPE position) and split after."""
        for f, ids in zip(features, token_ids, strict=True):
            self._check_features(f, ids)
        counts = [int(f.shape[0]) for f in features]
        if len(states) != len(counts):
            raise ValueError(f"extend_contexts got {len(states)} states but {len(counts)} feature blocks")
        if chain_capture.wanted(self, states, "block"):  # the short updates through the captured pass, together
            short = [r for r, n in enumerate(counts) if 0 < n <= block_capture.MAX_NEW]
            if short:
                block_capture.extend(self, [states[r] for r in short], [features[r] for r in short])
            long = [r for r, n in enumerate(counts) if n > block_capture.MAX_NEW]  # prompts: eager, below
            states, features, counts = [states[r] for r in long], [features[r] for r in long], [counts[r] for r in long]
        if sum(counts) == 0:
            return
        positions = torch.cat([torch.arange(s.length, s.length + n, device=self.device) for s, n in zip(states, counts)])
        kv = self.context_kv(self.context_states(torch.cat(features)).unsqueeze(0), positions)
        at = 0
        for state, n in zip(states, counts):
            for (k, v), buf in zip(kv, state.kv):
                if n:
                    buf.append(k[0, :, at:at + n], v[0, :, at:at + n])
            state.length += n
            at += n

    @torch.no_grad()
    def block_hidden(self, state: DraftState, anchor: int) -> Tensor:
        """Final-normed hidden states [L, d] of ONE block anchored at position state.length, computed
        without padding: the single-request reference for `blocks_hidden` (tests, analysis)."""
        x = self.block_inputs(torch.tensor([anchor], device=self.device))  # [1, L, d]
        positions = torch.arange(state.length, state.length + self.block_len, device=self.device)
        c = self.config
        empty = x.new_empty(c.num_kv_heads, 0, c.head_dim)
        ctx = [tuple(t.unsqueeze(0) for t in buf.view(empty, c.context_window)) for buf in state.kv]
        return self.run_blocks(x, positions, ctx, None)[0]  # no mask: all held context (window) precedes the anchor

    @torch.no_grad()
    def blocks_hidden(self, states: list[DraftState], anchors: Tensor) -> Tensor:
        """Final-normed hidden states [R, L, d] of R blocks in ONE backbone pass; block r is anchored at
        position states[r].length (its own RoPE positions) and attends to its own cached context only.

        Invariant: row r equals block_hidden(states[r], anchors[r]): the contexts (their last
        context_window positions, with a window) are right-padded to the longest and the padded key
        columns are masked out of every query row."""
        if chain_capture.wanted(self, states, "block"):  # the captured pass (the same hidden states)
            return block_capture.hidden(self, states, anchors)
        c, L, window = self.config, self.block_len, self.config.context_window
        x = self.block_inputs(anchors)  # [R, L, d]
        lengths = [s.length for s in states]
        positions = torch.tensor(lengths, device=self.device).unsqueeze(-1) + torch.arange(L, device=self.device)
        empty = x.new_empty(c.num_kv_heads, 0, c.head_dim)
        ctx = [batch_kv([s.kv[i] for s in states], empty, window) for i in range(len(self.layers))]
        held = [min(n, window) if window else n for n in lengths]
        return self.run_blocks(x, positions, ctx, padding_mask(held, L, self.device))

    def draft_batch(self, states: list[DraftState], anchors: Tensor, gammas: list[int], rows: RowSampling,
                    generator: Generators) -> list[DraftProposal]:
        first = self.first_pred_slot
        h = self.blocks_hidden(states, anchors)[:, first:first + max(gammas)]  # [R, G, d]
        return self.sample_blocks(h, anchors, gammas, rows, generator, states)

    def sample_blocks(self, h: Tensor, anchors: Tensor, gammas: list[int], rows: RowSampling,
                      generator: Generators, states=()) -> list[DraftProposal]:
        """Parallel drafting: every slot is sampled independently from its own processed distribution;
        one LM-head call and one `sample` call (request-major) for all R×γ rows."""
        probs = rows.probs(self.lm_logits(h))  # [R, G, N] (N = the draft vocabulary, else V)
        tokens = torch.zeros(probs.shape[:2], dtype=torch.long, device=self.device)  # [R, G]
        assert probs.shape[1] == max(gammas), f"{probs.shape[1]} positions drafted for gammas up to {max(gammas)}"
        drafted = drafted_entries(gammas, self.device)  # request-major, as rows_generators lays them out
        tokens.view(-1)[drafted] = self.to_target_ids(
            sample(probs.reshape(-1, probs.shape[-1])[drafted], rows_generators(generator, gammas)).to(self.device))
        return split_proposals(tokens, self.full_vocab_probs(probs), None, gammas)
