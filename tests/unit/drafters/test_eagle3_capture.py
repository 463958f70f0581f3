"""Eagle3's passes captured as static-shape graphs over the slot store (dspark.drafters.eagle3_capture): each traces
as one graph (what a CUDA graph needs); a captured state holds what an eager one holds (K/V columns, the last fused
feature) and proposes what it proposes (tokens and probabilities; a stream or a keyed (seeded) request, a draft
vocabulary, updates of 1 to 64 positions and an eager prompt beyond), alone and as a batch of requests of
different lengths drafted by one pass; batch-1 decoding captures Eagle3 where its
core is compiled and gives the target's greedy tokens. Traced with the aot_eager backend (the same graph inductor
would compile, without a C++ build)."""
import pytest
import torch

import dspark.drafters.chain_capture as chain_capture
import dspark.drafters.eagle3_capture as eagle3_capture
from dspark.decoding.counter_random import CounterStream
from dspark.decoding.sampling import KeyedNoise, SamplingParams
from dspark.drafters import DrafterConfig, build_drafter, draft_slots
from tests.tiny_models import build_tiny_model

VOCAB = 32
# positions per extend_context: 70 and 900 > MAX_NEW run eager; in full (the first case) the context passes windows
# of 128, 256 and 2048 columns and the buffers grow past their first chunk of 1024 (new graphs, new buffers); the
# other cases stop at 122 positions
UPDATES = [5, 1, 3, 4, 2, 30, 4, 1, 70, 2, 64, 3, 900, 7]
DRAFT_IDS = [0, 2, 3, 5, 7, 11, 13, 17]
T1, TOP5 = SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=5)


@pytest.fixture(autouse=True)
def _aot_eager(monkeypatch):
    monkeypatch.setattr(chain_capture, "BACKEND", "aot_eager")


def _drafter(draft_ids: list[int] | None = None):
    target = build_tiny_model(vocab_size=VOCAB, num_layers=3, hidden_size=32)
    torch.manual_seed(0)
    cfg = DrafterConfig(algo="eagle3", block_size=4, num_context_layers=2, init_std=0.2,
                        draft_vocab_size=None if draft_ids is None else len(draft_ids))
    return target, build_drafter(cfg, target, draft_ids=None if draft_ids is None else torch.tensor(draft_ids)).eval()


def test_each_pass_traces_as_one_graph():
    _, drafter = _drafter()
    width, d = drafter.hidden_size * len(drafter.layer_ids), drafter.hidden_size
    store = draft_slots.store_of(drafter)
    slots, keys, values = torch.tensor([3, 1]), store.keys, store.values
    params = chain_capture.ChainParams.of(SamplingParams(temperature=1.0))
    with torch.no_grad():
        fused = torch.compile(eagle3_capture._context_update, backend="aot_eager", fullgraph=True)(  # raises on a break
            drafter, keys, values, slots, torch.randn(2, 4, width), torch.arange(8).view(2, 4), torch.zeros(2, d),
            torch.tensor([0, 5]))
        tokens, probs = torch.compile(eagle3_capture._draft_steps, backend="aot_eager", fullgraph=True)(
            drafter, keys, values, slots, 128, torch.tensor([4, 9]), torch.tensor([3, 1]), fused[:, -1:],
            torch.rand(2, 4), params, None, None)
    assert tokens.shape == (2, 4) and probs.shape == (2, 4, VOCAB)


def _rng(kind: str, step: int, drafter):
    if kind == "keyed":
        noise = KeyedNoise(seed=step, vocab_size=VOCAB, device="cpu", columns=drafter.draft_ids)
        noise.cursor = 3 * step
        return noise
    return CounterStream(100 + step, "cpu")


@pytest.mark.parametrize("kind,draft_ids,sp", [("stream", None, T1), ("keyed", None, T1), ("keyed", DRAFT_IDS, T1),
                                              ("stream", DRAFT_IDS, TOP5)])
