"""DSpark's γ-loop captured as one graph (dspark.drafters.chain_capture): it traces without a graph break (what a
CUDA graph needs), and the captured loop proposes exactly what the eager loop proposes from the same streams
(Markov and RNN heads, confidences, a draft vocabulary, a batch padded to a power of two, greedy and sampled, keyed
(seeded) rows beside stream rows);
if capturing fails the drafter warns once and drafts eager. Traced with the aot_eager backend (the same graph
inductor would compile, without a C++ build)."""
import pytest
import torch

import dspark.drafters.chain_capture as chain_capture
from dspark.decoding.counter_random import CounterStream
from dspark.decoding.sampling import KeyedNoise, SamplingParams
from dspark.drafters.base import BlockDraws, RowSampling
from dspark.drafters import DrafterConfig, build_drafter
from tests.tiny_models import build_tiny_model

VOCAB = 16


def _drafter_and_states(head: str, draft_ids: list[int] | None, rows: int = 3):
    target = build_tiny_model(vocab_size=VOCAB)
    torch.manual_seed(0)
    cfg = DrafterConfig(algo="dspark", head=head, rank=8, block_size=4, num_layers=2,
                        draft_vocab_size=None if draft_ids is None else len(draft_ids))
    drafter = build_drafter(cfg, target, draft_ids=None if draft_ids is None else torch.tensor(draft_ids)).eval()
    ids = torch.randint(0, VOCAB, (rows, 8), generator=torch.Generator().manual_seed(4))
    feats = target.forward(ids, layer_ids=drafter.layer_ids, logits_at=None).features
    states = []
    for r in range(rows):
        states.append(drafter.new_state())
        drafter.extend_context(states[-1], feats[r, :7], ids[r, :7])
    return drafter, states, ids[:, 7].tolist()


def _propose(drafter, states, anchors, gammas, sp):
    streams = [CounterStream(10 + r, "cpu") for r in range(len(states))]
    return drafter.propose_batch(states, anchors, gammas, sp, streams)


def _capture_on(monkeypatch) -> list:
    monkeypatch.setattr(chain_capture, "BACKEND", "aot_eager")
    monkeypatch.setattr(chain_capture, "wanted", lambda d, states=(), part="chain": part == "chain")
    calls, real = [], chain_capture.run
    monkeypatch.setattr(chain_capture, "run", lambda *a: calls.append(a[1].shape[0]) or real(*a))
    return calls


def _mixed_streams(drafter) -> list:
    keyed = [KeyedNoise(seed, VOCAB, "cpu", drafter.draft_ids) for seed in (21, 22)]
    keyed[0].cursor = 5
    return [CounterStream(10, "cpu"), keyed[0], CounterStream(12, "cpu"), keyed[1]]


@pytest.mark.parametrize("keyed", [False, True])
def test_the_loop_traces_as_one_graph(keyed):
    drafter, _, _ = _drafter_and_states("rnn", None)
    gen = torch.Generator().manual_seed(0)
    u, h = torch.randn(4, 3, VOCAB, generator=gen), torch.randn(4, 3, drafter.hidden_size, generator=gen)
    anchors, uniforms = torch.tensor([1, 2, 3, 4]), torch.rand(4, 3, generator=gen, dtype=torch.float64)
    noise = torch.randn(4, 3, VOCAB, generator=gen, dtype=torch.float64) if keyed else None
    rows = torch.tensor([[False] * 3, [True] * 3, [False] * 3, [True, True, False]]) if keyed else None
    params = chain_capture.ChainParams.of(SamplingParams(temperature=0.8, top_k=5))
    whole = torch.compile(chain_capture.chain_from_uniforms, backend="aot_eager", fullgraph=True)  # raises on a break
    with torch.no_grad():
        traced, eager = (f(drafter, u, h, anchors, uniforms, params, noise, rows)
                         for f in (whole, chain_capture.chain_from_uniforms))
    assert all(torch.equal(a, b) for a, b in zip(traced, eager))


