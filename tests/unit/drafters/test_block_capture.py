"""A block drafter's batch-1 passes captured as static-shape graphs (dspark.drafters.block_capture): each traces
as one graph (what a CUDA graph needs); a captured state holds what an eager one holds and proposes what it
proposes (DSpark and DFlash, with and without a context window, updates of 1 to 64 positions and an eager prompt
beyond); batch-1 decoding captures where its core is compiled and gives the target's greedy tokens; a failed
capture warns once and runs eager. Traced with the aot_eager backend (the same graph inductor would compile,
without a C++ build); `make test`'s compiled-core tests run them through inductor."""
import pytest
import torch

import dspark.drafters.block_capture as block_capture
import dspark.drafters.chain_capture as chain_capture
from dspark.drafters import draft_slots
from dspark.decoding.sampling import SamplingParams
from dspark.drafters import DrafterConfig, build_drafter
from tests.tiny_models import build_tiny_model

VOCAB = 32
UPDATES = [5, 1, 3, 4, 2, 30, 4, 1, 70, 2, 64, 3, 130, 2]  # positions per extend_context; > MAX_NEW runs eager;
# past 128 positions a context window of 40 is read gathered (its bucket: 128 columns before the length), past 256
# one of 200 (256 columns)


@pytest.fixture(autouse=True)
def _aot_eager(monkeypatch):
    monkeypatch.setattr(chain_capture, "BACKEND", "aot_eager")


def _drafter(algo: str, context_window: int | None = None):
    target = build_tiny_model(vocab_size=VOCAB, num_layers=3, hidden_size=32)
    torch.manual_seed(0)
    cfg = DrafterConfig(algo=algo, block_size=3, num_layers=2, num_context_layers=2, init_std=0.2,
                        context_window=context_window)
    return target, build_drafter(cfg, target).eval()


def _pair(drafter):
    eager, captured = drafter.new_state(), drafter.new_state()
    eager.captured, captured.captured = False, True
    return eager, captured


def test_each_pass_traces_as_one_graph():
    _, drafter = _drafter("dspark", context_window=40)
    store = draft_slots.store_of(drafter)
    width = drafter.hidden_size * len(drafter.layer_ids)
    slots, keys, values = torch.tensor([2, 0]), store.keys, store.values
    with torch.no_grad():
        torch.compile(block_capture._extend, backend="aot_eager", fullgraph=True)(  # raises on a graph break
            drafter, keys, values, slots, torch.randn(2, 4, width), torch.tensor([0, 3]))
        out = torch.compile(block_capture._hidden, backend="aot_eager", fullgraph=True)(
            drafter, keys, values, slots, 128, torch.tensor([4, 7]), torch.tensor([3, 1]))
        far = torch.compile(block_capture._hidden, backend="aot_eager", fullgraph=True)(  # the gathered window
            drafter, keys, values, slots, 64, torch.tensor([100, 90]), torch.tensor([3, 1]), True)
    assert out.shape == far.shape == (2, drafter.block_len, drafter.hidden_size)


