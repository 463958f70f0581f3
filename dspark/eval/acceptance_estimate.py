"""Expected acceptance length τ from ONE teacher-forced pass along held-out target trajectories (no decoding).

Setting. A held-out rollout is a sequence sampled from the target (at the evaluation temperature). For an
anchor t (a generated token whose successor is generated too) and draft position k = 1..γ, let
p_k = the target's processed next-token distribution at position t+k-1 (`to_probs`, the same processing
decoding uses) and q_k = the drafter's processed distribution for token t+k, computed by the drafter's
training forward: context = target features of positions < t, the anchor token, and (for drafters that
condition on earlier draft tokens: DSpark's Markov head, Eagle3's TTT) the trajectory tokens t+1..t+k-1.

Speculative sampling accepts draft k, given drafts 1..k-1 accepted, with probability
    α_k = Σ_x min(p_k(x), q_k(x))                                   (conditional acceptance)
and P(drafts 1..k all accepted, with tokens x_1..x_k) = Π_{j≤k} min(p_j, q_j)(x_j). Two estimators of
the expected tokens per target step at an anchor, τ = 1 + Σ_{k=1}^{γ} P(first k accepted):
  "alpha" (the cheap product):  P_k ≈ Π_{j≤k} α_j  with α_j evaluated along the target trajectory. Exact
          for γ = 1; for k ≥ 2 it conditions on target-sampled tokens where decoding conditions on
          accepted tokens (law min(p,q)/α), a bias that vanishes as q → p.
  "iw" (importance-weighted, unbiased): since the trajectory token x_j ~ p_j,
          E_{x~p}[Π_{j<k} w_j · α_k] = P(first k accepted)  with  w_j = min(p_j, q_j)(x_j) / p_j(x_j)
          = min(1, q_j(x_j)/p_j(x_j)); the last factor is α_k itself (Rao-Blackwellised).
Positions past the end of the sequence count as rejected (a block cut by the end of the answer), as in
decoding with a token budget. τ is pooled over anchors; its 95 % interval is a percentile bootstrap over
prompts (resampling whole prompts: anchors of one prompt are correlated).

Both weigh every anchor alike, but decoding does not start its rounds at every position: a round starts
where the previous one stopped, right after a rejected draft, where drafting tends to be hard; easy
stretches are crossed in few, long rounds. So they read above decoding's τ (= tokens / rounds): by 0.09 for
a 1-layer smollm2 drafter at γ 3. "renewal" estimates decoding's τ itself. Given the whole trajectory,
draft k of a round anchored at t is accepted with probability w_{t,k} (the accept event depends on x_{t+k}
only, never on later tokens: what follows is target-distributed either way), so the expected number of
rounds that emit the trajectory obeys
    R(t) = 1 + Σ_{k=0}^{γ} P(exactly k accepted at t) · R(t + k + 1),    R(past the last anchor) = 0
and τ_decode = tokens / R(first anchor), summed over answer turns (a round never crosses into the next
turn) and pooled over prompts as Σ tokens / Σ R: the tokens a round emits, so it predicts decoding's
`tau_emitted` (drafts accepted past a token budget are not counted). It needs every anchor (stride 1).

`branching` (n_1, n_2, ...) scores rounds that verify a draft tree: every node at depth k−1 (the anchor at
depth 0) gets n_k distinct children drawn without replacement from the drafter's q_k given its path
(past the tuple: one), and the target scores all nodes in one forward (1 + Σ_k Π_{j≤k} n_j tokens).
Acceptance walks down from the anchor: among a node's children, recursive rejection sampling accepts
candidate j with min(1, p^(j)/q^(j)), where q^(j) is q_k without the earlier siblings, renormalised,
p^(1) = p_k and p^(j+1) = norm((p^(j) − q^(j))+): lossless like one draft (SpecInfer's multi-round
rejection, without replacement as in Recursive Speculative Decoding). The walk goes on below the accepted
child and stops at the first node none of whose children is accepted (the next token then comes from
the last residual). So only per-position quantities change, through `candidates_acceptance`: α_k becomes
P(some child accepted) and w_k = P(accepted with token x)/p_k(x) for the trajectory token x; deeper
positions condition on the accepted token, the trajectory's, as for one chain.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import torch
from torch import Tensor

from dspark.decoding.sampling import SamplingParams, to_probs
from dspark.decoding.tree_specdec import check_branching

ESTIMATORS = ("alpha", "iw")  # per-anchor; "renewal" (decoding's τ) comes with every estimate that keeps every anchor


@dataclass
class SequenceAcceptance:
    """Per anchor of one sequence: α [N, K], trajectory weights w [N, K], supported pairs [N, K], and the
    anchors' positions [N]."""

    alpha: Tensor
    weight: Tensor
    select: Tensor
    positions: Tensor | None = None

    def prefix_probs(self, gamma: int, estimator: str = "alpha") -> Tensor:
        """P(first k accepted) [N, γ] for k = 1..γ (0 where the block is cut by the sequence end)."""
        if estimator not in ESTIMATORS:
            raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
        a = torch.where(self.select, self.alpha, 0.0)[:, :gamma]
        if estimator == "alpha":
            return torch.cumprod(a, dim=1)
        w = torch.where(self.select, self.weight, 0.0)[:, :gamma]
        before = torch.cumprod(torch.cat([torch.ones_like(w[:, :1]), w[:, :-1]], dim=1), dim=1)  # Π_{j<k} w_j
        return before * a

    def taus(self, gamma: int, estimator: str = "alpha") -> Tensor:
        """Expected tokens per target step at each anchor: 1 + Σ_k P(first k accepted)  [N]."""
        return 1.0 + self.prefix_probs(gamma, estimator).sum(dim=1)

    def expected_rounds(self, gamma: int) -> float:
        """Expected draft-verify rounds that decoding spends emitting this trajectory's tokens after the first
        anchor of each answer turn (the "renewal" recursion of the module doc; every anchor must be present)."""
        if self.positions is None:
            raise ValueError("expected_rounds needs the anchors' positions (sequence_acceptance gives them)")
        w = torch.where(self.select, self.weight, 0.0)[:, :gamma].double()
        accepted_at_least = torch.cumprod(w, dim=1)  # [N, γ]: P(first k accepted | trajectory)
        exactly = torch.cat([1 - accepted_at_least[:, :1], accepted_at_least[:, :-1] - accepted_at_least[:, 1:],
                             accepted_at_least[:, -1:]], dim=1).tolist()  # [N, γ+1]: exactly 0..γ accepted
        positions = self.positions.tolist()
        index = {pos: i for i, pos in enumerate(positions)}
        rounds = [0.0] * len(positions)
        for i in range(len(rounds) - 1, -1, -1):  # a round at anchor t, k accepted -> the next round at t + k + 1
            pos = positions[i]
            rounds[i] = 1.0 + sum(pk * rounds[index[pos + k + 1]] for k, pk in enumerate(exactly[i])
                                  if pos + k + 1 in index)
        # a round never crosses from one answer turn into the next: each turn's rounds start at its first anchor
        return sum(r for r, pos in zip(rounds, positions) if pos - 1 not in index)


