"""Draft vocabulary (Eagle3's d2t/t2d): the drafter predicts over the N most frequent target tokens.

Ids. Draft id i in [0, N) stands for target id `draft_ids[i]`; draft_ids are sorted ascending (the
order speculators and vLLM use, so `lm_head[t2d]` lists the draft rows in draft-id order).
    d2t [N] int64 = draft_ids - arange(N)   offsets: target_id = i + d2t[i]  (vLLM draft_id_to_target_id)
    t2d [V] bool  = membership mask of the target vocabulary (True for the N draft tokens)

Losslessness. q is a distribution on the subset; extended by zeros to V it is an ordinary draft
distribution for speculative sampling: acceptance min(1, p/q) on drafted tokens (always in the subset,
q > 0 there) and the residual max(0, p - q) over the full vocabulary, which equals p outside the
subset. Tokens outside the subset are never drafted but the target still emits them, exactly as often
as target-only sampling would.

Frequencies are counted over the rollouts' supervised tokens (loss_mask = 1), as the Eagle3 and
speculators recipes do; ties and never-seen tokens are broken by the lower token id.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import torch
from torch import Tensor

IGNORE_LABEL = -100  # F.cross_entropy's ignore_index: labels outside the draft vocabulary


@dataclass(frozen=True)
class DraftVocabPlan:
    """A run's draft vocabulary, decided once (the training driver) and handed to every worker:
    plain ints, picklable across the Ray boundary. draft_ids None = the full target vocabulary."""

    draft_ids: tuple[int, ...] | None = None  # ascending target ids (top_token_ids)
    coverage: float | None = None  # share of the counted supervised tokens the subset can draft

    @classmethod
    def from_counts(cls, counts: Tensor, size: int | None, vocab_size: int | None = None,
                    kept: Tensor | None = None) -> "DraftVocabPlan":
        """The `size` most frequent ids of `counts` (top_token_ids) and their coverage; size None = full.
        kept: the ids of a drafter being retrained (its LM head rows), used instead, with their coverage."""
        if size is None:
            return cls()
        ids = kept if kept is not None else top_token_ids(counts, size, vocab_size=vocab_size)
        return cls(tuple(ids.tolist()), coverage(counts, ids))  # (the module's coverage function)

    @classmethod
    def of_rows(cls, rows: Iterable[tuple[Sequence[int], Sequence[int]]], size: int | None, vocab_size: int,
                kept: Tensor | None = None) -> "DraftVocabPlan":
        """`from_counts` over the supervised tokens of in-memory (input_ids, loss_mask) rows: what every trainer
        that holds its rows (the GPU recipe, the learning curve, benchmarks) plans, as jobs.train does from Parquet."""
        if size is None:
            return cls()
        return cls.from_counts(count_token_frequencies(rows, vocab_size), size, vocab_size, kept=kept)

    def ids(self) -> Tensor | None:
        """draft_ids as the int64 tensor build_drafter takes (None for the full vocabulary)."""
        return None if self.draft_ids is None else torch.tensor(self.draft_ids, dtype=torch.long)


def count_token_frequencies(rows: Iterable[tuple[Sequence[int], Sequence[int]]], vocab_size: int,
                            source: str = "rows") -> Tensor:
    """Counts [V] int64 of the tokens with loss_mask = 1 over (input_ids, loss_mask) rows.
    Raises naming the row when lengths differ or an id is outside [0, V)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for i, (ids, mask) in enumerate(rows):
        ids, mask = np.asarray(ids, dtype=np.int64), np.asarray(mask).astype(bool)
        if ids.shape != mask.shape:
            raise ValueError(f"{source} row {i}: input_ids has {ids.size} tokens but loss_mask has {mask.size}")
        counts += _bincount(ids[mask], vocab_size, f"{source} row {i}")
    return torch.from_numpy(counts)


def _bincount(ids: np.ndarray, vocab_size: int | None, where: str) -> np.ndarray:
    limit = np.iinfo(np.int64).max if vocab_size is None else vocab_size
    if ids.size and (ids.min() < 0 or ids.max() >= limit):
        bad = int(ids[(ids < 0) | (ids >= limit)][0])
        raise ValueError(f"{where}: input_ids holds token id {bad}, outside the target vocabulary "
                         f"[0, {vocab_size}); the rollouts were generated with another tokenizer")
    return np.bincount(ids, minlength=vocab_size or 0)


def _add(counts: np.ndarray, more: np.ndarray) -> np.ndarray:
    """counts + more, growing to the longer of the two (for an unknown vocabulary size)."""
    if more.size > counts.size:
        counts, more = more, counts
    counts[: more.size] += more
    return counts


