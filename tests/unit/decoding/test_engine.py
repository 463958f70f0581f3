"""Continuous-batching engine on micro targets: lossless at temperature 1 through the batched engine
(χ² against the exact target joint) under dynamic and threshold scheduling, exact greedy output,
load-dependent verify lengths, ragged batching, failure isolation, queue bounds and health."""
from __future__ import annotations

import collections
import threading

import pytest
import torch

from dspark.decoding.batched_cache import KVSlots, enable_ragged
from dspark.drafters import DrafterConfig, build_drafter
from dspark.decoding.engine import Engine, EngineConfig, EngineUnavailableError, QueueFullError
from dspark.decoding.sampling import SamplingParams
from dspark.decoding.scheduler import SchedulerConfig
from dspark.decoding.specdec import target_generate
from tests.lossless_stats import engine_three_token_pvalues

VOCAB, PROMPT, GAMMA = 8, [1, 5, 2, 7, 3], 3
GREEDY = SamplingParams(temperature=0.0)
# Step time 10 ms + 1 ms per token: verifying drafts pays for one request, not for sixteen.
STEEP_SPS = {1: 1 / 0.011, 128: 1 / 0.138}


def _drafter(target, algo="dspark", gamma=GAMMA, seed=0, draft_ids=None):
    torch.manual_seed(seed)
    cfg = DrafterConfig(algo=algo, block_size=gamma, num_layers=1, num_context_layers=2, rank=8, init_std=0.2,
                        draft_vocab_size=None if draft_ids is None else len(draft_ids))
    return build_drafter(cfg, target, draft_ids=None if draft_ids is None else torch.tensor(draft_ids))


def _engine(target, drafter, mode, **kw):
    sched = {k: kw.pop(k) for k in ("threshold", "threshold_on") if k in kw}
    scfg = SchedulerConfig(mode=mode, **sched)
    kw.setdefault("sps_table", STEEP_SPS)
    return Engine(target, drafter, EngineConfig(scheduler=scfg, **kw))


@pytest.mark.parametrize("mode,extra,draft_ids", [
    ("dynamic", {"sps_table": {1: 100.0, 128: 60.0, 512: 25.0}}, None),
    ("threshold", {"threshold": 0.5, "threshold_on": "confidence"}, None),
    ("threshold", {"threshold": 0.3, "threshold_on": "confidence"}, [0, 1, 3, 4, 6])])
def test_engine_is_lossless_at_temperature_one(micro_target, mode, extra, draft_ids):
    """Many concurrent requests (joining and leaving between steps) of the same prompt: the joint of the
    first two tokens, and of tokens 2-3 (drafted positions 1 and 2), match target-only sampling; also
    with a draft vocabulary (5 of 8 tokens: q is zero on tokens 2, 5 and 7, which only the residual
    and bonus draws can emit)."""
    runs, sp = 3000, SamplingParams(temperature=1.0)
    drafter = _drafter(micro_target, draft_ids=draft_ids)
    engine = _engine(micro_target, drafter, mode, max_batch=96, max_waiting=runs, **extra)
    lens = collections.Counter()
    engine.step_listeners.append(lambda report: lens.update(report.verify_lens))
    p12, p23, totals = engine_three_token_pvalues(engine, micro_target, PROMPT, sp, VOCAB, runs)
    print(f"\n[engine lossless] {mode}: p(t1,t2)={p12:.3g} p(t2,t3)={p23:.3g} verify lens {dict(lens)} "
          f"accepted {totals['accepted']}/{totals['verified']}")
    # the scheduler really mixed lengths and drafts were both accepted and rejected
    assert lens[0] > 0 and sum(v for k, v in lens.items() if k > 0) > 0
    assert 0 < totals["accepted"] < totals["verified"]
    assert p12 > 1e-3 and p23 > 1e-3


@pytest.mark.parametrize("mode", ["off", "fixed", "threshold", "dynamic"])
def test_greedy_engine_output_equals_target_only(wide_target, mode):
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [3] * 12, [20, 21], [7, 7, 30, 31, 32]]
    drafter = _drafter(wide_target, gamma=4) if mode != "off" else None
    engine = _engine(wide_target, drafter, mode, max_batch=4)  # 6 prompts, 4 slots: requests queue and join
    stops = [5, 9]
    reqs = engine.generate(prompts, GREEDY, max_new_tokens=24, stop_ids=stops)
    for prompt, req in zip(prompts, reqs):
        ref = target_generate(wide_target, prompt, GREEDY, 24, stop_ids=stops)
        assert req.tokens == ref.token_ids, f"prompt {prompt}"
        assert req.finish_reason == ref.finish_reason
    assert engine.active == [] and engine.kv.used == 0