def _anchors(model, loss_mask: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor]:
    from dspark.drafters.anchors import all_anchors, sample_anchors

    if model.trains_every_position:
        return all_anchors(loss_mask, attention_mask)
    return sample_anchors(loss_mask, attention_mask, loss_mask.shape[1], None)  # every eligible position


@torch.no_grad()
def sequence_acceptance(drafter, target, input_ids: Tensor, loss_mask: Tensor, sampling: SamplingParams,
                        rows_per_chunk: int = 2048, target_out=None, anchor_stride: int = 1,
                        p_pos: Tensor | None = None, branching: Sequence[int] = ()) -> SequenceAcceptance:
    """α, w and the supported pairs for ONE sequence (input_ids, loss_mask: [T]); see the module doc.
    `target_out`: the target's features [1, T, m·d] and final hidden [1, T, d] for this sequence,
    precomputed (dspark/training/feature_cache.py); None runs the target here. `anchor_stride` k > 1
    keeps every k-th eligible anchor (a uniform subsample: the estimate stays unbiased, k times cheaper;
    not for dense-layout drafters such as Eagle3's TTT, which always use every position). `p_pos`: the
    target's processed distributions [T, V] (`target_probs`), shared between drafters. `branching`: a draft
    tree's children per node at each depth (module doc; () = one chain)."""
    from dspark.training.loss import supervised_pairs

    model = getattr(drafter, "module", drafter)
    device = target.device
    ids = input_ids.to(device).view(1, -1)
    mask = loss_mask.to(device).view(1, -1)
    attn = torch.ones_like(ids)
    K = model.config.train_steps
    out = target_out if target_out is not None else target.forward(
        ids, attention_mask=attn, layer_ids=model.layer_ids, logits_at=None)
    anchors, valid = _anchors(model, mask, attn)
    if anchor_stride > 1 and not model.trains_every_position:
        anchors, valid = anchors[:, ::anchor_stride], valid[:, ::anchor_stride]
    label_pos, select = supervised_pairs(mask, attn, anchors, valid, K)
    if not bool(select.any()):
        empty = torch.zeros(int(valid.sum()), K)
        return SequenceAcceptance(empty, empty.clone(), empty.bool(), anchors[0][valid[0]].cpu())
    draft = drafter(out.features.to(device, torch.float32), ids, attn.bool(), anchors, select)
    # [M, N] on the draft vocabulary (N = V without one), from the q drafts are drawn from
    q = to_probs(draft.logits.float(), model.draft_sampling(sampling))
    draft_ids = getattr(model, "draft_ids", None)
    pos = label_pos[select]  # [M] position of each predicted token; p comes from position pos - 1
    tokens = ids[0, pos]
    if p_pos is None:
        p_pos = target_probs(target, out.final_hidden[0], sampling)  # [T, V], once per position
    p_pos = p_pos.to(device, torch.float32)
    p_tok = p_pos[pos - 1, tokens]  # p_k(x_k) of the trajectory token
    if draft_ids is None:
        q_tok = q.gather(1, tokens.unsqueeze(1)).squeeze(1)
    else:
        from dspark.drafters.draft_vocab import IGNORE_LABEL, draft_labels

        col = draft_labels(tokens, model.t2d.to(device))
        q_tok = torch.where(col == IGNORE_LABEL, 0.0, q.gather(1, col.clamp_min(0).unsqueeze(1)).squeeze(1))
    alpha = torch.cat([_overlap(p_pos, q, pos[i:i + rows_per_chunk] - 1, i, rows_per_chunk, draft_ids)
                       for i in range(0, pos.numel(), rows_per_chunk)])
    weight = torch.where(p_tok > 0, (q_tok / p_tok.clamp_min(1e-30)).clamp(max=1.0), 0.0)
    depth = torch.arange(K, device=device).expand(select.shape)[select]  # [M] draft position k − 1 of each pair
    cols = tokens if draft_ids is None else col
    for k, n in enumerate(branching):
        at = depth == k
        if n > 1 and bool(at.any()):
            alpha[at], weight[at] = candidates_acceptance(p_pos[pos[at] - 1], q[at], cols[at], p_tok[at], n, draft_ids)
    sel = select[0][valid[0]]  # [N, K] for the valid anchors only
    full_a, full_w = torch.zeros(select.shape, device=device), torch.zeros(select.shape, device=device)
    full_a[select], full_w[select] = alpha, weight
    return SequenceAcceptance(full_a[0][valid[0]].cpu(), full_w[0][valid[0]].cpu(), sel.cpu(),
                              anchors[0][valid[0]].cpu())