def test_a_captured_state_holds_and_proposes_what_an_eager_one_does(kind, draft_ids, sp):
    _, drafter = _drafter(draft_ids)
    eager, captured = drafter.new_state(), drafter.new_state()
    eager.captured, captured.captured = False, True
    width, gen = drafter.hidden_size * len(drafter.layer_ids), torch.Generator().manual_seed(0)
    long = (kind, draft_ids, sp) == ("stream", None, T1)
    for step, n in enumerate(UPDATES if long else UPDATES[:10]):
        features, ids = torch.randn(n, width, generator=gen), torch.randint(0, VOCAB, (n,), generator=gen)
        drafter.extend_context(eager, features, ids)
        drafter.extend_context(captured, features, ids)
        assert eager.length == captured.length == eager.kv[0].length == captured.kv[0].length
        torch.testing.assert_close(eager.kv[0].k[:, :eager.length], captured.kv[0].k[:, :captured.length])
        torch.testing.assert_close(eager.kv[0].v[:, :eager.length], captured.kv[0].v[:, :captured.length])
        torch.testing.assert_close(eager.last_fused, captured.last_fused)
        anchor = int(ids[-1])
        rngs = [_rng(kind, step, drafter) for _ in range(2)]
        want, got = (drafter.propose(s, anchor, 4, sp, rng) for s, rng in zip((eager, captured), rngs))
        assert torch.equal(want.tokens, got.tokens)
        torch.testing.assert_close(want.probs, got.probs, rtol=1e-5, atol=1e-6)
        if kind == "keyed":
            assert rngs[0].cursor == rngs[1].cursor == 3 * step + 4  # each drew its 4 positions
    chunks = captured.kv[0].k.shape[-2] / draft_slots.CHUNK  # preallocated in chunks
    assert chunks == (2 if long else 1)  # and regrown past the first
    assert not drafter.__dict__.get("_block_capture_failed")


def test_batch1_eagle3_decoding_captures_where_its_core_is_compiled(monkeypatch):
    """Greedy speculative decoding on a compiled core (aot_eager here) drafts Eagle3 through the captured passes
    and gives target-only decoding's tokens; on an eager core it drafts eager."""
    from tests.unit.drafters.test_block_capture import greedy_both_ways

    captured, calls = greedy_both_ways(monkeypatch, *_drafter(), eagle3_capture, ("draft_captured", "extend_captured"))
    assert calls.count("draft_captured") == len(captured.rounds)
    assert calls.count("extend_captured") >= len(captured.rounds)


@pytest.mark.parametrize("kind", ["stream", "keyed"])
def test_a_captured_batch_holds_and_proposes_what_each_eager_request_does(kind, monkeypatch):
    """Three requests of different lengths (one update a prompt beyond a graph, one empty) extended and drafted
    together: each captured row is the eager request's, drafted alone."""
    _, drafter = _drafter(DRAFT_IDS if kind == "keyed" else None)
    rows, extended, draft, extend = [], [], eagle3_capture.draft_captured, eagle3_capture.extend_captured
    monkeypatch.setattr(eagle3_capture, "draft_captured", lambda d, states, *a: rows.append(len(states)) or
                        draft(d, states, *a))
    monkeypatch.setattr(eagle3_capture, "extend_captured", lambda d, states, *a: extended.append(len(states)) or
                        extend(d, states, *a))
    eager, captured = [drafter.new_state() for _ in range(3)], [drafter.new_state() for _ in range(3)]
    for e, c in zip(eager, captured):
        e.captured, c.captured = False, True
    width, gen = drafter.hidden_size * len(drafter.layer_ids), torch.Generator().manual_seed(0)
    for step, counts in enumerate([[5, 70, 1], [2, 0, 3], [64, 1, 2]]):
        updates = [(torch.randn(n, width, generator=gen), torch.randint(0, VOCAB, (n,), generator=gen))
                   for n in counts]
        for states in (eager, captured):
            drafter.extend_contexts(states, [f for f, _ in updates], [i for _, i in updates])
        for e, c in zip(eager, captured):
            assert e.length == c.length
            torch.testing.assert_close(e.kv[0].k[:, :e.length], c.kv[0].k[:, :c.length])
            torch.testing.assert_close(e.last_fused, c.last_fused)
        anchors = [int(i[-1]) if len(i) else 1 for _, i in updates]
        alone = [drafter.propose(s, a, 4, T1, _rng(kind, 10 * step + r, drafter))
                 for r, (s, a) in enumerate(zip(eager, anchors))]
        together = drafter.propose_batch(captured, anchors, 4, [T1] * 3,
                                         [_rng(kind, 10 * step + r, drafter) for r in range(3)])
        for want, got in zip(alone, together):
            assert torch.equal(want.tokens, got.tokens)
            torch.testing.assert_close(want.probs, got.probs, rtol=1e-5, atol=1e-6)
    assert not chain_capture.fell_back(drafter) and rows == [3, 3, 3]  # one captured pass drafted all three
    assert extended == [2, 2, 3]  # one captured update for a round's short updates (70 ran eager, 0 nothing)