def test_greedy_with_a_drafter_that_agrees_accepts_everything(wide_target):
    """A 'drafter' that proposes the target's own greedy continuation is always accepted: τ = γ + 1."""
    drafter = _drafter(wide_target, gamma=4)
    prompt = [1, 2, 3]
    ref = target_generate(wide_target, prompt, GREEDY, 40, stop_ids=[]).token_ids
    real_batch = drafter.propose_batch

    def oracle(state, anchor, gamma, sampling, generator=None):
        proposal = real_batch([state], [anchor], gamma, sampling, generator)[0]
        done = state.length - len(prompt) + 1  # tokens emitted so far (the anchor is the last one)
        proposal.tokens = torch.tensor(ref[done: done + gamma])
        proposal.probs = torch.nn.functional.one_hot(proposal.tokens, wide_target.vocab_size).float()
        return proposal

    drafter.propose_batch = lambda states, anchors, gamma, sampling, generators: [  # the engine's path
        oracle(s, a, gamma, sp, g) for s, a, sp, g in zip(states, anchors, sampling, generators)]
    engine = _engine(wide_target, drafter, "fixed")
    (req,) = engine.generate([prompt], GREEDY, max_new_tokens=36, stop_ids=[])
    assert req.tokens == ref[:36]
    assert req.stats.spec_decode()["mean_accepted_length"] == pytest.approx(5.0)


def test_dynamic_verify_lengths_shrink_as_requests_grow(wide_target):
    """Under a steeply falling SPS table Algorithm 1 verifies drafts for one request but not for 16."""
    budgets = {}
    for n in (1, 16):
        engine = _engine(wide_target, _drafter(wide_target, gamma=4), "dynamic", max_batch=16)
        engine.generate([[1 + i, 2, 3] for i in range(n)], SamplingParams(temperature=1.0), max_new_tokens=12,
                        stop_ids=[])
        budgets[n] = engine.stats()["mean_verify_budget"]
    assert budgets[1] >= 1.0
    assert budgets[16] < budgets[1] / 2