@pytest.mark.parametrize("algo,context_window", [("dspark", None), ("dspark", 40), ("dflash", 40), ("dflash", 200)])
def test_a_captured_state_holds_and_proposes_what_an_eager_one_does(algo, context_window, monkeypatch):
    _, drafter = _drafter(algo, context_window)
    gathered, call = [], chain_capture.call_captured  # per backbone pass: read gathered?
    monkeypatch.setattr(chain_capture, "call_captured", lambda d, fn, *a, **kw: (
        gathered.append(a[-1]) if fn is block_capture._hidden else None) or call(d, fn, *a, **kw))
    eager, captured = _pair(drafter)
    width, gen = drafter.hidden_size * len(drafter.layer_ids), torch.Generator().manual_seed(0)
    updates = UPDATES if context_window == 200 else UPDATES[:12]  # 321 or 189 positions
    for step, n in enumerate(updates):
        features, ids = torch.randn(n, width, generator=gen), torch.randint(0, VOCAB, (n,), generator=gen)
        drafter.extend_context(eager, features, ids)
        drafter.extend_context(captured, features, ids)
        assert eager.length == captured.length
        for a, b in zip(eager.kv, captured.kv):
            torch.testing.assert_close(a.k[:, :a.length], b.k[:, :b.length])
            torch.testing.assert_close(a.v[:, :a.length], b.v[:, :b.length])
        anchor, sp = int(ids[-1]), SamplingParams(temperature=1.0)
        torch.testing.assert_close(block_capture.hidden(drafter, [captured], torch.tensor([anchor]))[0],
                                   drafter.block_hidden(eager, anchor), rtol=1e-5, atol=1e-5)
        want, got = (drafter.propose(s, anchor, 3, sp, torch.Generator().manual_seed(step)) for s in (eager, captured))
        assert torch.equal(want.tokens, got.tokens)
        torch.testing.assert_close(want.probs, got.probs, rtol=1e-5, atol=1e-6)
    assert not drafter.__dict__.get("_block_capture_failed")
    # two passes a step (hidden, propose); past the window's bucket gathered: the last 2 steps with a window of 200
    # (bucket 256) or of 40 (bucket 128)
    assert sum(gathered) == {None: 0, 40: 4, 200: 4}[context_window] and len(gathered) == 2 * len(updates)


def greedy_both_ways(monkeypatch, target, drafter, module, names: tuple[str, ...]):
    """Greedy speculative decoding on an eager core, then on a compiled one (aot_eager), each checked against
    target-only decoding; -> (the compiled run, the calls of module.<names> it made: the eager run makes none)."""
    from dspark.decoding import static_core
    from dspark.decoding.specdec import speculative_generate, target_generate

    monkeypatch.setattr(static_core.DecodeCore, "_compiled_step",
                        lambda self: torch.compile(static_core._step, backend="aot_eager", dynamic=False))
    calls = []
    for name in names:
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    greedy, prompt = SamplingParams(temperature=0), [1, 5, 2, 4, 3]
    reference = target_generate(target, prompt, greedy, 16, stop_ids=[], core_mode="eager").token_ids
    eager = speculative_generate(target, drafter, prompt, greedy, 16, stop_ids=[], core_mode="eager")
    assert eager.token_ids == reference and calls == []
    captured = speculative_generate(target, drafter, prompt, greedy, 16, stop_ids=[], core_mode="compiled")
    assert captured.token_ids == reference
    return captured, calls


def test_batch1_decoding_captures_where_its_core_is_compiled(monkeypatch):
    """Greedy speculative decoding on a compiled core (aot_eager here) drafts through the captured passes and
    gives target-only decoding's tokens; on an eager core it drafts eager."""
    captured, calls = greedy_both_ways(monkeypatch, *_drafter("dspark"), block_capture, ("hidden", "extend"))
    assert calls.count("hidden") == len(captured.rounds) and calls.count("extend") >= len(captured.rounds)


def test_a_failed_capture_warns_once_and_runs_eager(monkeypatch, caplog):
    _, drafter = _drafter("dspark")
    eager, captured = _pair(drafter)
    width = drafter.hidden_size * len(drafter.layer_ids)
    features, ids = torch.randn(6, width, generator=torch.Generator().manual_seed(1)), torch.arange(6)

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(chain_capture, "_compiled", {})
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: broken)
    for state in (eager, captured):
        drafter.extend_context(state, features, ids)
    assert "running its passes eager" in caplog.text and drafter.__dict__["_block_capture_failed"]
    assert not chain_capture.wanted(drafter, [captured], "block")
    for a, b in zip(eager.kv, captured.kv):
        torch.testing.assert_close(a.k[:, :a.length], b.k[:, :b.length])
    sp = SamplingParams(temperature=1.0)
    want, got = (drafter.propose(s, 3, 3, sp, torch.Generator().manual_seed(0)) for s in (eager, captured))
    assert torch.equal(want.tokens, got.tokens)
