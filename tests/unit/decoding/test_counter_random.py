"""Counter-based streams (dspark.decoding.counter_random): a request's uniforms behave as a stream (draws handed
out in order, rewindable), every request's draws of a step come from one host hash and one copy to the device and
equal what each stream gives alone (the host hash = `keyed_uniform` on the device), the values are uniform and independent across counters, and a stream never reuses its request's
position-keyed values."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

import dspark.decoding.counter_random as counter_random
from dspark.decoding.batched_accept import acceptance_uniforms
from dspark.decoding.counter_random import (CounterStream, derive_seed, keyed_uniform, signed64, uniform_rows,
                                            uniforms)
from dspark.decoding.sampling import block_uniforms


def test_a_stream_hands_out_its_draws_in_order_and_rewinds():
    whole = uniforms(CounterStream(5, "cpu"), (7,), "cpu")
    one_by_one, stream = [], CounterStream(5, "cpu")
    for _ in range(7):
        one_by_one.append(uniforms(stream, (), "cpu"))
    assert torch.equal(whole, torch.stack(one_by_one)) and stream.counter == 7
    state = stream.get_state()
    after = uniforms(stream, (3,), "cpu")
    stream.set_state(state)
    assert torch.equal(uniforms(stream, (3,), "cpu"), after)
    assert not torch.equal(uniforms(CounterStream(6, "cpu"), (7,), "cpu"), whole)


@pytest.mark.parametrize("n", [6, 200])  # the hash on Python ints (few draws) and on numpy arrays (many)
def test_host_hashed_stream_values_are_keyed_uniform_of_key_and_counter(n):
    stream = CounterStream(9, "cpu")
    stream.take(5)
    drawn = uniforms(stream, (n,), "cpu")
    on_device = keyed_uniform(torch.full((n,), signed64(stream.key)), torch.arange(5, 5 + n))
    assert torch.equal(drawn, on_device)


def test_every_stream_of_a_step_is_drawn_in_one_hash_and_one_copy_and_as_it_would_be_alone(monkeypatch):
    calls = []
    for name in ("stream_values", "on_device"):
        real = getattr(counter_random, name)
        monkeypatch.setattr(counter_random, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    streams = [CounterStream(s, "cpu") for s in (1, 2, 3)]
    streams[1].take(4)  # streams at different counters
    entries, counts = [streams[0], streams[1], streams[0], streams[2]], [3, 2, 1, 5]
    drawn = uniform_rows(entries, counts, "cpu", [torch.float32, torch.float64, torch.float64, torch.float64])
    assert calls == ["stream_values", "on_device"] and [d.shape[0] for d in drawn] == counts
    assert drawn[0].dtype == torch.float32 and drawn[1].dtype == torch.float64
    alone = [CounterStream(s, "cpu") for s in (1, 2, 3)]
    alone[1].take(4)
    first = uniforms(alone[0], (4,), "cpu")  # stream 0's two entries are its draws 0-2 and 3
    assert torch.equal(drawn[2], first[3:]) and torch.equal(drawn[0], (first[:3] * 2**24).floor() / 2**24)
    assert torch.equal(drawn[1], uniforms(alone[1], (2,), "cpu"))
    assert torch.equal(drawn[3], uniforms(alone[2], (5,), "cpu"))


def test_a_generator_and_a_counter_stream_mix_in_one_step():
    g = torch.Generator().manual_seed(0)
    drawn = uniform_rows([g, CounterStream(1, "cpu"), g], [2, 3, 1], "cpu")
    expected = torch.rand(3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert torch.equal(torch.cat([drawn[0], drawn[2]]), expected)
    assert torch.equal(drawn[1], uniforms(CounterStream(1, "cpu"), (3,), "cpu"))


def test_stream_values_are_uniform_and_independent_across_counters():
    u = uniforms(CounterStream(123, "cpu"), (200_000,), "cpu").numpy()
    assert stats.kstest(u, "uniform").pvalue > 1e-3
    pairs = np.histogram2d(u[:-1], u[1:], bins=10)[0]  # consecutive counters: joint of independent uniforms
    assert stats.chisquare(pairs.ravel()).pvalue > 1e-3
    across = uniforms(CounterStream(124, "cpu"), (200_000,), "cpu").numpy()  # neighbouring seeds
    assert abs(np.corrcoef(u, across)[0, 1]) < 0.01
    low = uniforms(CounterStream(7, "cpu"), (100_000,), "cpu", torch.float32)
    assert low.dtype == torch.float32 and float(low.max()) < 1.0 and float(low.min()) >= 0.0


def test_a_stream_never_reuses_its_requests_position_keyed_values():
    seed = 77
    positions = torch.arange(1000)
    by_position = keyed_uniform(torch.full((1000,), signed64(seed)), positions)
    stream = uniforms(CounterStream(seed, "cpu"), (1000,), "cpu")
    assert not set(by_position.tolist()) & set(stream.tolist())
    assert CounterStream(seed, "cpu").key == derive_seed(seed, counter_random.STREAM_TAG) != seed


def test_a_steps_block_and_acceptance_uniforms_are_what_each_request_draws_alone():
    """The engine's drafting step: every request's block uniforms (`block_uniforms`) and acceptance uniforms
    (`acceptance_uniforms`: n_r float32 accept draws, then one float64 next-token draw) in one table each, equal
    to what `uniforms` gives each request's stream alone, in `accept_drafts`' order."""
    gammas, lengths = [3, 1, 2], [2, 0, 2]
    batch = [CounterStream(s, "cpu") for s in (4, 5, 6)]
    block = block_uniforms(batch, gammas, "cpu")
    u, u_next = acceptance_uniforms(batch, lengths, "cpu")
    assert block.shape == (3, 3) and u.shape == (3, 2) and u.dtype == torch.float32 and u_next.shape == (3, 1)
    for r, (seed, g, n) in enumerate(zip((4, 5, 6), gammas, lengths)):
        alone = CounterStream(seed, "cpu")
        assert torch.equal(block[r, :g], uniforms(alone, (g,), "cpu")) and not block[r, g:].any()
        assert torch.equal(u[r, :n], uniforms(alone, (n,), "cpu", torch.float32)) and (u[r, n:] == 1).all()
        assert torch.equal(u_next[r], uniforms(alone, (1,), "cpu"))