def test_ragged_forward_matches_per_request_forward(wide_target):
    """Rows of different cached lengths and new-token counts in one flat forward == separate forwards;
    stale columns (a rejected suffix) never leak."""
    target = wide_target
    enable_ragged(target.model)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, target.vocab_size, (n,), generator=gen) for n in (9, 4, 13)]
    store = KVSlots(target.device, target.dtype, length_chunk=8)

    def ragged(first, parts):
        layout = store.ragged(first, [len(p) for p in parts])
        with store.batch(layout):
            out = target.forward(torch.cat(parts)[None], position_ids=layout.position_ids,
                                 attention_mask=layout.mask, layer_ids=[0, 1], logits_at="all")
        return [(out.logits[0, s], out.features[0, s]) for s in layout.row_slices()]

    cut = [5, 1, 7]
    for _ in seqs:
        store.allocate()
    ragged(0, [s[:c] for s, c in zip(seqs, cut)])
    for slot, c in enumerate(cut):
        store.set_length(slot, c)
    ragged(0, [torch.full((3,), 7), torch.full((5,), 7), torch.full((1,), 7)])  # rejected: lengths unchanged
    outs = ragged(0, [s[c:] for s, c in zip(seqs, cut)])
    for seq, c, (logits, feats) in zip(seqs, cut, outs):
        ref = target.forward(seq[None], layer_ids=[0, 1], logits_at="all")
        torch.testing.assert_close(logits, ref.logits[0, c:], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(feats, ref.features[0, c:], atol=1e-4, rtol=1e-4)
    # outside a ragged batch the model is unchanged
    ref = target.forward(seqs[0][None], logits_at="all").logits
    assert store.release(0) == 2 and store.lengths == [cut[2], cut[1]]
    torch.testing.assert_close(target.forward(seqs[0][None], logits_at="all").logits, ref)


def test_a_failing_request_is_isolated(wide_target):
    drafter = _drafter(wide_target, gamma=3)
    engine = _engine(wide_target, drafter, "fixed")
    real_batch = drafter.propose_batch
    bad_len = 30  # only the bad request has a 30-token context when it first drafts

    def propose_batch(states, *args, **kwargs):  # a batch breaks; a request alone breaks only if poisoned
        if len(states) > 1:
            raise RuntimeError("batched drafting broke")
        if states[0].length == bad_len:
            raise RuntimeError("poisoned request")
        return real_batch(states, *args, **kwargs)

    drafter.propose_batch = propose_batch
    prompts = [[1, 2, 3], [5] * bad_len, [4, 5]]
    reqs = engine.generate(prompts, GREEDY, max_new_tokens=8, stop_ids=[])
    assert reqs[1].finish_reason == "error" and "poisoned request" in reqs[1].error
    for prompt, req in zip(prompts[::2], reqs[::2]):
        assert req.tokens == target_generate(wide_target, prompt, GREEDY, 8, stop_ids=[]).token_ids
    assert engine.healthy and engine.stats()["totals"]["failed"] == 1


def test_background_loop_streams_and_reports_health(wide_target):
    engine = _engine(wide_target, _drafter(wide_target), "dynamic", max_consecutive_failures=2).start()
    try:
        streamed, finished = collections.defaultdict(list), threading.Event()
        done = []

        def listener(req, new, is_final):
            streamed[req.id] += new
            if is_final:
                done.append(req.id)
                if len(done) == 8:
                    finished.set()

        reqs = [engine.submit([i + 1, 2], GREEDY, 10, stop_ids=[], listener=listener) for i in range(8)]
        assert finished.wait(60)
        for req in reqs:
            req.wait(10)
            assert streamed[req.id] == req.tokens and len(req.tokens) == 10
        # a step-level failure fails the requests in flight; repeated failures make the engine unhealthy
        engine._verify = lambda report: (_ for _ in ()).throw(RuntimeError("device lost"))
        for _ in range(2):
            req = engine.submit([1, 2], GREEDY, 4, stop_ids=[]).wait(30)
            assert req.finish_reason == "error" and "device lost" in req.error
        assert not engine.healthy and "device lost" in engine.health_error
        with pytest.raises(EngineUnavailableError):
            engine.submit([1, 2], GREEDY, 4)
    finally:
        engine.stop()


def test_queue_bound_cancel_and_input_checks(wide_target):
    engine = _engine(wide_target, _drafter(wide_target), "fixed", max_waiting=2, max_model_len=64)
    a = engine.submit([1, 2], GREEDY, 5)
    b = engine.submit([3, 4], GREEDY, 5)
    with pytest.raises(QueueFullError, match="queue is full"):
        engine.submit([5], GREEDY, 5)
    assert engine.stats()["totals"]["rejected"] == 1
    engine.cancel(b)
    while engine.has_work():
        engine.step()
    assert a.finish_reason == "length" and b.finish_reason == "cancelled" and b.done.is_set()
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.submit([], GREEDY, 5)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        engine.submit([1], GREEDY, 0)
    with pytest.raises(ValueError, match="shorten the prompt"):
        engine.submit([1] * 70, GREEDY, 5)
    with pytest.raises(ValueError, match="lower max_new_tokens"):
        engine.submit([1] * 30, GREEDY, 40)
    with pytest.raises(ValueError, match="token ids must be in"):
        engine.submit([wide_target.vocab_size], GREEDY, 5)


def test_modes_that_need_confidences_reject_a_drafter_without_them(wide_target):
    dflash = _drafter(wide_target, algo="dflash")
    with pytest.raises(ValueError, match="no confidence head"):
        _engine(wide_target, dflash, "dynamic")
    with pytest.raises(ValueError, match="needs a drafter"):
        _engine(wide_target, None, "fixed")
    engine = _engine(wide_target, dflash, "fixed")  # fixed works with any drafter
    (req,) = engine.generate([[1, 2]], GREEDY, 6, stop_ids=[])
    assert req.tokens == target_generate(wide_target, [1, 2], GREEDY, 6, stop_ids=[]).token_ids


def test_sps_table_is_profiled_at_start(wide_target):
    engine = Engine(wide_target, _drafter(wide_target),
                    EngineConfig(scheduler=SchedulerConfig(mode="dynamic"), sps_batch_sizes=[1, 8, 32],
                                 sps_repeats=1, sps_context=16))
    table = engine.stats()["sps_table"]
    assert set(table) == {"1", "8", "32"} and all(v > 0 for v in table.values())


class _AlternatingGate:
    """Stands in for DraftGate: drafts every other step, whatever the timings (deterministic)."""

    def __init__(self):
        self.calls, self.observed = 0, 0

    def should_draft(self, n_active: int) -> bool:
        self.calls += 1
        return self.calls % 2 == 1

    def observe(self, *args) -> None:
        self.observed += 1

    def observe_verify(self, *args) -> None:
        pass


def test_engine_with_draft_gate_skipping_steps_stays_lossless(micro_target):
    """Steps where the gate skips drafting are plain target steps; mixed with drafting steps (requests
    carry their drafter context across both), the output joint is still the target's."""
    runs, sp = 3000, SamplingParams(temperature=1.0)
    engine = Engine(micro_target, _drafter(micro_target), EngineConfig(
        scheduler=SchedulerConfig(mode="dynamic", draft_gate=True), sps_table={1: 100.0, 128: 60.0, 512: 25.0},
        max_batch=96, max_waiting=runs))
    assert engine.gate is not None
    engine.gate = gate = _AlternatingGate()
    p12, p23, totals = engine_three_token_pvalues(engine, micro_target, PROMPT, sp, VOCAB, runs)
    assert totals["draft_skipped_steps"] > 0 and gate.observed > 0 and totals["accepted"] > 0
    assert min(p12, p23) > 1e-3


class _ExploringGate(_AlternatingGate):
    """Every drafting step is an exploration step of `explore_rows` requests."""

    exploring, explore_rows = True, 2

    def __init__(self):
        super().__init__()
        self.rows = []

    def observe(self, n_requests, *args) -> None:
        super().observe()
        self.rows.append(n_requests)


def test_exploration_steps_draft_a_round_robin_sample_and_stay_lossless(micro_target):
    """On an exploration step only `explore_rows` requests draft (the others take a target-only row in
    the same forward); the sample is chosen round-robin before any draft exists, so the output joint is
    still the target's."""
    runs, sp = 3000, SamplingParams(temperature=1.0)
    engine = Engine(micro_target, _drafter(micro_target), EngineConfig(
        scheduler=SchedulerConfig(mode="dynamic", draft_gate=True), sps_table={1: 100.0, 128: 60.0, 512: 25.0},
        max_batch=96, max_waiting=runs))
    engine.gate = gate = _ExploringGate()
    p12, p23, totals = engine_three_token_pvalues(engine, micro_target, PROMPT, sp, VOCAB, runs)
    assert gate.rows and max(gate.rows) == 2 and totals["accepted"] > 0
    assert min(p12, p23) > 1e-3


def test_greedy_output_with_the_real_draft_gate_equals_target_only(wide_target):
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [3] * 12]
    engine = Engine(wide_target, _drafter(wide_target, gamma=4), EngineConfig(
        scheduler=SchedulerConfig(mode="dynamic", draft_gate=True, draft_gate_explore_every=3),
        sps_table=STEEP_SPS, max_batch=2))
    reqs = engine.generate(prompts, GREEDY, max_new_tokens=16, stop_ids=[])
    for prompt, req in zip(prompts, reqs):
        assert req.tokens == target_generate(wide_target, prompt, GREEDY, 16, stop_ids=[]).token_ids


