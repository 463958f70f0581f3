"""dspark/decoding/batched_accept.py: the batched rejection step gives every row exactly what `accept_drafts`
gives it alone with the same generator (lengths 0..G, greedy and sampled rows, full accepts and rejections),
batched or row by row (a CPU's default), and a mis-shaped row fails alone; the keyed rows of seeded requests
(`accept_keyed_rows`) get exactly `accept_keyed`'s pair with one host read for all of them."""
from __future__ import annotations

import pytest
import torch

from dspark.decoding.batched_accept import accept_keyed_rows, accept_rows
from dspark.decoding.sampling import KeyedNoise, accept_drafts, accept_keyed

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


def test_the_next_token_is_drawn_from_bit_identical_numbers(monkeypatch):
    """49,152 columns, 8 rows that mostly reject: the cumulative sums the next token is drawn from are the same
    bits row by row and batched (dividing by a total summed over [R, V] changes the last bits, which flips a
    token about once in 4e4 rejections: too rare to see by comparing tokens, so the inputs are compared)."""
    import dspark.decoding.batched_accept as batched_accept
    import dspark.decoding.sampling as sampling

    seen = {"row": [], "batched": []}
    real = sampling.inverse_cdf

    def recording(kind):
        def inverse_cdf(probs, u):
            seen[kind] += list(zip(probs.double().cumsum(-1), u))
            return real(probs, u)
        return inverse_cdf

    g = torch.Generator().manual_seed(3)
    vocab, rows = 49152, 8
    p = torch.softmax(torch.randn(rows, 2, vocab, generator=g) * 3, -1)
    q = torch.softmax(torch.randn(rows, 1, vocab, generator=g) * 3, -1)
    x = torch.multinomial(q[:, 0], 1, generator=g)
    monkeypatch.setattr(sampling, "inverse_cdf", recording("row"))
    alone = [accept_drafts(x[r], q[r], p[r], torch.Generator().manual_seed(r)) for r in range(rows)]
    monkeypatch.setattr(batched_accept, "inverse_cdf", recording("batched"))
    got = accept_rows(list(x), list(q), list(p), [torch.Generator().manual_seed(r) for r in range(rows)],
                      batched=True)
    assert got == [tuple(a) for a in alone] and sum(n for n, _ in got) < rows  # some rows rejected
    assert len(seen["row"]) == len(seen["batched"]) == rows
    for (cdf_row, u_row), (cdf_batched, u_batched) in zip(seen["row"], seen["batched"]):
        assert torch.equal(cdf_row, cdf_batched) and torch.equal(u_row, u_batched)


def test_a_row_failing_after_the_draws_leaves_the_other_rows_as_alone():
    """A draft id outside the vocabulary fails inside the batched computation, after every stream was drawn
    from: the streams are rewound, so the good rows still get exactly their tokens alone."""
    x, q, p = _row(torch.Generator().manual_seed(2), 3, peaked=False)
    got = accept_rows([x, torch.tensor([0, V + 5, 1]), x], [q, q, q], [p, p, p],
                      [torch.Generator().manual_seed(s) for s in (5, 6, 7)], batched=True)
    assert isinstance(got[1], IndexError)
    assert got[0] == accept_drafts(x, q, p, torch.Generator().manual_seed(5))
    assert got[2] == accept_drafts(x, q, p, torch.Generator().manual_seed(7))


def test_keyed_rows_are_what_accept_keyed_gives_each_alone(monkeypatch):
    g = torch.Generator().manual_seed(1)
    for trial in range(60):
        lengths = torch.randint(0, 5, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
        rows = [_row(g, n, peaked=trial % 2 == 0) for n in lengths]
        noises = [KeyedNoise(seed=trial * 10 + r, vocab_size=V, device="cpu") for r in range(len(rows))]
        positions = [int(torch.randint(0, 50, (1,), generator=g)) for _ in rows]
        for r, (x, q, p) in enumerate(rows):  # half the rows draft the target's own keyed tokens: long accepts
            if r % 2:
                x[:] = noises[r].argmax(p, list(range(positions[r], positions[r] + len(x) + 1)))[:len(x)]
        alone = [accept_keyed(x, p, noise, at) for (x, _, p), noise, at in zip(rows, noises, positions)]
        reads = []
        real_tolist = torch.Tensor.tolist
        monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(1) or real_tolist(t))
        got = accept_keyed_rows([x.tolist() for x, _, _ in rows], [p for _, _, p in rows], noises, positions)
        monkeypatch.undo()
        assert got == alone and len(reads) == 1 + len(rows)  # the drafts' own .tolist() above, then one read


def test_a_mis_shaped_keyed_row_fails_alone():
    p = torch.softmax(torch.randn(3, V), -1)
    noise = KeyedNoise(seed=5, vocab_size=V, device="cpu")
    got = accept_keyed_rows([[1, 2], [1, 2]], [p, p[:, :4]], [noise, noise], [0, 0])
    assert got[0] == accept_keyed(torch.tensor([1, 2]), p, noise, 0) and isinstance(got[1], Exception)
