"""A drafted block's random draws (`dspark.drafters.base.BlockDraws`, `sampling.block_uniforms`): drawing the
streams' uniforms up front gives each request exactly the tokens that drawing position by position gives on a
CPU stream (mixed γs, a batch of one sharing a stream, keyed requests beside streamed ones) and leaves each
stream where per-position draws leave it; through the drafters too (DSpark's Markov and RNN heads, Eagle3, a
draft vocabulary)."""
import pytest
import torch

from dspark.decoding.sampling import KeyedNoise, SamplingParams, block_uniforms
from dspark.drafters import DrafterConfig, build_drafter
from dspark.drafters.base import BlockDraws
from tests.tiny_models import build_tiny_model


def _drawn(probs, gammas, generator, up_front: bool, monkeypatch):
    """Tokens [R, G] (-1 where a request does not draft) from BlockDraws, up front or position by position."""
    monkeypatch.setattr(BlockDraws, "up_front", up_front)
    tokens = torch.full(probs.shape[:2], -1, dtype=torch.long)
    draws = BlockDraws(generator, gammas, probs.device)
    assert (draws.uniforms is not None) == up_front
    for k in range(probs.shape[1]):
        live, drawn = draws.draw(probs[:, k], k)
        tokens[live, k] = drawn
    return [tokens[r, :g].tolist() for r, g in enumerate(gammas)]  # positions past γ_r are never returned


def _probs(rows, width, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    probs = torch.rand(rows, width, vocab, generator=g) ** 4  # peaked rows
    probs[0, :, 3:] = 0  # a row with little support
    return probs / probs.sum(-1, keepdim=True)


@pytest.mark.parametrize("gammas", [[4, 4, 4], [4, 1, 3, 2], [2], [1, 4]])
@pytest.mark.parametrize("vocab", [7, 4096])
def test_per_request_streams_give_the_per_position_tokens(monkeypatch, gammas, vocab):
    probs = _probs(len(gammas), max(gammas), vocab, seed=len(gammas) + vocab)
    for seed in range(5):
        streams = lambda: [torch.Generator().manual_seed(seed * 100 + r) for r in range(len(gammas))]  # noqa: E731
        assert _drawn(probs, gammas, streams(), True, monkeypatch) == _drawn(probs, gammas, streams(), False,
                                                                             monkeypatch)


def test_a_batch_of_one_with_a_shared_stream_draws_as_before(monkeypatch):
    probs = _probs(1, 5, 50, seed=3)
    for seed in range(5):
        assert _drawn(probs, [5], torch.Generator().manual_seed(seed), True, monkeypatch) == \
            _drawn(probs, [5], torch.Generator().manual_seed(seed), False, monkeypatch)


def test_the_streams_are_left_where_per_position_draws_leave_them(monkeypatch):
    """The acceptance step draws from the same streams next: it must see the same state."""
    gammas, probs = [3, 1, 2], _probs(3, 3, 11, seed=0)
    a = [torch.Generator().manual_seed(r) for r in range(3)]
    b = [torch.Generator().manual_seed(r) for r in range(3)]
    _drawn(probs, gammas, a, False, monkeypatch)
    _drawn(probs, gammas, b, True, monkeypatch)
    assert [torch.rand(1, generator=g).item() for g in a] == [torch.rand(1, generator=g).item() for g in b]


def test_keyed_requests_beside_streamed_ones_draw_by_their_key(monkeypatch):
    """A keyed request is drawn by its key at each position it drafts; the streamed requests beside it still
    draw up front, exactly as position by position."""
    gammas, probs = [3, 2, 3], _probs(3, 3, 9, seed=1)

    def generators():
        return [torch.Generator().manual_seed(0), KeyedNoise(seed=7, vocab_size=9, device="cpu"),
                torch.Generator().manual_seed(2)]

    keyed = generators()
    up_front = _drawn(probs, gammas, keyed, True, monkeypatch)
    assert up_front == _drawn(probs, gammas, generators(), False, monkeypatch)
    assert keyed[1].cursor == 2  # drew its 2 positions, by key
    u = block_uniforms(generators(), gammas, "cpu")
    assert u.shape == (3, 3) and bool((u[1] == 0).all()) and bool((u[0] > 0).all())


def test_uniforms_are_request_major_and_zero_past_each_gamma():
    u = block_uniforms(torch.Generator().manual_seed(0), [2, 3], "cpu")
    flat = torch.rand(5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert torch.equal(u, torch.tensor([[flat[0], flat[1], 0.0], [flat[2], flat[3], flat[4]]], dtype=torch.float64))
    with pytest.raises(ValueError, match="one per request"):
        block_uniforms([torch.Generator()], [1, 2], "cpu")


@pytest.mark.parametrize("algo,head,draft_ids", [("dspark", "rnn", [0, 2, 3, 5, 7, 9, 11, 12]),
                                                 ("dspark", "markov", None), ("eagle3", "markov", [1, 2, 4, 8, 9])])
def test_drafters_propose_the_same_tokens_either_way(monkeypatch, algo, head, draft_ids):
    target = build_tiny_model(vocab_size=16)
    torch.manual_seed(0)
    kw = {} if algo == "eagle3" else {"num_layers": 2}
    cfg = DrafterConfig(algo=algo, head=head, rank=8, block_size=4, ttt_steps=4,
                        draft_vocab_size=None if draft_ids is None else len(draft_ids), **kw)
    drafter = build_drafter(cfg, target, draft_ids=None if draft_ids is None else torch.tensor(draft_ids)).eval()
    ids = torch.randint(0, 16, (3, 8), generator=torch.Generator().manual_seed(4))
    feats = target.forward(ids, layer_ids=drafter.layer_ids, logits_at=None).features
    states = []
    for r in range(3):
        states.append(drafter.new_state())
        drafter.extend_context(states[-1], feats[r, :7], ids[r, :7])
    gammas, sps = [4, 2, 3], [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4),
                              SamplingParams(temperature=0)]
    out = {}
    for up_front in (True, False):
        monkeypatch.setattr(BlockDraws, "up_front", up_front)
        streams = [torch.Generator().manual_seed(10 + r) for r in range(3)]
        out[up_front] = [p.tokens.tolist() for p in drafter.propose_batch(states, ids[:, 7].tolist(), gammas, sps,
                                                                           streams)]
    assert out[True] == out[False] and [len(t) for t in out[True]] == gammas
    if draft_ids is not None:
        assert all(t in draft_ids for row in out[True] for t in row)


def test_several_keyed_requests_draw_a_position_together_as_each_would_alone(monkeypatch):
    """Keyed rows drafting position k are drawn in one argmax (`draw_keyed_rows`): the same tokens as each
    request's own position-by-position draws, and each cursor ends after its own γ."""
    gammas, probs = [3, 1, 3, 2], _probs(4, 3, 9, seed=5)

    def generators():
        return [KeyedNoise(seed=7, vocab_size=9, device="cpu"), KeyedNoise(seed=8, vocab_size=9, device="cpu"),
                torch.Generator().manual_seed(2), KeyedNoise(seed=9, vocab_size=9, device="cpu")]

    together = generators()
    assert _drawn(probs, gammas, together, True, monkeypatch) == _drawn(probs, gammas, generators(), False,
                                                                         monkeypatch)
    assert [together[i].cursor for i in (0, 1, 3)] == [3, 1, 2]
