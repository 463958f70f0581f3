"""DSpark sequential heads (paper §3.1 eq. 4-6) and the confidence head (eq. 7).

Sequential stage: p_k(v | x0, x<k) = softmax_v(U_k(v) + B_k(v)), sampled left to right, x_0 = anchor.
- Markov: B_k = W1[x_{k-1}] · W2 (W1 ∈ R^{V×r}, W2 ∈ R^{r×N}; N = the draft vocabulary, V without one:
  W1 reads target ids, W2 writes the draft-vocabulary columns of the logits, as in speculators).
- RNN: z_k = [s_{k-1}; W1[x_{k-1}]; h_k]; [g, c, o] = W z_k + b (one linear split in three);
  s_k = σ(g) ⊙ s_{k-1} + (1 − σ(g)) ⊙ tanh(c);  B_k = tanh(o) · W2;  s_0 = 0.
Confidence: c_k = σ(wᵀ[h_k ; W1[x_{k-1}]] + b)  (just wᵀh_k + b without a sequential head).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn


class MarkovHead(nn.Module):
    def __init__(self, vocab_size: int, rank: int, hidden: int, out_size: int | None = None):
        super().__init__()
        self.rank = rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, out_size or vocab_size, bias=False)

    def prev_embed(self, tokens: Tensor) -> Tensor:
        return self.markov_w1(tokens)

    def initial_state(self, like: Tensor) -> Tensor | None:
        return None  # memoryless

    def step(self, state: Tensor | None, prev_emb: Tensor, h: Tensor) -> tuple[Tensor | None, Tensor]:
        """One position: (state, W1[x_{k-1}], h_k) -> (next state, bias B_k [..., V])."""
        return state, self.markov_w2(prev_emb)

    def block_bias(self, prev_emb: Tensor, h: Tensor, select: Tensor | None = None) -> Tensor:
        """Teacher-forced biases. prev_emb [..., γ, r], h [..., γ, d] -> B [..., γ, V]
        (or [M, V] at the positions where `select` [..., γ] is True)."""
        return self.markov_w2(prev_emb if select is None else prev_emb[select])


class RNNHead(MarkovHead):
    def __init__(self, vocab_size: int, rank: int, hidden: int, out_size: int | None = None):
        super().__init__(vocab_size, rank, hidden, out_size)
        self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)

    def initial_state(self, like: Tensor) -> Tensor:
        return like.new_zeros(*like.shape[:-1], self.rank)

    def _update(self, state: Tensor, prev_emb: Tensor, h: Tensor) -> tuple[Tensor, Tensor]:
        gate, cand, out = self.joint_proj(torch.cat([state, prev_emb, h.to(prev_emb.dtype)], -1)).chunk(3, -1)
        gate = torch.sigmoid(gate)
        return gate * state + (1 - gate) * torch.tanh(cand), torch.tanh(out)

    def step(self, state: Tensor, prev_emb: Tensor, h: Tensor) -> tuple[Tensor, Tensor]:
        state, out = self._update(state, prev_emb, h)
        return state, self.markov_w2(out)

    def block_bias(self, prev_emb: Tensor, h: Tensor, select: Tensor | None = None) -> Tensor:
        state = self.initial_state(prev_emb[..., 0, :])
        outs = []
        for k in range(prev_emb.shape[-2]):  # the r-dim recurrence is cheap; W2 runs only where selected
            state, out = self._update(state, prev_emb[..., k, :], h[..., k, :])
            outs.append(out)
        outs = torch.stack(outs, dim=-2)
        return self.markov_w2(outs if select is None else outs[select])


class ConfidenceHead(nn.Module):
    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, h: Tensor, prev_emb: Tensor | None) -> Tensor:
        """Logit of c_k; sigmoid is applied by the caller (after optional STS temperature)."""
        x = h if prev_emb is None else torch.cat([h, prev_emb.to(h.dtype)], dim=-1)
        return self.proj(x).squeeze(-1)


def build_sequential_head(kind: str, vocab_size: int, rank: int, hidden: int,
                          out_size: int | None = None) -> MarkovHead | None:
    """out_size: width of the bias B_k (the draft vocabulary); None = vocab_size."""
    if kind == "none":
        return None
    return {"markov": MarkovHead, "rnn": RNNHead}[kind](vocab_size, rank, hidden, out_size)
