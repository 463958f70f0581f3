"""A drafted block's random draws (`dspark.drafters.base.BlockDraws`, `sampling.block_uniforms`): drawing the
whole block's uniforms up front gives each request exactly the tokens that drawing position by position from
its own stream gives, for mixed γs, a draft vocabulary's columns and a batch of one with a shared stream."""
import pytest
import torch

from dspark.decoding.sampling import KeyedNoise, block_uniforms, rows_generators, sample
from dspark.drafters.base import BlockDraws, drafting_rows


def _per_position(probs, gammas, generator):
    """The reference: position by position, only the requests still drafting, each from its stream."""
    tokens = torch.full(probs.shape[:2], -1, dtype=torch.long)
    for k in range(probs.shape[1]):
        live, gens = drafting_rows(gammas, k, generator, probs.device)
        tokens[live, k] = sample(probs[live, k], gens)
    return tokens


def _up_front(probs, gammas, generator):
    tokens = torch.full(probs.shape[:2], -1, dtype=torch.long)
    draws = BlockDraws(generator, gammas, probs.device)
    assert draws.uniforms is not None
    for k in range(probs.shape[1]):
        live, drawn = draws.draw(probs[:, k], k)
        tokens[live, k] = drawn
    return tokens


def _probs(rows, width, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    probs = torch.rand(rows, width, vocab, generator=g) ** 4  # peaked rows
    probs[0, :, 3:] = 0  # a row with little support
    return probs / probs.sum(-1, keepdim=True)


@pytest.mark.parametrize("gammas", [[4, 4, 4], [4, 1, 3, 2], [2], [1, 4]])
@pytest.mark.parametrize("vocab", [7, 4096])
def test_per_request_streams_give_the_per_position_tokens(gammas, vocab):
    probs = _probs(len(gammas), max(gammas), vocab, seed=len(gammas) + vocab)
    for seed in range(5):
        streams = lambda: [torch.Generator().manual_seed(seed * 100 + r) for r in range(len(gammas))]  # noqa: E731
        want, got = _per_position(probs, gammas, streams()), _up_front(probs, gammas, streams())
        for r, g in enumerate(gammas):  # positions past γ_r are never returned
            assert torch.equal(got[r, :g], want[r, :g])


def test_a_batch_of_one_with_a_shared_stream_draws_as_before():
    probs = _probs(1, 5, 50, seed=3)
    for seed in range(5):
        want = _per_position(probs, [5], torch.Generator().manual_seed(seed))
        got = _up_front(probs, [5], torch.Generator().manual_seed(seed))
        assert torch.equal(got, want)


def test_the_streams_are_left_where_per_position_draws_leave_them():
    """The acceptance step draws from the same streams next: it must see the same state."""
    gammas = [3, 1, 2]
    a = [torch.Generator().manual_seed(r) for r in range(3)]
    b = [torch.Generator().manual_seed(r) for r in range(3)]
    probs = _probs(3, 3, 11, seed=0)
    _per_position(probs, gammas, a)
    _up_front(probs, gammas, b)
    assert [torch.rand(1, generator=g).item() for g in a] == [torch.rand(1, generator=g).item() for g in b]


def test_uniforms_are_request_major_and_zero_past_each_gamma():
    u = block_uniforms(torch.Generator().manual_seed(0), [2, 3], "cpu")
    flat = torch.rand(5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert torch.equal(u, torch.tensor([[flat[0], flat[1], 0.0], [flat[2], flat[3], flat[4]]], dtype=torch.float64))
    with pytest.raises(ValueError, match="one per request"):
        block_uniforms([torch.Generator()], [1, 2], "cpu")


def test_keyed_requests_are_drawn_by_position():
    keyed = KeyedNoise(seed=7, vocab_size=9, device="cpu")
    assert block_uniforms([torch.Generator(), keyed], [2, 2], "cpu") is None
    draws = BlockDraws([torch.Generator().manual_seed(0), keyed], [2, 1], "cpu")
    probs = _probs(2, 2, 9, seed=1)
    live, drawn = draws.draw(probs[:, 1], 1)  # position 1: only request 0 drafts it
    assert live.tolist() == [0] and drawn.shape == (1,)
    assert rows_generators(keyed, [2]) is keyed