@torch.no_grad()
def target_probs(target, final_hidden: Tensor, sampling: SamplingParams) -> Tensor:
    """The target's processed next-token distributions [T, V] from its final hidden states [T, d]."""
    return to_probs(target.lm_logits(final_hidden.to(target.device, target.dtype)).float(), sampling)


def _overlap(p_pos: Tensor, q: Tensor, rows: Tensor, start: int, size: int, draft_ids: Tensor | None) -> Tensor:
    """Σ_x min(p, q) for q rows start..start+size and the target rows `rows` (q is 0 outside the subset)."""
    p = p_pos[rows]
    if draft_ids is not None:
        p = p[:, draft_ids.to(p.device)]
    return torch.minimum(p, q[start:start + size]).sum(dim=1)


def candidates_acceptance(p: Tensor, q: Tensor, cols: Tensor, p_tok: Tensor, n: int,
                          draft_ids: Tensor | None = None, samples: int = 16, seed: int = 0) -> tuple[Tensor, Tensor]:
    """(α, w) of n distinct candidates drawn from q [M, N] without replacement against p [M, V], recursive
    rejection sampling: candidate j comes from q^(j) = q without candidates 1..j−1, renormalised
    (`sibling_proposals`), and is accepted with min(1, p^(j)/q^(j)); on rejection p^(j+1) =
    norm((p^(j) − q^(j))+), p^(1) = p. Invariant (lossless): whatever the earlier draws, stage j emits
    p^(j), so the walk emits p. Returns α = P(some candidate accepted) and, for the trajectory token
    (column `cols` of q, < 0 outside the draft vocabulary; p(x) = p_tok), w = P(accepted with token x) / p(x).
    n = 1: exactly Σ min(p, q) and min(1, q/p)(x). n > 1: a seeded Monte Carlo over `samples` draws of
    the candidates; given candidates 1..j−1 (reached with probability reach_j), stage j accepts with token
    x with probability reach_j · min(p^(j), q^(j))(x) (averaged over candidate j exactly) and at all with
    reach_j · min(1, p^(j)/q^(j))(x_j) for the drawn x_j (bounded: a low-variance α). Both are unbiased.
    """
    from dspark.decoding.sampling import draw_distinct, sibling_proposals

    p, q = p.float(), q.float()
    inside0 = p if draft_ids is None else p[:, draft_ids.to(p.device)]
    outside0 = p.sum(1) - inside0.sum(1)  # mass q never drafts: it stays in every residual
    ok, at = cols >= 0, cols.clamp_min(0).unsqueeze(1)
    if n == 1:
        overlap = torch.minimum(inside0, q)
        alpha, joint = overlap.sum(1), torch.where(ok, overlap.gather(1, at).squeeze(1), 0.0)
    else:
        gen = torch.Generator(device=q.device).manual_seed(seed)
        alpha, joint = torch.zeros_like(outside0), torch.zeros_like(outside0)
        for _ in range(samples):
            picks = draw_distinct(q, n, gen)  # [M, n]
            rows = sibling_proposals(q, picks)  # [M, n, N]
            inside, outside, reach = inside0, outside0, torch.ones_like(outside0)
            for j in range(picks.shape[1]):
                qj, x = rows[:, j], picks[:, j: j + 1]
                overlap = torch.minimum(inside, qj)
                joint += reach * torch.where(ok, overlap.gather(1, at).squeeze(1), 0.0) / samples
                q_x = qj.gather(1, x).squeeze(1)
                accept = torch.where(q_x > 0, inside.gather(1, x).squeeze(1) / q_x.clamp_min(1e-30), 0.0).clamp(max=1.0)
                alpha += reach * accept / samples
                reach = reach * (1 - accept)
                residual = (inside - qj).clamp_min(0)
                z = (residual.sum(1) + outside).clamp_min(1e-30)  # 0 only where p^(j) = q^(j): reach is 0 here on
                inside, outside = residual / z[:, None], outside / z
    # n > 1: one estimate may pass 1 (its mean is at most 1); clamping it would bias the mean down
    weight = torch.where(p_tok > 0, joint / p_tok.clamp_min(1e-30), 0.0)
    return alpha, weight.clamp(max=1.0) if n == 1 else weight


