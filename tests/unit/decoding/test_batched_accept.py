"""dspark/decoding/batched_accept.py: the batched rejection step gives every row exactly what `accept_drafts`
gives it alone with the same generator (lengths 0..G, greedy and sampled rows, full accepts and rejections),
batched or row by row (a CPU's default), and a mis-shaped row fails alone."""
from __future__ import annotations

import pytest
import torch

from dspark.decoding.batched_accept import accept_rows
from dspark.decoding.sampling import accept_drafts

V = 7


def _row(g: torch.Generator, n: int, peaked: bool):
    """n drafts drawn from q, and target rows p (peaked: q close to p, so most drafts are accepted)."""
    p = torch.softmax(torch.randn(n + 1, V, generator=g) * 2, -1)
    q = torch.softmax(p[:n].log() + (0.1 if peaked else 1.5) * torch.randn(n, V, generator=g), -1)
    x = torch.multinomial(q, 1, generator=g)[:, 0] if n else torch.empty(0, dtype=torch.long)
    return x, q, p


@pytest.mark.parametrize("batched", [True, False])
def test_each_row_is_what_accept_drafts_gives_it_alone(batched):
    g = torch.Generator().manual_seed(0)
    for trial in range(150):
        lengths = torch.randint(0, 5, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
        rows = [_row(g, n, peaked=trial % 2 == 0) for n in lengths]
        seeds = [1000 * trial + r for r in range(len(rows))]
        alone = [accept_drafts(x, q, p, torch.Generator().manual_seed(s)) for (x, q, p), s in zip(rows, seeds)]
        batched = accept_rows([x for x, _, _ in rows], [q for _, q, _ in rows], [p for _, _, p in rows],
                              [torch.Generator().manual_seed(s) for s in seeds], batched=batched)
        assert batched == [tuple(a) for a in alone], (trial, lengths)


def test_greedy_rows_accept_while_the_argmax_matches():
    one_hot = torch.eye(V)
    target = one_hot[[3, 1, 4, 1]]        # the target's argmax at each position
    drafts = torch.tensor([3, 1, 5])      # the third draft misses
    got = accept_rows([drafts, drafts[:2]], [one_hot[drafts], one_hot[drafts[:2]]], [target, target[:3]],
                      [torch.Generator().manual_seed(0)] * 2, batched=True)
    assert got == [(2, 4), (2, 4)]  # 2 accepted, then the target's token; row 2: both accepted, bonus 4


@pytest.mark.parametrize("batched", [True, False])
def test_a_mis_shaped_row_fails_alone(batched):
    x, q, p = _row(torch.Generator().manual_seed(1), 2, peaked=True)
    got = accept_rows([x, torch.tensor([1, 2]), x], [q, torch.rand(2, V), q], [p, torch.rand(2, V), p],
                      [torch.Generator().manual_seed(s) for s in (5, 6, 7)], batched=batched)
    assert isinstance(got[1], ValueError) and "target_probs" in str(got[1])
    assert got[0] == accept_drafts(x, q, p, torch.Generator().manual_seed(5))
    assert got[2] == accept_drafts(x, q, p, torch.Generator().manual_seed(7))
