"""Position-keyed randomness for seeded requests (EngineConfig.seeded_sampling="keyed", issue #22 item 8):
a seeded request's tokens do not depend on the other requests in its batch, on the dynamic scheduler's
verify lengths or on the draft gate, and sampling stays exactly lossless (χ² against the exact
target joint on a micro target, with and without a draft vocabulary)."""
from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

from dspark.decoding.engine import Engine, EngineConfig
from dspark.decoding.counter_random import derive_seed
from dspark.decoding.sampling import KeyedNoise, SamplingParams, sample
from dspark.decoding.scheduler import SchedulerConfig
from dspark.drafters import DrafterConfig, build_drafter
from tests.lossless_stats import chi2_pvalue, exact_joint

VOCAB, PROMPT = 8, [1, 5, 2, 7, 3]
STEEP_SPS = {1: 1 / 0.011, 128: 1 / 0.138}  # verifying is cheap for one request, dear for many


def _drafter(target, algo="dspark", gamma=3, draft_ids=None):
    torch.manual_seed(0)
    cfg = DrafterConfig(algo=algo, block_size=gamma, num_layers=1, num_context_layers=2, rank=8, init_std=0.2,
                        draft_vocab_size=None if draft_ids is None else len(draft_ids))
    return build_drafter(cfg, target, draft_ids=None if draft_ids is None else torch.tensor(draft_ids))


def test_keyed_noise_is_a_function_of_seed_and_position():
    a, b = KeyedNoise(7, 64, "cpu"), KeyedNoise(7, 64, "cpu")
    b.gumbel(5)  # another draw order: the noise of a position does not change
    assert torch.equal(a.gumbel(3), b.gumbel(3)) and not torch.equal(a.gumbel(3), a.gumbel(4))
    assert not torch.equal(a.gumbel(3), KeyedNoise(8, 64, "cpu").gumbel(3))
    assert len({derive_seed(7, i) for i in range(1000)}) == 1000 and derive_seed(7, 1) != derive_seed(8, 1)
    probs = torch.softmax(torch.randn(64), -1)
    a.cursor = 3
    assert int(sample(probs[None], [a])[0]) == int(a.argmax(probs[None], [3])[0]) and a.cursor == 4


def test_keyed_gumbel_max_samples_the_distribution():
    """Across seeds, the keyed Gumbel-max token at a fixed position is distributed as p (χ²)."""
    probs = torch.softmax(torch.randn(VOCAB, generator=torch.Generator().manual_seed(0)), -1)
    draws = [int(KeyedNoise(s, VOCAB, "cpu").argmax(probs[None], [0])[0]) for s in range(4000)]
    counts = np.bincount(draws, minlength=VOCAB)
    assert chi2_pvalue(counts, probs.double().numpy()) > 1e-3


@pytest.mark.parametrize("algo,draft_ids", [("dspark", [0, 1, 3, 4, 6]), ("dflash", None)])
def test_keyed_seeded_requests_are_lossless(micro_target, algo, draft_ids):
    """2000 requests with distinct seeds (DSpark: sequential drafting with a draft vocabulary of 5 of the
    8 tokens, dynamic scheduler mixing verify lengths; DFlash: parallel drafting, fixed): the joint of
    tokens 1-2 and 2-3 matches target-only sampling; drafts are both accepted and rejected."""
    runs, sp = 2000, SamplingParams(temperature=1.0)
    engine = Engine(micro_target, _drafter(micro_target, algo, draft_ids=draft_ids), EngineConfig(
        scheduler=SchedulerConfig(mode="dynamic" if algo == "dspark" else "fixed"),
        sps_table={1: 100.0, 128: 60.0, 512: 25.0}, max_batch=96, max_waiting=runs))
    lens = collections.Counter()
    engine.step_listeners.append(lambda report: lens.update(report.verify_lens))
    reqs = engine.generate([PROMPT] * runs, sp, max_new_tokens=3, stop_ids=[], seeds=list(range(runs)))
    assert all(r.noise is None and len(r.tokens) == 3 for r in reqs)
    counts = np.zeros([VOCAB] * 3)
    for r in reqs:
        counts[tuple(r.tokens)] += 1
    joint = exact_joint(micro_target, PROMPT, 3, sp, VOCAB)
    totals = engine.stats()["totals"]
    assert 0 < totals["accepted"] < totals["verified"] and sum(v for k, v in lens.items() if k > 0) > 0
    assert chi2_pvalue(counts.sum(2), joint.sum(2)) > 1e-3 and chi2_pvalue(counts.sum(0), joint.sum(0)) > 1e-3


