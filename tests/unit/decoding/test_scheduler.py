"""Algorithm 1 (hardware-aware prefix scheduler), its baselines, the SPS table and Appendix A."""
import numpy as np
import pytest
import torch

from dspark.decoding.sampling import accept_drafts
from dspark.decoding.scheduler import (PrefixScheduler, SchedulerConfig, SPSTable, prefix_schedule, prefix_survival,
                              profile_sps, threshold_schedule, topk_schedule)

APPENDIX_A_SPS = SPSTable({1: 1.0, 2: 0.5, 3: 0.45})


def expected_throughput(confidences, lengths, sps) -> float:
    """Θ = (Σ_r 1 + Σ_{j≤ℓ_r} a_{r,j}) · SPS(Σ_r (1 + ℓ_r)), the objective prefix_schedule maximises:
    checks the worked examples' arithmetic."""
    survival = prefix_survival(confidences)
    tau = sum(1 + float(a[:n].sum()) for a, n in zip(survival, lengths))
    return tau * sps(sum(1 + n for n in lengths))


def test_sps_table_interpolates_step_time_and_extrapolates():
    sps = SPSTable({1: 100.0, 4: 50.0})  # step time 10 ms at B=1, 20 ms at B=4
    assert sps(1) == pytest.approx(100.0) and sps(4) == pytest.approx(50.0)
    assert sps(0) == pytest.approx(100.0)  # flat below the profiled range
    assert 1 / sps(2.5) == pytest.approx(0.015)  # linear in step time
    assert 1 / sps(7) == pytest.approx(0.030)  # slope of the last two points beyond the range
    flat = SPSTable({8: 10.0, 16: 10.0})  # no positive slope: assume compute-bound (∝ B) beyond
    assert flat(32) == pytest.approx(5.0)
    assert SPSTable.from_dict(sps.to_dict()).points == sps.points
    with pytest.raises(ValueError, match="positive"):
        SPSTable({1: 0.0})


def test_profile_sps_times_the_callable():
    calls = []
    table = profile_sps(lambda b: calls.append(b), [1, 2], repeats=3, warmup=1)
    assert calls == [1, 2] * 4 and set(table.points) == {1, 2}  # the sizes take turns: a warm-up round, 3 timed
    assert all(v > 0 for v in table.points.values())


def test_profile_sps_keeps_the_ratios_when_the_machine_slows_down_midway(monkeypatch):
    """A burst of load during the second half of the profile: timed size by size it would land on
    the large sizes only; with the sizes taking turns every size sees it alike."""
    clock = {"t": 0.0, "calls": 0}

    def forward(batch):
        clock["calls"] += 1
        slow = 3.0 if clock["calls"] > 9 else 1.0  # after the warm-up and 3 of the 5 rounds
        clock["t"] += slow * (1.0 + 0.1 * batch)

    import dspark.decoding.scheduler as scheduler
    monkeypatch.setattr(scheduler.time, "perf_counter", lambda: clock["t"])
    table = profile_sps(forward, [1, 4], repeats=5, warmup=1)
    assert table.step_time(4) / table.step_time(1) == pytest.approx(1.4 / 1.1)


def test_appendix_a_early_stop_is_causal_global_search_is_not():
    high, low = [0.8, 0.9], [0.8, 0.0]  # c_2 depends on the realised x_1 (Markov confidence head)
    assert prefix_schedule([high], APPENDIX_A_SPS) == [0]  # Θ1 = 0.9 ≤ Θ0 = 1.0: stop before c_2
    assert prefix_schedule([low], APPENDIX_A_SPS) == [0]
    assert prefix_schedule([high], APPENDIX_A_SPS, early_stop=False) == [2]  # Θ2 = 1.134 is the max
    assert prefix_schedule([low], APPENDIX_A_SPS, early_stop=False) == [0]  # admission of x_1 leaks x_1
    assert expected_throughput([high], [2], APPENDIX_A_SPS) == pytest.approx(1.134)
    assert expected_throughput([high], [1], APPENDIX_A_SPS) == pytest.approx(0.9)


def test_appendix_a_retrospective_admission_biases_the_output():
    """Vocab {A, B}, p_t = (0.7, 0.3), p_d = (0.5, 0.5). Admitting x_1 iff x_1 = A (what the global
    search does in Appendix A) gives P(A) = 0.85; the early-stop schedule keeps P(A) = 0.7."""
    p_t, p_d = torch.tensor([0.7, 0.3]), torch.tensor([0.5, 0.5])
    conf_after = {0: [0.8, 0.9], 1: [0.8, 0.0]}  # x_1 = A -> high c_2, x_1 = B -> c_2 = 0
    gen = torch.Generator().manual_seed(0)
    runs = 8000
    out = {True: 0, False: 0}
    for early_stop in (True, False):
        for _ in range(runs):
            x1 = int(torch.multinomial(p_d, 1, generator=gen))
            n = min(prefix_schedule([conf_after[x1]], APPENDIX_A_SPS, early_stop=early_stop)[0], 1)
            drafts = torch.tensor([x1])[:n]
            n_acc, nxt = accept_drafts(drafts, p_d[None][:n], torch.stack([p_t] * (n + 1)), gen)
            out[early_stop] += (x1 if n_acc else nxt) == 0
    assert abs(out[True] / runs - 0.7) < 0.02  # ± 4 standard errors
    assert abs(out[False] / runs - 0.85) < 0.02


