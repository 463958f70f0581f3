"""The drafter's slot store (dspark.drafters.draft_slots) and the captured block passes over it for several
requests at once (dspark.drafters.block_capture): a state joins with its context, keeps it when the store grows,
frees its slot when dropped; a batch of captured states holds, reads and proposes what the same states hold, read
and propose eager, one at a time (prompts beyond a graph's bucket and empty updates mixed in). Traced with
aot_eager (the graph inductor would compile, without a C++ build)."""
import copy
import gc

import pytest
import torch

import dspark.drafters.chain_capture as chain_capture
from dspark.decoding.sampling import SamplingParams
from dspark.drafters import DrafterConfig, block_capture, build_drafter, draft_slots
from tests.tiny_models import build_tiny_model

VOCAB = 32


@pytest.fixture(autouse=True)
def _aot_eager(monkeypatch):
    monkeypatch.setattr(chain_capture, "BACKEND", "aot_eager")


def _drafter(algo="dspark", context_window=None):
    target = build_tiny_model(vocab_size=VOCAB, num_layers=3, hidden_size=32)
    torch.manual_seed(0)
    cfg = DrafterConfig(algo=algo, block_size=3, num_layers=2, num_context_layers=2, init_std=0.2,
                        context_window=context_window)
    return build_drafter(cfg, target).eval()


def _update(drafter, n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    width = drafter.hidden_size * len(drafter.layer_ids)
    return torch.randn(n, width, generator=gen), torch.randint(0, VOCAB, (n,), generator=gen)


def test_a_state_joins_with_its_context_keeps_it_as_the_store_grows_and_frees_its_slot():
    drafter = _drafter()
    states = [drafter.new_state() for _ in range(draft_slots.FIRST_SLOTS + 1)]
    for r, state in enumerate(states):  # eager contexts of different lengths, before joining
        drafter.extend_context(state, *_update(drafter, 3 + r, r))
    before = [[(b.k[:, :b.length].clone(), b.v[:, :b.length].clone()) for b in s.kv] for s in states]
    slots = [draft_slots.bind(drafter, s) for s in states]  # the fifth doubles the store
    store = draft_slots.store_of(drafter)
    assert sorted(slots) == list(range(5)) and store.slots == 2 * draft_slots.FIRST_SLOTS
    store.reserve(store.capacity + 1)  # more columns: copied too
    assert store.capacity == 2 * draft_slots.CHUNK
    for state, held in zip(states, before):
        assert all(isinstance(b, draft_slots.SlotKVBuffer) for b in state.kv)
        for buf, (k, v) in zip(state.kv, held):
            assert torch.equal(buf.k[:, :buf.length], k) and torch.equal(buf.v[:, :buf.length], v)
    drafter.extend_context(states[0], *_update(drafter, 2, 9))  # eager appends land in the store
    reference = drafter.new_state()  # the same two updates on plain buffers
    for n, seed in ((3, 0), (2, 9)):
        drafter.extend_context(reference, *_update(drafter, n, seed))
    assert states[0].length == states[0].kv[0].length == 5
    for layer, buf in enumerate(reference.kv):
        assert torch.equal(store.keys[layer][slots[0], :, :5], buf.k[:, :5])
        assert torch.equal(store.values[layer][slots[0], :, :5], buf.v[:, :5])
    copied = copy.deepcopy(states[1])  # a copy leaves the store with the same context (a tree search's branch)
    assert not isinstance(copied.kv[0], draft_slots.SlotKVBuffer) and copied.length == states[1].length
    assert torch.equal(copied.kv[0].k[:, :copied.length], states[1].kv[0].k[:, :copied.length])
    drafter.reserve_capture_slots(12)  # up front (the engine: one per core slot): contents kept, free ones first
    assert store.slots == 12 and torch.equal(store.keys[0][slots[0], :, :5], reference.kv[0].k[:, :5])
    assert store.free[-3:] == [7, 6, 5] and store.free[:4] == [11, 10, 9, 8]
    gone = slots[2]
    del states[2], state
    gc.collect()
    assert gone in store.free
    store.keys[0][gone].fill_(float("nan"))  # whatever its last request left there
    assert draft_slots.bind(drafter, drafter.new_state()) == gone and not store.keys[0][gone].isnan().any()


@pytest.mark.parametrize("context_window", [None, 40])
def test_a_captured_batch_holds_reads_and_proposes_what_each_eager_state_does(context_window, monkeypatch):
    drafter = _drafter(context_window=context_window)
    gathered, call = [], chain_capture.call_captured  # per backbone pass: read gathered?
    monkeypatch.setattr(chain_capture, "call_captured", lambda d, fn, *a, **kw: (
        gathered.append(a[-1]) if fn is block_capture._hidden else None) or call(d, fn, *a, **kw))
    eager, captured = [drafter.new_state() for _ in range(5)], [drafter.new_state() for _ in range(5)]
    for s in eager:
        s.captured = False
    for s in captured:
        s.captured = True
    rounds = [[3, 0, 70, 1, 5], [140, 150, 2, 200, 130], [2, 1, 3, 4, 64]]  # then rows past 128: gathered, and
    # row 2 (72, then 75 positions) read from its first columns in the same pass
    for step, counts in enumerate(rounds):
        updates = [_update(drafter, n, 10 * step + r) for r, n in enumerate(counts)]
        drafter.extend_contexts(eager, [f for f, _ in updates], [i for _, i in updates])
        drafter.extend_contexts(captured, [f for f, _ in updates], [i for _, i in updates])
        for a_state, b_state in zip(eager, captured):
            assert a_state.length == b_state.length
            for a, b in zip(a_state.kv, b_state.kv):
                if a.k is None:  # nothing held yet (an eager buffer allocates on its first append)
                    assert b.length == 0
                    continue
                torch.testing.assert_close(a.k[:, :a.length], b.k[:, :b.length])
                torch.testing.assert_close(a.v[:, :a.length], b.v[:, :b.length])
        anchors = torch.tensor([int(i[-1]) if len(i) else 1 for _, i in updates])
        got = block_capture.hidden(drafter, captured, anchors)
        for r, state in enumerate(eager):
            torch.testing.assert_close(got[r], drafter.block_hidden(state, int(anchors[r])), rtol=1e-5, atol=1e-5)
        sp = [SamplingParams(temperature=1.0)] * 5
        want, have = (drafter.propose_batch(states, anchors.tolist(), 3, sp,
                                            [torch.Generator().manual_seed(step * 5 + r) for r in range(5)])
                      for states in (eager, captured))
        for a, b in zip(want, have):
            assert torch.equal(a.tokens, b.tokens)
            torch.testing.assert_close(a.probs, b.probs, rtol=1e-5, atol=1e-6)
    assert not chain_capture.fell_back(drafter)
    # two backbone passes a round (hidden, propose_batch); with a window of 40 (bucket 128), the last two rounds
    assert gathered == [False] * 2 + [context_window is not None] * 4