@pytest.mark.parametrize("mode,gate", [("dynamic", False), ("dynamic", True), ("async_topk", False)])
def test_seeded_request_is_the_same_alone_and_in_any_batch(wide_target, mode, gate):
    """Under schedulers whose verify lengths depend on the whole batch (and with the draft gate skipping
    drafting on some steps), a seeded request's tokens at temperature 1 are the same alone and amid
    unseeded requests, and equal keyed target-only sampling (scheduler off)."""
    sp, prompt = SamplingParams(temperature=1.0), [3, 1, 4, 1, 5]
    drafter = _drafter(wide_target, gamma=4)

    def run(prompts, seeds, mode=mode, gate=gate, max_batch=32):
        engine = Engine(wide_target, drafter if mode != "off" else None, EngineConfig(
            scheduler=SchedulerConfig(mode=mode, draft_gate=gate, draft_gate_explore_every=2), sps_table=STEEP_SPS,
            seed=None, max_batch=max_batch))
        return [r.tokens for r in engine.generate(prompts, sp, max_new_tokens=32, stop_ids=[], seeds=seeds)], engine

    (alone,), _ = run([prompt], [1234])
    others = [[7, 8], [9] * 11, [2, 3, 4], [5] * 7, [60, 61]]
    batched, engine = run(others[:2] + [prompt] + others[2:], [None, None, 1234, None, None, None])
    assert batched[2] == alone
    (target_only,), _ = run([prompt], [1234], mode="off", gate=False)
    assert target_only == alone
    staggered, _ = run(others + [prompt], [None] * 5 + [1234], max_batch=3)  # joins late, other neighbours
    assert staggered[-1] == alone
    pair, _ = run([prompt, prompt], [1234, 99])
    assert pair[0] == alone and pair[1] != alone


def test_stream_seeded_sampling_is_still_available(wide_target):
    """seeded_sampling=stream: the rejection rule with the request's generator stream (reproducible
    under the same load), the pre-keyed behaviour."""
    sp, prompt = SamplingParams(temperature=1.0), [3, 1, 4, 1, 5]
    engine = Engine(wide_target, _drafter(wide_target), EngineConfig(
        scheduler=SchedulerConfig(mode="fixed"), seeded_sampling="stream", seed=None))
    (req,) = engine.generate([prompt], sp, max_new_tokens=8, stop_ids=[], seeds=[5])
    assert len(req.tokens) == 8
    engine2 = Engine(wide_target, _drafter(wide_target), EngineConfig(
        scheduler=SchedulerConfig(mode="fixed"), seeded_sampling="stream", seed=None))
    assert engine2.generate([prompt], sp, max_new_tokens=8, stop_ids=[], seeds=[5])[0].tokens == req.tokens


def test_a_steps_keyed_noise_is_made_in_one_call_and_is_the_same(monkeypatch):
    """`prefetch_noise`: the missing noise of several requests' positions in one keyed_gumbel call, equal to what
    each KeyedNoise makes alone; positions already made are not made again."""
    import dspark.decoding.sampling as sampling

    alone = [KeyedNoise(seed, VOCAB, "cpu") for seed in (3, 4)]
    expected = {(i, p): alone[i].gumbel(p) for i in range(2) for p in range(5, 9)}
    noises = [KeyedNoise(seed, VOCAB, "cpu") for seed in (3, 4)]
    noises[0].gumbel(5)  # already made: not asked again
    calls = []
    real = sampling.keyed_gumbel
    monkeypatch.setattr(sampling, "keyed_gumbel", lambda s, p, v: calls.append(p.tolist()) or real(s, p, v))
    sampling.prefetch_noise([(noises[i], p) for i in range(2) for p in range(5, 9)])
    assert calls == [[6, 7, 8, 5, 6, 7, 8]]
    assert all(torch.equal(noises[i].gumbel(p), g) for (i, p), g in expected.items()) and len(calls) == 1