def test_greedy_admits_in_descending_survival_and_stops_at_first_drop():
    sps = SPSTable({2: 10.0, 3: 9.0, 4: 8.0, 5: 7.0, 6: 6.0, 7: 5.0})
    conf = [[0.9, 0.9, 0.5], [0.6, 0.9, 0.9]]  # a = [.9, .81, .405], [.6, .54, .486]
    # path: Θ0 = 2·10 = 20; +.9 -> 2.9·9 = 26.1; +.81 -> 3.71·8 = 29.68; +.6 -> 4.31·7 = 30.17;
    #       +.54 -> 4.85·6 = 29.1 ≤ 30.17: stop (ℓ = [2, 1])
    assert prefix_schedule(conf, sps) == [2, 1]
    assert expected_throughput(conf, [2, 1], sps) == pytest.approx(4.31 * 7)


def test_early_stop_can_stop_before_a_later_peak():
    sps = SPSTable({1: 1.0, 2: 0.5, 3: 0.49, 4: 0.48})  # a dip then a plateau: Θ is not unimodal
    conf = [[0.9, 1.0, 1.0]]
    assert prefix_schedule(conf, sps) == [0]  # Θ1 = 0.95 < 1: stops even though Θ3 = 3.7·0.48 = 1.78
    assert prefix_schedule(conf, sps, early_stop=False) == [3]


def test_decision_for_position_k_ignores_later_confidences():
    """Non-anticipation: 1[ℓ_r ≥ k] must not change when c_{r,k+1..γ} change."""
    rng = np.random.default_rng(0)
    sps = SPSTable({b: 100.0 / (1 + 0.08 * b) for b in range(1, 64)})
    for _ in range(300):
        conf = rng.uniform(0.2, 1.0, size=(3, 5))
        r, k = int(rng.integers(3)), int(rng.integers(1, 5))
        changed = conf.copy()
        changed[r, k:] = rng.uniform(0.0, 1.0, size=5 - k)
        for schedule in (lambda c: prefix_schedule(c, sps), lambda c: threshold_schedule(c, 0.4),
                         lambda c: topk_schedule(c, 6)):
            assert (schedule(conf)[r] >= k) == (schedule(changed)[r] >= k)


def test_verify_lengths_shrink_as_load_grows():
    steep = SPSTable({1: 100.0, 8: 90.0, 16: 60.0, 32: 30.0, 64: 15.0, 128: 7.5})
    row = [0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6]
    mean_len = []
    for n_req in (1, 4, 16, 48):
        lengths = prefix_schedule([row] * n_req, steep)
        assert max(lengths) - min(lengths) <= 1  # identical requests get (almost) identical lengths
        mean_len.append(float(np.mean(lengths)))
    assert mean_len[0] == 7 and mean_len == sorted(mean_len, reverse=True) and mean_len[-1] < 1


def test_threshold_and_topk_baselines():
    conf = [[0.9, 0.8, 0.9], [0.4, 1.0, 1.0]]  # a = [.9, .72, .648], [.4, .4, .4]
    assert threshold_schedule(conf, 0.7) == [2, 0]
    assert threshold_schedule(conf, 0.7, on="confidence") == [3, 0]
    assert threshold_schedule(conf, 0.0) == [3, 3]
    assert topk_schedule(conf, 4) == [3, 1]  # .9, .72, .648, then the tie at .4 resolves to (r=1, j=1)
    assert topk_schedule(conf, 0) == [0, 0]


def test_scheduler_front_end_modes():
    conf = [[0.9, 0.8, 0.1], [0.5, 0.5, 0.5]]
    assert PrefixScheduler(SchedulerConfig(mode="off")).schedule(conf, [3, 3]) == [0, 0]
    assert PrefixScheduler(SchedulerConfig(mode="fixed")).schedule([None, None], [3, 2]) == [3, 2]
    assert PrefixScheduler(SchedulerConfig(mode="fixed", gamma=1)).schedule(conf, [3, 3]) == [1, 1]
    assert PrefixScheduler(SchedulerConfig(mode="threshold", threshold=0.5)).schedule(conf, [3, 3]) == [2, 1]
    sps = SPSTable({b: 100.0 for b in range(1, 20)})  # free verification: dynamic verifies everything
    assert PrefixScheduler(SchedulerConfig(mode="dynamic"), sps).schedule(conf, [3, 3]) == [3, 3]
    with pytest.raises(ValueError, match="SPS table"):
        PrefixScheduler(SchedulerConfig(mode="dynamic"))
    with pytest.raises(ValueError, match="confidence"):
        PrefixScheduler(SchedulerConfig(mode="threshold")).schedule([None], [3])


