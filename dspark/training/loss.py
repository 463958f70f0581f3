"""One drafter training step's loss: anchors -> packed blocks -> losses (paper §3.3; DESIGN §4).

Labels, exactly: for an anchor at position t, prediction k (k = 1..K; K = block_size, or ttt_steps
for eagle3) is for the ground-truth token x*_k = input_ids[t+k], and its target distribution is
p_t^k = softmax(target logits at position t+k-1), i.e. the target's teacher-forced next-token
distribution for that token. A pair (t, k) is supervised iff t+k < T and token t+k is a supervised,
non-padding token. Anchors are positions t with loss_mask[t] and loss_mask[t+1] (and not padding),
up to `anchors_per_seq` per sequence, drawn with `generator`; Eagle3 with `dense_ttt` takes every
eligible position (the reference's training-time test over whole sequences).

The target runs once (no grad) for the context features and its final hidden states; its LM head
is applied only at the supervised positions. Sequences are right-padded.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dspark.drafters.anchors import all_anchors, sample_anchors
from dspark.drafters.draft_vocab import draft_labels
from dspark.training.losses import (acceptance_label, acceptance_metrics, ce_loss, conf_loss, loss_denominator,
                           position_weights, sequence_step_weights, soft_ce_loss, tv_loss)


@dataclass
class LossOutput:
    loss: Tensor  # scalar with grad
    metrics: dict[str, float]


def supervised_pairs(loss_mask: Tensor, attention_mask: Tensor, anchors: Tensor, valid: Tensor,
                     steps: int) -> tuple[Tensor, Tensor]:
    """(label positions t+k [B,N,K] clamped into the sequence, select bool [B,N,K])."""
    T = loss_mask.shape[1]
    pos = anchors.unsqueeze(-1) + torch.arange(1, steps + 1, device=anchors.device)
    clamped = pos.clamp(max=T - 1)
    ok = (loss_mask.bool() & attention_mask.bool()).gather(1, clamped.flatten(1)).view_as(pos)
    return clamped, valid.unsqueeze(-1) & (pos < T) & ok


def _zero_loss(model, n_anchors: int) -> LossOutput:
    zero = sum(p.sum() for p in model.parameters() if p.requires_grad) * 0.0
    return LossOutput(zero, {"loss": 0.0, "loss_ce": 0.0, "loss_tv": 0.0, "loss_conf": 0.0,
                             "n_anchors": float(n_anchors), "n_supervised": 0.0})


def drafter_loss(drafter, target, input_ids: Tensor, loss_mask: Tensor, attention_mask: Tensor | None,
                 generator: torch.Generator | None = None, target_out=None, read_metrics: bool = True) -> LossOutput:
    """Combined loss α_ce·L_ce + α_tv·L_tv (+ α_conf·L_conf for DSpark with a confidence head).
    `drafter` may be wrapped (DDP / DeepSpeed engine): it is called, never unwrapped, for the forward.
    `target_out`: the frozen target's features [B, T, m*d] and final hidden states [B, T, d] of these
    sequences, precomputed (dspark/training/feature_cache.py); None runs the target here.
    read_metrics=False: the metrics stay 0-d device tensors (no host copy here; see `read_back`)."""
    model = getattr(drafter, "module", drafter)
    cfg, K = model.config, model.config.train_steps
    device = target.device
    input_ids, loss_mask = input_ids.to(device), loss_mask.to(device)
    attention_mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(device)

    if model.trains_every_position:
        anchors, valid = all_anchors(loss_mask, attention_mask)
    else:
        anchors, valid = sample_anchors(loss_mask, attention_mask, cfg.anchors_per_seq, generator)
    label_pos, select = supervised_pairs(loss_mask, attention_mask, anchors, valid, K)
    if not bool(select.any()):
        return _zero_loss(model, int(valid.sum()))

    # With a draft vocabulary the logits cover its N tokens and p_d is zero outside them: TV and the
    # acceptance label c* compare against the full target distribution, computed on the N columns plus
    # the target mass outside them (`lost`, which counts in full), so no [pairs, V] tensor is built;
    # CE ignores labels outside the subset (they cannot be drafted).
    draft_ids = getattr(model, "draft_ids", None)  # columns of draft.logits; None = the full vocabulary
    with torch.no_grad():
        out = target_out if target_out is not None else target.forward(
            input_ids, attention_mask=attention_mask, layer_ids=model.layer_ids, logits_at=None)
        # the target on the drafter's columns at each pair's position t+k-1, and its mass elsewhere
        p_t_cols, lost = target_distributions(target, out.final_hidden, label_pos - 1, select, draft_ids)
    labels = input_ids.gather(1, label_pos.flatten(1)).view_as(label_pos)[select]

    draft = drafter(out.features, input_ids, attention_mask.bool(), anchors, select)
    with torch.set_grad_enabled(torch.is_grad_enabled() and cfg.loss_tv != 0):  # no TV term: metrics only
        p_draft = torch.softmax(draft.logits.float(), dim=-1)
    ce_labels, predicted = labels, draft.logits.argmax(-1)
    if draft_ids is not None:
        ce_labels, predicted = draft_labels(labels, model.t2d), draft_ids[predicted]
    step_w = position_weights(K, cfg.position_weight, device, cfg.position_decay)
    n_blocks = int(select.any(-1).sum())
    if cfg.resolved_loss_norm == "sequence_step":
        weights, denom = sequence_step_weights(select, step_w)
    else:
        weights = step_w.expand_as(select)[select]
        denom = loss_denominator(weights, n_blocks, cfg.resolved_loss_norm)

    if cfg.ce_target == "soft":  # soft CE against the target distribution, on the draft vocabulary if any
        l_ce = soft_ce_loss(draft.logits, soft_targets(p_t_cols, subset=draft_ids is not None), weights, denom)
    else:
        l_ce = ce_loss(draft.logits, ce_labels, weights, denom)
    l_tv = tv_loss(p_draft, p_t_cols, weights, denom, lost)
    c_star = acceptance_label(p_draft, p_t_cols, lost)
    loss = cfg.loss_ce * l_ce + cfg.loss_tv * l_tv
    metrics = {"loss_ce": l_ce, "loss_tv": l_tv, "loss_conf": torch.zeros((), device=device)}
    if draft.conf_logits is not None:
        l_conf = conf_loss(draft.conf_logits, c_star, weights, denom)
        loss = loss + cfg.loss_conf * l_conf
        metrics["loss_conf"] = l_conf
        metrics["conf_mae"] = (torch.sigmoid(draft.conf_logits.detach().float()) - c_star).abs().mean()

    c_full = torch.zeros(select.shape, device=device)
    c_full[select] = c_star
    metrics.update(acceptance_metrics(c_full[valid], select[valid]))
    metrics.update(loss=loss, n_anchors=valid.sum(), n_supervised=select.sum(), n_blocks=torch.tensor(n_blocks),
                   token_acc=(predicted == labels).float().mean())
    return LossOutput(loss, read_back(metrics) if read_metrics else {k: v.detach() for k, v in metrics.items()})


def read_back(metrics: dict[str, Tensor | float]) -> dict[str, float]:
    """0-d metric tensors (or floats) -> floats in ONE device-to-host copy (not one sync per metric)."""
    names = list(metrics)
    device = next((v.device for v in metrics.values() if isinstance(v, Tensor)), "cpu")
    values = torch.stack([torch.as_tensor(metrics[k]).detach().float().reshape(()).to(device) for k in names])
    return dict(zip(names, values.tolist()))


def target_distributions(target, final_hidden: Tensor, positions: Tensor, select: Tensor,
                         columns: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """The target's next-token distribution at positions[select] ([P] pairs; final_hidden [B, T, d]) on the
    drafter's `columns` (None: all V), and the mass outside them (None without columns). Overlapping anchor
    blocks label the same position up to K times: the frozen LM head and the V-wide softmax run once per
    distinct position and the rows are then repeated (dense anchors: ~K× less LM-head work)."""
    batch, length = final_hidden.shape[:2]
    rows = torch.arange(batch, device=positions.device)[:, None, None] * length
    flat = (rows + positions)[select]  # [P] row-major index of each pair's position
    distinct, inverse = torch.unique(flat, return_inverse=True)
    probs = torch.softmax(target.lm_logits(final_hidden.reshape(batch * length, -1)[distinct]).float(), dim=-1)
    if columns is None:
        return probs[inverse], None
    on_cols = probs[:, columns.to(probs.device)]
    lost = (probs.sum(-1) - on_cols.sum(-1)).clamp_min(0.0)
    return on_cols[inverse], lost[inverse]


def soft_targets(p_t_cols: Tensor, subset: bool) -> Tensor:
    """The soft-CE targets: p_t itself, or with a draft vocabulary (`subset`) p_t on its tokens
    renormalised (the drafter puts no mass outside them, so CE against mass there would be infinite)."""
    if not subset:
        return p_t_cols
    return p_t_cols / p_t_cols.sum(-1, keepdim=True).clamp_min(1e-12)