def count_parquet_frequencies(paths: list[str], vocab_size: int | None, split: str | None = None,
                              filesystem=None) -> Tensor:
    """Counts [V] over Parquet rollouts (columns input_ids, loss_mask[, split]), read in record
    batches with pyarrow (flattened, never row by row). Errors name the file and the batch row.
    vocab_size None (the target is not loaded): the counts end at the largest id seen."""
    import pyarrow.compute as pc
    import pyarrow.dataset as pads

    counts = np.zeros(vocab_size or 0, dtype=np.int64)
    for path in paths:
        dataset = pads.dataset(path, filesystem=filesystem, format="parquet")
        where = None if split is None else pads.field("split") == split
        for batch in dataset.to_batches(columns=["input_ids", "loss_mask"], filter=where):
            if batch.num_rows == 0:  # a filtered-out or empty shard: `pc.all` of nothing is null, not True
                continue
            ids_col, mask_col = batch.column("input_ids"), batch.column("loss_mask")
            lens_ok = pc.equal(pc.list_value_length(ids_col), pc.list_value_length(mask_col))
            if pc.all(lens_ok).as_py() is not True:  # False, or null where a row's list itself is null
                row = int(pc.index(pc.fill_null(lens_ok, False), False).as_py())
                raise ValueError(f"{path} row {row} of a batch: input_ids and loss_mask differ in length")
            ids = pc.list_flatten(ids_col).to_numpy(zero_copy_only=False).astype(np.int64)
            mask = pc.list_flatten(mask_col).to_numpy(zero_copy_only=False).astype(bool)
            counts = _add(counts, _bincount(ids[mask], vocab_size, str(path)))
    return torch.from_numpy(counts)


def top_token_ids(counts: Tensor, size: int, vocab_size: int | None = None) -> Tensor:
    """The `size` most frequent target ids (ties and unseen tokens: lower id first), sorted ascending.
    vocab_size pads counts that end early (ids never seen count 0)."""
    if vocab_size is not None and counts.numel() < vocab_size:
        counts = torch.cat([counts, counts.new_zeros(vocab_size - counts.numel())])
    vocab = counts.numel()
    if not 1 <= size <= vocab:
        raise ValueError(f"draft_vocab_size={size} must be in 1..{vocab} (the target vocabulary)")
    order = torch.sort(-counts.long(), stable=True).indices  # stable: equal counts keep ascending id order
    return order[:size].sort().values


def d2t_from_ids(draft_ids: Tensor) -> Tensor:
    return draft_ids.long() - torch.arange(draft_ids.numel(), device=draft_ids.device)


def t2d_from_ids(draft_ids: Tensor, vocab_size: int) -> Tensor:
    mask = torch.zeros(vocab_size, dtype=torch.bool, device=draft_ids.device)
    mask[draft_ids] = True
    return mask


def ids_from_d2t(d2t: Tensor) -> Tensor:
    return d2t.long() + torch.arange(d2t.numel(), device=d2t.device)


def check_draft_ids(draft_ids: Tensor, vocab_size: int, size: int | None = None) -> Tensor:
    """Validated LongTensor of draft ids: 1-D, strictly ascending (hence distinct), inside [0, V)."""
    ids = torch.as_tensor(draft_ids).long().flatten()
    if size is not None and ids.numel() != size:
        raise ValueError(f"got {ids.numel()} draft token ids but draft_vocab_size={size}")
    if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"draft token ids must be non-empty and inside the target vocabulary [0, {vocab_size})")
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError("draft token ids must be strictly ascending (sorted, no duplicates), as d2t/t2d require")
    return ids


def check_maps(d2t: Tensor, t2d: Tensor) -> Tensor:
    """Check that d2t (offsets) and t2d (mask) describe the same subset; returns the draft ids."""
    ids = check_draft_ids(ids_from_d2t(d2t.cpu()), t2d.numel(), d2t.numel())
    if not torch.equal(t2d.cpu().bool(), t2d_from_ids(ids, t2d.numel())):
        raise ValueError(f"d2t and t2d disagree: t2d marks {int(t2d.sum())} tokens, d2t maps {d2t.numel()} "
                         "draft ids elsewhere; the checkpoint's draft vocabulary is corrupt")
    return ids


def extend_to_vocab(probs: Tensor, draft_ids: Tensor, vocab_size: int) -> Tensor:
    """Probabilities [..., N] on the draft vocabulary -> [..., V], zero outside it (same dtype)."""
    out = probs.new_zeros(*probs.shape[:-1], vocab_size)
    return out.index_copy_(-1, draft_ids.to(probs.device), probs)


def draft_labels(labels: Tensor, t2d: Tensor) -> Tensor:
    """Target-id labels -> draft ids; IGNORE_LABEL where the label is outside the draft vocabulary."""
    t2d = t2d.to(labels.device)
    index = torch.cumsum(t2d.long(), 0) - 1  # draft id of every member token
    return torch.where(t2d[labels], index[labels], torch.full_like(labels, IGNORE_LABEL))


def coverage(counts: Tensor, draft_ids: Tensor) -> float:
    """Share of the counted (supervised) tokens that the draft vocabulary can draft."""
    total = int(counts.sum())
    return float(counts[draft_ids[draft_ids < counts.numel()]].sum()) / total if total else 0.0


def carry_rows(rows: Tensor, old_t2d: Tensor, new_ids: Tensor) -> Tensor:
    """A weight indexed by draft id ([N_old, ...] for the vocabulary whose membership mask is old_t2d [V])
    re-indexed for the vocabulary new_ids [N_new]: a token in both keeps its row, a new token gets zeros.
    Invariant: for every target token t in both vocabularies, new[new_ids⁻¹(t)] == old[old_ids⁻¹(t)]."""
    src = draft_labels(new_ids.to(rows.device), old_t2d)  # old draft id of each new token, IGNORE_LABEL if none
    out = rows.new_zeros((new_ids.numel(), *rows.shape[1:]))
    kept = src != IGNORE_LABEL
    out[kept] = rows[src[kept]]
    return out