def test_async_topk_takes_capacity_from_two_steps_ago():
    sps = SPSTable({1: 1.0, 2: 0.5, 3: 0.45, 4: 0.44})
    sched = PrefixScheduler(SchedulerConfig(mode="async_topk"), sps)
    confident, doubtful = [[0.8, 0.9, 0.9]], [[0.1, 0.1, 0.1]]
    assert sched.schedule(confident, [3]) == [0]  # warm-up: early-stop Algorithm 1 on the current step
    assert sched.schedule(doubtful, [3]) == [0]
    # capacity now comes from `confident` (two steps ago), searched without early stop: K = 3
    assert prefix_schedule(confident, sps, early_stop=False) == [3]
    assert sched.schedule(doubtful, [3]) == [3]
    assert sched.schedule(confident, [3]) == [0]  # K from `doubtful`


# ---- draft gate and the measured-table envelope ----------------------------------------------------
def test_monotone_envelope_removes_dips_at_small_batches():
    from dspark.decoding.scheduler import monotone_envelope

    measured = {1: 14.7, 2: 7.9, 4: 8.7, 8: 9.5, 16: 7.4, 32: 5.7}
    assert monotone_envelope(measured) == {1: 14.7, 2: 9.5, 4: 9.5, 8: 9.5, 16: 7.4, 32: 5.7}
    flat = {1: 3.0, 8: 2.0, 64: 1.0}
    assert monotone_envelope(flat) == flat


def test_draft_gate_skips_drafting_when_drafts_cost_more_than_they_save():
    from dspark.decoding.scheduler import DraftGate, SPSTable

    sps = SPSTable({1: 10.0, 64: 10.0, 512: 1.0})  # 0.1 s per target step up to 64 tokens
    gate = DraftGate(sps, explore_every=4, back_off_after=1)
    assert gate.should_draft(8)  # no estimates yet: draft
    gate.observe(8, draft_s=0.8, verified=16, accepted=4)  # 0.1 s per request to draft, τ 1.5
    # spec = 8·1.5 / (0.8 + 0.1) = 13.3 tok/s < off = 8 / 0.1 = 80 tok/s
    # explore on the 4th step, then the interval doubles while drafting keeps losing: next after 8
    decisions, exploring = [], []
    for _ in range(12):
        decisions.append(gate.should_draft(8))
        exploring.append(gate.exploring)
    assert decisions == [False] * 3 + [True] + [False] * 7 + [True]
    assert exploring == decisions  # every draft here is an exploration step: the engine drafts a sample
    cheap = DraftGate(sps)
    cheap.observe(8, draft_s=0.008, verified=16, accepted=8)  # τ 2, drafting ~free: speculation wins
    assert cheap.should_draft(8)


def test_draft_gate_does_not_back_off_on_its_first_few_samples():
    from dspark.decoding.scheduler import DraftGate, SPSTable

    sps = SPSTable({1: 10.0, 64: 10.0, 512: 1.0})
    gate = DraftGate(sps, explore_every=4, back_off_after=3)
    losing = dict(draft_s=0.8, verified=16, accepted=4)  # spec / off = 1/6, as in the test above
    intervals = []
    for _ in range(5):  # each exploration observed: the interval holds at 4 until 3 samples, then doubles
        gate.observe(8, **losing)
        while not gate.should_draft(8):
            pass
        intervals.append(gate.interval)
    assert gate.samples == 5 and intervals == [4, 4, 8, 16, 32]


def test_draft_gate_warmup_drafts_its_first_steps_whatever_the_rule_says():
    from dspark.decoding.scheduler import DraftGate, SPSTable

    sps = SPSTable({1: 10.0, 64: 10.0, 512: 1.0})
    gate = DraftGate(sps, explore_every=4, warmup=3)
    losing = dict(draft_s=0.8, verified=16, accepted=4)  # spec / off = 1/6
    assert gate.should_draft(8)  # drafting step 1 (no estimates yet)
    for _ in range(2):  # drafting steps 2 and 3: the rule would skip, the warm-up drafts (no exploration)
        gate.observe(8, **losing)
        assert gate.should_draft(8) and not gate.exploring
    gate.observe(8, **losing)
    assert [gate.should_draft(8) for _ in range(4)] == [False, False, False, True]  # now the rule decides