@pytest.mark.parametrize("head,draft_ids", [("markov", None), ("rnn", [0, 2, 3, 5, 7, 9, 11, 12])])
@pytest.mark.parametrize("sp", [SamplingParams(temperature=1.0), SamplingParams(temperature=0)])
def test_the_captured_loop_proposes_what_the_eager_loop_proposes(monkeypatch, head, draft_ids, sp):
    drafter, states, anchors = _drafter_and_states(head, draft_ids)
    gammas = [4, 2, 3]
    eager = _propose(drafter, states, anchors, gammas, sp)
    calls = _capture_on(monkeypatch)
    captured = _propose(drafter, states, anchors, gammas, sp)
    assert calls == [3] and not drafter.__dict__.get("_chain_capture_failed")  # 3 rows (4 inside), no fallback
    for a, b in zip(eager, captured):
        assert torch.equal(a.tokens, b.tokens)
        # the padded 4-row matmuls may round a last bit differently from the 3-row eager ones (the confidences did,
        # once another test in the worker had changed the thread count): q and confidences to float32's precision
        torch.testing.assert_close(a.probs, b.probs, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(a.confidences, b.confidences, rtol=1e-6, atol=1e-7)
    assert [len(p.tokens) for p in captured] == gammas


@pytest.mark.parametrize("head,draft_ids", [("markov", None), ("rnn", [0, 2, 3, 5, 7, 9, 11, 12])])
def test_keyed_rows_are_captured_with_the_tokens_and_cursors_of_their_keyed_draws(monkeypatch, head, draft_ids):
    """Seeded requests (KeyedNoise) beside stream rows: the captured block gives each keyed row the Gumbel-max
    tokens of its own positions (what `KeyedNoise.draw` gives position by position) and advances its cursor by
    its γ, exactly as the eager loop does."""
    drafter, states, anchors = _drafter_and_states(head, draft_ids, rows=4)
    sp, gammas = SamplingParams(temperature=1.0), [4, 2, 3, 4]
    eager_streams, captured_streams = _mixed_streams(drafter), _mixed_streams(drafter)
    eager = drafter.propose_batch(states, anchors, gammas, sp, eager_streams)
    calls = _capture_on(monkeypatch)
    captured = drafter.propose_batch(states, anchors, gammas, sp, captured_streams)
    assert calls == [4] and not drafter.__dict__.get("_chain_capture_failed")
    for a, b in zip(eager, captured):
        assert torch.equal(a.tokens, b.tokens)
        torch.testing.assert_close(a.probs, b.probs, rtol=1e-6, atol=1e-7)
    assert [captured_streams[i].cursor for i in (1, 3)] == [eager_streams[i].cursor for i in (1, 3)] == [5 + 2, 4]
    assert [s.get_state() for s in captured_streams[::2]] == [s.get_state() for s in eager_streams[::2]]
    # the keyed rows' tokens are their own Gumbel-max draws at those positions, whatever the batch
    alone = KeyedNoise(21, VOCAB, "cpu", drafter.draft_ids)
    alone.cursor = 5
    (single,) = drafter.propose_batch([states[1]], [anchors[1]], [2], sp, [alone])
    assert torch.equal(single.tokens, captured[1].tokens)


def test_a_seeded_request_gets_the_same_tokens_with_its_blocks_captured_among_others(monkeypatch):
    """Through the engine: a seeded request's tokens (keyed sampling) are the same drafted eager alone and drafted
    in captured blocks beside unseeded and other seeded requests; alone, captured blocks draft what eager ones do
    (the same accepted drafts: keyed output would be the same even from wrong drafts)."""
    from dspark.decoding.engine import Engine, EngineConfig
    from dspark.decoding.scheduler import SchedulerConfig

    target = build_tiny_model(vocab_size=64, seed=1, num_layers=3, hidden_size=32, init_std=0.8)
    torch.manual_seed(0)
    drafter = build_drafter(DrafterConfig(algo="dspark", block_size=4, num_layers=1, num_context_layers=2, rank=8,
                                          init_std=0.2), target).eval()
    sp, prompt = SamplingParams(temperature=1.0), [3, 1, 4, 1, 5]

    def run(prompts, seeds):
        engine = Engine(target, drafter, EngineConfig(seed=0, max_batch=8,  # every draft verified (no timing)
                                                      scheduler=SchedulerConfig(mode="fixed")))
        tokens = [r.tokens for r in engine.generate(prompts, sp, max_new_tokens=24, stop_ids=[], seeds=seeds)]
        return tokens, engine.stats()["totals"]

    (alone,), eager_totals = run([prompt], [1234])
    calls = _capture_on(monkeypatch)
    (captured_alone,), captured_totals = run([prompt], [1234])
    assert calls and captured_alone == alone
    assert (captured_totals["accepted"], captured_totals["verified"]) == (eager_totals["accepted"],
                                                                        eager_totals["verified"])
    batched, _ = run([[7, 8], prompt, [9] * 11, [2, 3, 4]], [None, 1234, 55, None])
    assert batched[1] == alone


@pytest.mark.parametrize("draft_ids", [None, [0, 2, 3, 5, 7, 9, 11, 12]])
def test_the_whole_block_with_keyed_rows_is_the_eager_loops_past_each_rows_gamma_too(draft_ids):
    """The function the graph runs, on the whole [R, max γ] block (entries past a row's γ_r included, which are
    drafted but never returned): the eager loop's tokens, probabilities and confidence logits, bit for bit."""
    drafter, _, _ = _drafter_and_states("markov", draft_ids, rows=4)
    gen = torch.Generator().manual_seed(3)
    gammas = [4, 2, 3, 1]
    h, anchors = torch.randn(4, 4, drafter.hidden_size, generator=gen), torch.tensor([1, 2, 3, 4])
    sp = SamplingParams(temperature=1.0)
    with torch.no_grad():
        u = drafter.lm_logits(h)  # [R, G, N]
        eager_draws = BlockDraws(_mixed_streams(drafter), gammas, "cpu")
        eager = drafter.draft_chain(u, h, anchors, RowSampling([sp] * 4).probs, eager_draws.draw)
        draws = BlockDraws(_mixed_streams(drafter), gammas, "cpu")
        assert chain_capture.capturable(draws)
        whole = chain_capture.chain_from_uniforms(drafter, u, h, anchors, draws.uniforms,
                                                  chain_capture.ChainParams.of(sp),
                                                  *chain_capture.keyed_tables(draws, 4, u.shape[-1], "cpu"))
    assert all(torch.equal(a, b) for a, b in zip(eager, whole))
    assert [n.cursor for _, n in draws.keyed] == [n.cursor for _, n in eager_draws.keyed] == [5 + 2, 1]


def test_a_noise_shared_by_several_rows_is_not_captured():
    drafter, _, _ = _drafter_and_states("markov", None)
    shared = KeyedNoise(3, VOCAB, "cpu")
    assert not chain_capture.capturable(BlockDraws([shared, CounterStream(1, "cpu"), shared], [2, 2, 2], "cpu"))


def test_a_failed_capture_warns_once_and_drafts_eager(monkeypatch, caplog):
    monkeypatch.setattr(chain_capture, "BACKEND", "aot_eager")  # the block passes' captures here build no C++
    drafter, states, anchors = _drafter_and_states("markov", None, rows=4)
    sp = SamplingParams(temperature=1.0)
    eager_streams = _mixed_streams(drafter)
    keyed_eager = drafter.propose_batch(states, anchors, [3, 1, 2, 3], sp, eager_streams)
    states, anchors = states[:3], anchors[:3]
    eager = _propose(drafter, states, anchors, [3, 3, 3], sp)

    def broken(fn, device):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(chain_capture, "compiled", broken)
    monkeypatch.setattr(chain_capture, "default_mode", lambda: "compiled")
    assert chain_capture.wanted(drafter)
    first = _propose(drafter, states, anchors, [3, 3, 3], sp)
    assert "drafting it eager" in caplog.text and not chain_capture.wanted(drafter)
    assert all(torch.equal(a.tokens, b.tokens) for a, b in zip(eager, first))
    again = _propose(drafter, states, anchors, [3, 3, 3], sp)
    assert all(torch.equal(a.tokens, b.tokens) for a, b in zip(eager, again))
    # a block with keyed rows whose capture fails: the eager loop's tokens, each cursor advanced once
    drafter.__dict__.pop("_chain_capture_failed")
    _, all_states, all_anchors = _drafter_and_states("markov", None, rows=4)
    fallback_streams = _mixed_streams(drafter)
    keyed = drafter.propose_batch(all_states, all_anchors, [3, 1, 2, 3], sp, fallback_streams)
    assert not chain_capture.wanted(drafter)
    assert all(torch.equal(a.tokens, b.tokens) for a, b in zip(keyed_eager, keyed))
    assert [s.cursor for s in fallback_streams[1::2]] == [s.cursor for s in eager_streams[1::2]] == [5 + 1, 3]
