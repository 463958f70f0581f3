"""Drafter losses and acceptance metrics (paper §3.3 eq. 8-12; DESIGN §4).

All functions take the M supervised (anchor block, position k) pairs flattened, a per-pair position
weight w_k, and a normaliser `denom` chosen by `loss_denominator`:

    L_ce   = (1/denom) Σ w_k · (−log p_d^k(x*_k))          hard labels (the sampled token)
    L_ce   = (1/denom) Σ w_k · (−Σ_v p_t^k(v) log p_d^k(v)) soft labels (the target distribution)
    L_tv   = (1/denom) Σ w_k · ‖p_d^k − p_t^k‖₁
    L_conf = (1/denom) Σ w_k · BCE(c_k, c*_k),   c*_k = 1 − ½‖p_d^k − p_t^k‖₁  (label detached)

denom = Σ w_k over the supervised pairs ("token": a weighted mean per supervised token, so the loss
scale, the learning rate and the clipping threshold do not depend on the block size) or the number
of supervised anchor blocks ("block": the paper's per-block sum averaged over blocks).
p_d is the drafter's full (temperature-1) distribution, p_t the target's next-token distribution.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def position_weights(steps: int, kind: str = "paper", device=None, decay: float = 0.8) -> Tensor:
    """w_k for k = 1..steps: paper exp(-(k-1)/γ), DFlash reference code exp(-(k-1)/4), or geometric
    decay^(k-1) (the Eagle3 training-time-test step weights, 0.8^(k-1) in the reference)."""
    k = torch.arange(steps, dtype=torch.float32, device=device)
    if kind == "geometric":
        return decay ** k
    scale = {"paper": float(steps), "reference": 4.0}.get(kind)
    if scale is None:
        raise ValueError(f"position_weight must be 'paper', 'reference' or 'geometric', got {kind!r}")
    return torch.exp(-k / scale)


def loss_denominator(weights: Tensor, n_blocks: int, kind: str = "token") -> float:
    """Normaliser of every loss term: Σ w over the supervised pairs ("token") or the block count ("block")."""
    if kind == "token":
        return max(float(weights.sum()), 1e-12)
    if kind == "block":
        return float(max(n_blocks, 1))
    raise ValueError(f"loss_norm must be 'token' or 'block' here, got {kind!r} (sequence_step: sequence_step_weights)")


def sequence_step_weights(select: Tensor, w: Tensor) -> tuple[Tensor, float]:
    """loss_norm 'sequence_step' (the Eagle3 references): select [B, N, K] supervised pairs, w [K] step
    weights -> (weight of each supervised pair [M], denominator) such that
        Σ_pairs weight · term / denom = Σ_k w_k · mean_{b having step k} mean_{n} term_{b,n,k} / Σ_{k present} w_k,
    i.e. every sequence counts the same at every step, however many positions it supervises."""
    per_seq = select.sum(1)  # [B, K] pairs of sequence b at step k
    seqs = (per_seq > 0).sum(0)  # [K] sequences with step k
    per_pair = w / (per_seq.clamp_min(1) * seqs.clamp_min(1))  # [B, K]
    denom = float(w[seqs > 0].sum())
    return per_pair.unsqueeze(1).expand_as(select)[select], max(denom, 1e-12)


def tv_l1(p_draft: Tensor, p_target: Tensor, lost: Tensor | None = None) -> Tensor:
    """‖p_d − p_t‖₁ per row (twice the total-variation distance, in [0, 2]). With a draft vocabulary the
    two are given on its columns only and `lost` is the target mass outside them, where p_d is zero:
    ‖p_d − p_t‖₁ over the full vocabulary = Σ_draft |p_d − p_t| + lost (the same sum, split)."""
    l1 = (p_draft - p_target).abs().sum(-1)
    return l1 if lost is None else l1 + lost


def ce_loss(draft_logits: Tensor, labels: Tensor, weights: Tensor, denom: float) -> Tensor:
    nll = F.cross_entropy(draft_logits.float(), labels, reduction="none")
    return (weights * nll).sum() / denom


def soft_ce_loss(draft_logits: Tensor, p_target: Tensor, weights: Tensor, denom: float) -> Tensor:
    """Cross-entropy to the target distribution, −Σ_v p_t(v) log p_d(v) per pair (= KL(p_t‖p_d) + H(p_t):
    the same gradient as the KL, whose minimum p_d = p_t is where acceptance is 1)."""
    logp = torch.log_softmax(draft_logits.float(), dim=-1)
    return (weights * -(p_target.detach() * logp).sum(-1)).sum() / denom


def tv_loss(p_draft: Tensor, p_target: Tensor, weights: Tensor, denom: float, lost: Tensor | None = None) -> Tensor:
    return (weights * tv_l1(p_draft, p_target, lost)).sum() / denom


def acceptance_label(p_draft: Tensor, p_target: Tensor, lost: Tensor | None = None) -> Tensor:
    """c*_k = 1 − ½‖p_d − p_t‖₁: the exact probability that speculative sampling accepts draft k."""
    lost = None if lost is None else lost.detach()
    return (1.0 - 0.5 * tv_l1(p_draft.detach(), p_target.detach(), lost)).clamp(0.0, 1.0)


def conf_loss(conf_logits: Tensor, c_star: Tensor, weights: Tensor, denom: float) -> Tensor:
    bce = F.binary_cross_entropy_with_logits(conf_logits.float(), c_star.detach(), reduction="none")
    return (weights * bce).sum() / denom


def acceptance_metrics(c_star: Tensor, valid: Tensor) -> dict[str, Tensor]:
    """c_star, valid [blocks, K] -> acc_pos_{k} (mean c*_k where supervised; nan where none is) and
    expected_accept_len = 1 + Σ_k Π_{j≤k} c*_j, averaged over fully supervised blocks (all blocks if none is
    complete; unsupervised positions then count as rejected); 0-d tensors, read back with the step's other
    metrics in one copy (`drafter_loss`)."""
    K = c_star.shape[-1]
    c = torch.where(valid, c_star, torch.zeros_like(c_star)).float()
    n = valid.sum(0)  # [K]
    per_pos = torch.where(n > 0, c.sum(0) / n.clamp_min(1), torch.full_like(c[0] if len(c) else n.float(), math.nan))
    out = {f"acc_pos_{k + 1}": per_pos[k] for k in range(K)}
    full = valid.all(-1)
    use = torch.where(full.any(), full, valid.any(-1))  # complete blocks, else every supervised one
    chain = 1.0 + c.cumprod(-1).sum(-1)
    count = use.sum()
    out["expected_accept_len"] = torch.where(count > 0, (chain * use).sum() / count.clamp_min(1),
                                             torch.tensor(math.nan, device=c.device))
    return out