@pytest.mark.parametrize("mode,algo", [("fixed", "dspark"), ("threshold", "dspark"), ("fixed", "dflash"),
                                       ("fixed", "eagle3"), ("off", None)])
def test_seeded_request_is_reproducible_alone_and_in_any_batch(wide_target, mode, algo):
    """Per-request generators: a seeded request's tokens at temperature 1 are the same alone, in a batch
    of other (unseeded) requests, and next to a copy of itself with another seed; where ℓ_r depends on
    request r alone (off / fixed / threshold), nothing else in the batch can change them."""
    drafter = None if algo is None else _drafter(wide_target, algo=algo, gamma=3)
    sp, prompt = SamplingParams(temperature=1.0), [3, 1, 4, 1, 5]
    extra = {"threshold": 0.5, "threshold_on": "confidence"} if mode == "threshold" else {}

    def run(prompts, seeds):
        return [r.tokens for r in _engine(wide_target, drafter, mode, seed=None, **extra).generate(
            prompts, sp, max_new_tokens=24, stop_ids=[], seeds=seeds)]

    (alone,) = run([prompt], [1234])
    others = [[7, 8], [9] * 11, [2, 3, 4]]
    batched = run(others[:2] + [prompt] + others[2:], [None, None, 1234, None])
    assert batched[2] == alone
    pair = run([prompt, prompt], [1234, 99])
    assert pair[0] == alone and pair[1] != alone  # another seed: another sample (24 tokens from 64)


