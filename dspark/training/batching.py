"""Training batches: right-padded collation and length bucketing (issue #13: padding < 10% of tokens).

Every batch is padded to its longest row, so a batch of random rollouts (lengths from a few dozen to
max_seq_len tokens) spends a large share of the target and drafter compute on padding. Bucketing
keeps the data order random at the scale that matters and removes most of it:

    the stream of rows is cut into windows of `window` batches; inside a window the rows are sorted
    by length and re-cut into the same number of equally sized batches, whose order is then shuffled.

Invariants: every row of the input appears exactly once in the output, in a batch of the same size as
the input batches (so step bookkeeping, gradient accumulation and resume-by-index do not change), and
the output depends only on the input order and the seed. Packing (several sequences per row) would
remove the remaining padding but needs per-segment positions and masks in the target forward; with
bucketing the padding is already a few percent at window 8 (benchmarks/train_throughput.py).
"""
from __future__ import annotations

import random
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch


def sequence_limit(max_seq_len: int, target) -> int:
    """Tokens a training sequence is cut to: max_seq_len, or the target's context where that is shorter
    (reported once), so a long row never reaches past the target's positions deep in its forward."""
    context = getattr(target, "max_positions", None) or max_seq_len
    if max_seq_len > context:
        print(f"data.max_seq_len {max_seq_len} exceeds the target's context ({context} positions); "
              "sequences are cut to the target's context", flush=True)
    return min(max_seq_len, context)


def collate(batch: dict, max_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Rows of variable-length `input_ids` / `loss_mask` -> right-padded [B, T] tensors (T <= max_len)
    with the attention mask marking real tokens. Sequences longer than max_len are cut."""
    ids = [np.asarray(x, dtype=np.int64)[:max_len] for x in batch["input_ids"]]
    masks = [np.asarray(x, dtype=np.int64)[:max_len] for x in batch["loss_mask"]]
    width = max(len(x) for x in ids)
    input_ids = torch.full((len(ids), width), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((len(ids), width), dtype=torch.long)
    attention = torch.zeros((len(ids), width), dtype=torch.long)
    for row, (tokens, mask) in enumerate(zip(ids, masks)):
        if len(mask) != len(tokens):
            raise ValueError(f"rollout row has {len(tokens)} input_ids but {len(mask)} loss_mask entries; "
                             "the rollouts are corrupt — regenerate them")
        input_ids[row, :len(tokens)] = torch.from_numpy(tokens)
        loss_mask[row, :len(mask)] = torch.from_numpy(mask)
        attention[row, :len(tokens)] = 1
    return {"input_ids": input_ids, "loss_mask": loss_mask, "attention_mask": attention}


def bucket_window(indices: Sequence[int], lengths: Sequence[int], batch_size: int,
                  rng: random.Random) -> list[list[int]]:
    """One window: `indices` (a multiple of batch_size long) sorted by length, cut into batches of
    `batch_size`, batches in a random order. Ties keep the input order (a stable sort)."""
    if len(indices) % batch_size:
        raise ValueError(f"a bucketing window of {len(indices)} rows is not a multiple of batch_size={batch_size}")
    ordered = sorted(indices, key=lambda i: lengths[i])
    batches = [ordered[i:i + batch_size] for i in range(0, len(ordered), batch_size)]
    rng.shuffle(batches)
    return batches


def bucketed_batches(order: Sequence[int], lengths: Sequence[int], batch_size: int, window: int,
                     seed: int) -> list[list[int]]:
    """Index batches over `order` (rows in their shuffled order; a tail short of a batch is dropped):
    windows of `window` batches, each bucketed by length. window <= 1 keeps the input batches."""
    usable = len(order) - len(order) % batch_size
    if window <= 1:
        return [list(order[i:i + batch_size]) for i in range(0, usable, batch_size)]
    rng, span, out = random.Random(seed), window * batch_size, []
    for start in range(0, usable, span):
        out += bucket_window(order[start:min(start + span, usable)], lengths, batch_size, rng)
    return out


def reshuffled_epoch(batches: Sequence[dict], seed: int) -> list[dict]:
    """The rows of equal-size column batches (a worker's shard kept in memory) in a random order drawn
    from `seed`, re-cut into batches of the same size: an epoch of a worker that replays its shard
    instead of reading it again. Same rows, same batch count and size; the order depends only on the
    set of rows and the seed (rows are put in a canonical order first), not on the order they came in,
    so a resumed run replays an epoch exactly as the run it resumes."""
    if not batches:
        return []
    size = len(batches[0]["input_ids"])
    rows = _columns(batches)
    order = sorted(range(len(rows["input_ids"])), key=lambda i: np.asarray(rows["input_ids"][i]).tobytes())
    random.Random(seed).shuffle(order)
    return [{k: _take(col, order[i:i + size]) for k, col in rows.items()} for i in range(0, len(order), size)]


def regroup_by_length(batches: Iterable[dict], window: int, seed: int) -> Iterator[dict]:
    """Column batches (dicts of equal-length columns, e.g. Ray Data numpy batches) in, the same rows
    regrouped by `bucketed_batches` out: `window` batches are read, bucketed and yielded, then the next.
    A final window with fewer batches is bucketed among itself. window <= 1 passes batches through."""
    if window <= 1:
        yield from batches
        return
    rng, pending = random.Random(seed), []
    for batch in batches:
        pending.append(batch)
        if len(pending) == window:
            yield from _regroup(pending, rng)
            pending = []
    if pending:
        yield from _regroup(pending, rng)


def _regroup(window: list[dict], rng: random.Random) -> list[dict]:
    sizes = {len(b["input_ids"]) for b in window}
    if len(sizes) != 1:  # only a drop_last=False tail can differ: keep such a window as it is
        return window
    rows = _columns(window)
    lengths = [len(x) for x in rows["input_ids"]]
    picks = bucket_window(list(range(len(lengths))), lengths, sizes.pop(), rng)
    return [{k: _take(col, pick) for k, col in rows.items()} for pick in picks]


def _columns(batches: Sequence[dict]) -> dict[str, list]:
    """Column batches -> one list per column, rows in batch order."""
    return {k: [x for b in batches for x in b[k]] for k in batches[0]}


def _take(column: list, pick: list[int]):
    items = [column[i] for i in pick]
    if items and isinstance(items[0], np.ndarray) and items[0].ndim > 0:
        out = np.empty(len(items), dtype=object)  # ragged rows, as Ray Data hands them
        out[:] = items
        return out
    return np.asarray(items) if items and np.isscalar(items[0]) else items


def padding_fraction(batches: Iterable[Sequence[int]], lengths: Sequence[int], max_len: int | None = None) -> float:
    """Share of padding among all positions of the padded [B, T] batches (rows cut at max_len)."""
    real = padded = 0
    for pick in batches:
        lens = [min(lengths[i], max_len) if max_len else lengths[i] for i in pick]
        real += sum(lens)
        padded += max(lens) * len(lens)
    return 1.0 - real / padded if padded else 0.0