def test_draft_gate_estimates_follow_the_recent_steps():
    from dspark.decoding.scheduler import DraftGate, SPSTable

    gate = DraftGate(SPSTable({1: 10.0}), decay=0.5)
    gate.observe(4, draft_s=0.4, verified=8, accepted=4)
    gate.observe(2, draft_s=0.0, verified=0, accepted=0)
    assert gate.draft_s_per_req == pytest.approx(0.05)
    assert gate.verified_per_req == pytest.approx(1.0) and gate.accepted_per_req == pytest.approx(0.5)
    gate.observe(0, draft_s=1.0, verified=0, accepted=0)  # nothing drafted: ignored
    assert gate.draft_s_per_req == pytest.approx(0.05)


def test_draft_gate_reads_acceptance_from_the_confidences_not_a_few_unlucky_rounds():
    """At concurrency 1 a round accepts 0 or several drafts: three empty rounds in a row are common
    for a drafter that gains. With the confidences' expectation (calibrated against the realized
    counts over a long window) the gate stays open; on the realized counts alone it closes."""
    from dspark.decoding.scheduler import DraftGate, SPSTable

    sps = SPSTable({1: 10.0, 8: 10.0})  # a verify of up to 8 tokens costs one 0.1 s target step
    rounds = [0, 0, 0, 2] * 3  # realized accepted drafts: mean 0.5 per round
    with_conf = DraftGate(sps)
    for accepted in rounds:  # 0.02 s to draft: drafting pays when more than 0.2 drafts are accepted
        with_conf.observe(1, draft_s=0.02, verified=3, accepted=accepted, expected=0.5)
        assert with_conf.should_draft(1)
    assert with_conf.calibration == pytest.approx(1.0, abs=0.1)
    realized_only = DraftGate(sps)
    for accepted in [0, 0, 0]:
        realized_only.observe(1, draft_s=0.02, verified=3, accepted=accepted)
    assert not realized_only.should_draft(1)


def test_draft_gate_corrects_an_overconfident_head_with_the_realized_counts():
    from dspark.decoding.scheduler import DraftGate, SPSTable

    gate = DraftGate(SPSTable({1: 10.0, 8: 10.0}))
    for _ in range(40):  # the head predicts 0.9 accepted drafts per round; none is ever accepted
        gate.observe(1, draft_s=0.02, verified=3, accepted=0, expected=0.9)
    assert gate.calibration < 0.1 and gate.accepted_per_req < 0.1
    assert not gate.should_draft(1)


def test_draft_gate_corrects_the_sps_table_with_the_measured_verify_times():
    """The start-up table priced a 1-token step at 0.100 s; the engine's target-only steps take 0.125 s
    and its 4-token verifies 0.127 s. Drafting (0.02 s, 0.3 drafts accepted) then wins: 1.3 / 0.147 s
    = 8.8 tok/s against 8.0; on the table alone it looked like 9.7 against 10 and lost."""
    from dspark.decoding.scheduler import DraftGate, SPSTable

    sps = SPSTable({1: 10.0, 4: 1 / 0.114})
    table_only, measured = DraftGate(sps), DraftGate(sps)
    for gate in (table_only, measured):
        gate.observe(1, draft_s=0.02, verified=3, accepted=0, expected=0.3)
        gate.realized_sum = gate.expected_sum = 0.0  # a calibrated head (keeps the figures exact)
    assert not table_only.should_draft(1)
    for _ in range(5):
        measured.observe_verify(1, 0.125, drafted=False)
        measured.observe_verify(4, 0.127, drafted=True)
    assert measured.kappa[False] == pytest.approx(1.25) and measured.kappa[True] == pytest.approx(0.127 / 0.114)
    assert measured.should_draft(1)


def test_draft_gate_keeps_exploring_near_break_even_and_backs_off_when_clearly_losing():
    from dspark.decoding.scheduler import DraftGate, SPSTable

    sps = SPSTable({1: 10.0, 8: 10.0})
    close, losing = DraftGate(sps, explore_every=4, back_off_after=1), DraftGate(sps, explore_every=4, back_off_after=1)
    close.observe(1, draft_s=0.02, verified=3, accepted=0, expected=0.15)  # 1.15 / 0.12 s: 0.96x of off
    losing.observe(1, draft_s=0.05, verified=3, accepted=0, expected=0.0)  # 1 / 0.15 s: 0.67x
    for gate in (close, losing):
        gate.realized_sum = gate.expected_sum = 0.0
    assert close.expected_gain(1) == pytest.approx(1.15 / 1.2) and losing.expected_gain(1) == pytest.approx(1 / 1.5)
    assert [close.should_draft(1) for _ in range(12)] == ([False] * 3 + [True]) * 3  # every 4 steps
    assert [losing.should_draft(1) for _ in range(12)] == [False] * 3 + [True] + [False] * 7 + [True]  # 4, 8, ...