class _ScriptedGate:
    """Stands in for DraftGate: drafts on the given (1-based) steps only."""

    def __init__(self, draft_steps):
        self.draft_steps, self.calls = set(draft_steps), 0

    def should_draft(self, n_active: int) -> bool:
        self.calls += 1
        return self.calls in self.draft_steps

    def observe(self, *args) -> None:
        pass

    def observe_verify(self, *args) -> None:
        pass


@pytest.mark.parametrize("algo,mode", [("dspark", "dynamic"), ("eagle3", "fixed")])  # eagle3: no confidences
def test_skipped_steps_do_no_drafter_work_and_the_context_catches_up_before_drafting(wide_target, algo, mode):
    """While the gate skips, the drafter does nothing (a step is the same work as mode off); when it
    drafts again, the requests' contexts read every position verified meanwhile in ONE extend_contexts
    pass and end up as the contexts built eagerly from the same positions; requests holding
    `context_catch_up_every` steps of features are caught up without drafting."""
    drafter = _drafter(wide_target, algo=algo, gamma=3)
    calls, extend, extend_all = [], drafter.extend_context, drafter.extend_contexts
    drafter.extend_contexts = lambda states, fs, ids: (calls.append([int(i.shape[0]) for i in ids]),
                                                       extend_all(states, fs, ids))[1]
    engine = Engine(wide_target, drafter, EngineConfig(
        scheduler=SchedulerConfig(mode=mode, draft_gate=True), sps_table=STEEP_SPS, context_catch_up_every=8))
    engine.gate = _ScriptedGate(draft_steps=[6])  # the engine consults any gate it holds
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10]]
    reqs = [engine.submit(p, GREEDY, max_new_tokens=40, stop_ids=[]) for p in prompts]
    for _ in range(5):  # prefill + 5 target-only steps
        assert not engine.step().drafted
    assert calls == []
    verified = [len(p) + len(r.tokens) - 1 for p, r in zip(prompts, reqs)]
    assert verified == [engine.kv.lengths[r.slot] for r in reqs]
    report = engine.step()  # step 6 drafts: catch-up first
    assert report.drafted and calls == [verified] and report.catch_up_tokens == sum(verified)  # one pass
    # the gate is charged the propose pass plus ~one position per row of that catch-up, not the backlog
    assert 0 < report.gate_draft_s < report.draft_s and engine._steady_share(2, sum(verified)) == 2 / sum(verified)
    assert engine._steady_share(2, 1) == 1.0 and engine._steady_share(2, 0) == 1.0
    for p, r, n in zip(prompts, reqs, verified):
        ids = torch.tensor([(p + r.tokens)[:n]])
        eager = drafter.new_state()
        extend(eager, wide_target.forward(ids, layer_ids=drafter.layer_ids, logits_at=None).features[0], ids[0])
        for lazy_buf, eager_buf in zip(r.draft_state.kv, eager.kv):
            torch.testing.assert_close(lazy_buf.k[..., :n, :], eager_buf.k[..., :n, :], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(lazy_buf.v[..., :n, :], eager_buf.v[..., :n, :], atol=1e-5, rtol=1e-4)
    calls.clear()
    assert all(len(r.ctx_pending) == 1 for r in reqs)  # what step 6 verified waits for the next draft
    for _ in range(6):  # 6 skipped steps: 7 pending, below the bound, nothing read
        assert not engine.step().drafted
    assert calls == []
    report = engine.step()  # the 8th pending step reaches context_catch_up_every: read without drafting
    assert not report.drafted and len(calls) == 1 and len(calls[0]) == 2 and all(not r.ctx_pending for r in reqs)
    assert [r.draft_state.length for r in reqs] == [engine.kv.lengths[r.slot] for r in reqs]
    engine.generate([], GREEDY)  # runs the requests to the end
    for p, r in zip(prompts, reqs):
        assert r.tokens == target_generate(wide_target, p, GREEDY, 40, stop_ids=[]).token_ids


def test_the_engine_picks_its_target_step_by_hardware_and_load(wide_target, monkeypatch):
    """auto on a CPU: the ragged store for the engine (measured faster than the padded eager core there, and
    target-only serving stays on the same store), the eager core for the rollout generator; an explicit
    decode_core is kept."""
    from dspark.decoding.batched_cache import RaggedSlots
    from dspark.decoding.generator import BatchGenerator
    from dspark.decoding.static_core import CoreSlots

    monkeypatch.delenv("DSPARK_DECODE_CORE", raising=False)
    drafter = _drafter(wide_target)
    assert isinstance(_engine(wide_target, drafter, "fixed").kv, RaggedSlots)
    assert isinstance(_engine(wide_target, None, "off").kv, RaggedSlots)
    rollouts = BatchGenerator(wide_target).kv
    assert isinstance(rollouts, CoreSlots) and rollouts.core.mode == "eager"
    eager = _engine(wide_target, drafter, "fixed", decode_core="eager").kv
    assert isinstance(eager, CoreSlots) and eager.core.mode == "eager"


@pytest.mark.parametrize("mode", ["fixed", "dynamic"])
def test_the_batched_rejection_step_gives_the_engine_the_same_tokens(monkeypatch, wide_target, mode):
    """What an accelerator runs (`accept_rows` batched: one host read per step) against a CPU's default (row by
    row), through the engine with requests joining and leaving: the same tokens for every request and the same
    totals (stream randomness: each request's generator is drawn from the same way either way)."""
    import functools

    import dspark.decoding.engine as engine_module
    from dspark.decoding.batched_accept import accept_rows

    drafter, sp = _drafter(wide_target, gamma=3), SamplingParams(temperature=1.0)
    prompts = [[3, 1, 4, 1, 5], [2, 7], [1, 8, 2, 8, 1, 8], [4, 4]] * 2

    def run(batched: bool):
        monkeypatch.setattr(engine_module, "accept_rows", functools.partial(accept_rows, batched=batched))
        engine = _engine(wide_target, drafter, mode, max_batch=3, seed=11)
        reqs = engine.generate(prompts, sp, max_new_tokens=12, stop_ids=[])
        return [r.tokens for r in reqs], {k: v for k, v in engine.stats()["totals"].items() if not k.endswith("_s")}

    (row_tokens, row_totals), (batched_tokens, batched_totals) = run(False), run(True)
    assert batched_tokens == row_tokens and batched_totals == row_totals
    assert 0 < row_totals["accepted"] < row_totals["verified"]  # both accepts and rejections happened


@pytest.mark.parametrize("mode,seeded", [("fixed", False), ("dynamic", False), ("dynamic", True)])
def test_a_drafting_step_reads_the_device_back_twice(monkeypatch, wide_target, mode, seeded):
    """On an accelerator each read of a device value waits for the device. A steady chain step with the batched
    rejection step (an accelerator's default) reads back twice whatever the number of requests: the drafts
    (every request's tokens and confidences in one copy, which the scheduler and the emitted text use) and the
    acceptance results (one copy; seeded requests' keyed rule likewise); the anchors go to the device in one copy.
    A step that admits requests reads their first tokens in one more copy."""
    import functools

    import dspark.decoding.engine as engine_module
    from dspark.decoding.batched_accept import accept_rows

    monkeypatch.setattr(engine_module, "accept_rows", functools.partial(accept_rows, batched=True))
    engine = _engine(wide_target, _drafter(wide_target, gamma=3), mode, max_batch=6, seed=3)
    reqs = [engine.submit([3, 1, 4, 1, 5][: 2 + r % 4], SamplingParams(temperature=1.0), max_new_tokens=200,
                          stop_ids=[], seed=r if seeded else None) for r in range(6)]
    assert all((r.noise is not None) == seeded for r in reqs)
    reads = []
    real = {name: getattr(torch.Tensor, name) for name in ("tolist", "item", "__int__", "__float__", "__bool__")}

    def counted(name, fn):
        def read(t, *args):
            reads.append(name)
            return fn(t, *args)
        return read

    for name, fn in real.items():
        monkeypatch.setattr(torch.Tensor, name, counted(name, fn))
    per_step = []
    for _ in range(5):  # the first step admits the 6 requests: their first tokens are one more read
        reads.clear()
        engine.step()
        per_step.append(list(reads))
    monkeypatch.undo()
    assert all(not r.finished for r in reqs)
    assert per_step[0] == ["tolist"] * 3 and per_step[1:] == [["tolist", "tolist"]] * 4, per_step