# ---------------------------------------------------------------- aggregation
@dataclass
class PromptStats:
    """Sums over one prompt's anchors (what the bootstrap resamples)."""

    prompt_id: str
    group: str
    anchors: int
    tau_sum: float
    prefix_sum: np.ndarray  # Σ over anchors of P(first k accepted), [γ]
    alpha_sum: np.ndarray  # Σ α_k over supported pairs, [γ]
    alpha_count: np.ndarray  # supported pairs per k, [γ]


def prompt_stats(prompt_id: str, group: str, acc: SequenceAcceptance, gamma: int, estimator: str) -> PromptStats:
    prefix = acc.prefix_probs(gamma, estimator)
    sel = acc.select[:, :gamma]
    return PromptStats(prompt_id, group, int(prefix.shape[0]), float((1.0 + prefix.sum(1)).sum()),
                       prefix.sum(0).double().numpy(), torch.where(sel, acc.alpha[:, :gamma], 0.0).sum(0).double().numpy(),
                       sel.sum(0).double().numpy())


def bootstrap_ratio(num: np.ndarray, den: np.ndarray, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95 % percentile interval of Σnum/Σden when whole units (prompts) are resampled with replacement."""
    num, den = np.asarray(num, dtype=float), np.asarray(den, dtype=float)
    if num.size == 0 or den.sum() == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, num.size, size=(resamples, num.size))
    stats = num[idx].sum(1) / np.maximum(den[idx].sum(1), 1e-12)
    lo, hi = np.percentile(stats, [2.5, 97.5])
    return float(lo), float(hi)


def summarize(stats: Sequence[PromptStats], resamples: int = 2000, seed: int = 0) -> dict:
    """Pooled expected τ with its bootstrap CI, per-position acceptance, and the same per group."""
    def block(items: Sequence[PromptStats]) -> dict:
        items = [s for s in items if s.anchors > 0]
        if not items:
            return {"prompts": 0, "anchors": 0, "expected_tau": None, "expected_tau_ci95": [None, None]}
        anchors = np.array([s.anchors for s in items], dtype=float)
        tau = np.array([s.tau_sum for s in items])
        lo, hi = bootstrap_ratio(tau, anchors, resamples, seed)
        prefix = np.sum([s.prefix_sum for s in items], axis=0) / anchors.sum()
        a_sum, a_cnt = np.sum([s.alpha_sum for s in items], axis=0), np.sum([s.alpha_count for s in items], axis=0)
        return {"prompts": len(items), "anchors": int(anchors.sum()), "expected_tau": float(tau.sum() / anchors.sum()),
                "expected_tau_ci95": [lo, hi],
                "acceptance_per_position": [float(x) for x in a_sum / np.maximum(a_cnt, 1)],
                "prefix_acceptance": [float(x) for x in prefix]}

    groups = sorted({s.group for s in stats})
    return {**block(stats), "per_group": {g: block([s for s in stats if s.group == g]) for g in groups},
            # what a paired comparison of two drafters on the same rows resamples (paired_difference)
            "per_prompt": {s.prompt_id: [s.anchors, s.tau_sum] for s in stats if s.anchors > 0}}


def paired_difference(a: dict, b: dict, resamples: int = 2000, seed: int = 0) -> dict:
    """τ_a − τ_b of two drafters estimated on the same held-out rows, from their `per_prompt` sums, with a
    95 % interval from resampling the shared prompts jointly (paired: the prompt-to-prompt spread that
    both estimates share cancels, so the interval is much narrower than either τ's own)."""
    shared = sorted(set(a) & set(b))
    if not shared:
        raise ValueError("the two estimates share no prompts (other held-out rows?)")
    na, ta = np.array([a[k][0] for k in shared], float), np.array([a[k][1] for k in shared])
    nb, tb = np.array([b[k][0] for k in shared], float), np.array([b[k][1] for k in shared])
    idx = np.random.default_rng(seed).integers(0, len(shared), size=(resamples, len(shared)))
    diffs = ta[idx].sum(1) / na[idx].sum(1) - tb[idx].sum(1) / nb[idx].sum(1)
    lo, hi = np.percentile(diffs, [2.5, 97.5])
    return {"difference": float(ta.sum() / na.sum() - tb.sum() / nb.sum()), "ci95": [float(lo), float(hi)],
            "prompts": len(shared), "share_of_resamples_above_0": float((diffs > 0).mean())}


def estimate(drafter, target, rows: Iterable[dict], gamma: int, sampling: SamplingParams,
             estimators: Sequence[str] = ESTIMATORS, group_key: str = "domain", max_len: int | None = None,
             resamples: int = 2000, target_outs: Sequence | None = None, anchor_stride: int = 1,
             p_cache: dict | None = None, branching: Sequence[int] = ()) -> dict:
    """rows: dicts with prompt_id, input_ids, loss_mask (+ `group_key`) -> {estimator: summarize(...)}.
    One target and one drafter pass per row; `max_len` cuts long rows. `target_outs`: precomputed
    target outputs, one per row (already cut to max_len), instead of running the target. `p_cache`: a
    dict kept by the caller across drafters, row index -> the target's distributions (bf16).
    `branching`: children per node at each depth of a draft tree verified at once (module doc)."""
    branching = check_branching(branching, gamma)
    was_training = drafter.training
    drafter.eval()
    per: dict[str, list[PromptStats]] = {e: [] for e in estimators}
    every_anchor = anchor_stride == 1 or getattr(drafter, "module", drafter).trains_every_position
    renewal: list[tuple[str, str, int, float]] = []  # (prompt, group, tokens, expected rounds)
    try:
        for i, row in enumerate(rows):
            ids = torch.as_tensor(list(row["input_ids"])[:max_len], dtype=torch.long)
            mask = torch.as_tensor(list(row["loss_mask"])[:max_len], dtype=torch.long)
            out = None if target_outs is None else target_outs[i]
            p = None
            if p_cache is not None and out is not None:
                if i not in p_cache:
                    p_cache[i] = target_probs(target, out.final_hidden[0], sampling).to(torch.bfloat16)
                p = p_cache[i]
            acc = sequence_acceptance(drafter, target, ids, mask, sampling, target_out=out,
                                      anchor_stride=anchor_stride, p_pos=p, branching=branching)
            for e in estimators:
                per[e].append(prompt_stats(str(row["prompt_id"]), str(row.get(group_key, "")), acc, gamma, e))
            if every_anchor:
                renewal.append((str(row["prompt_id"]), str(row.get(group_key, "")), int(acc.select.shape[0]),
                                acc.expected_rounds(gamma)))
    finally:
        drafter.train(was_training)
    out = {e: summarize(s, resamples) for e, s in per.items()}
    if every_anchor:
        out["renewal"] = summarize_renewal(renewal, resamples)
    return out


def summarize_renewal(per_prompt: Sequence[tuple[str, str, int, float]], resamples: int = 2000, seed: int = 0) -> dict:
    """Decoding's τ (Σ tokens / Σ expected rounds) with its prompt-bootstrap interval, overall and per group;
    per_prompt {id: [rounds, tokens]} has the shape `paired_difference` reads."""
    def block(items) -> dict:
        items = [it for it in items if it[3] > 0]
        if not items:
            return {"prompts": 0, "decoded_tau": None, "decoded_tau_ci95": [None, None]}
        tokens, rounds = np.array([it[2] for it in items], float), np.array([it[3] for it in items])
        lo, hi = bootstrap_ratio(tokens, rounds, resamples, seed)
        return {"prompts": len(items), "tokens": int(tokens.sum()), "expected_rounds": float(rounds.sum()),
                "decoded_tau": float(tokens.sum() / rounds.sum()), "decoded_tau_ci95": [lo, hi]}

    groups = sorted({it[1] for it in per_prompt})
    return {**block(per_prompt), "per_group": {g: block([it for it in per_prompt if it[1] == g]) for g in groups},
            "per_prompt": {pid: [rounds, tokens] for pid, _, tokens, rounds in per_prompt if rounds > 0}}
