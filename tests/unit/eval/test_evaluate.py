"""Evaluation core (dspark/eval/evaluate.py), drafter references (dspark/drafter_source.py) and the
evaluation job (jobs/evaluate.py) on the tiny target."""

from __future__ import annotations

import json

import os

from pathlib import Path

from types import SimpleNamespace

import pytest

import torch

from dspark.eval import evaluate as ev

from dspark.eval import report

from dspark.drafters import DraftProposal, DrafterConfig, build_drafter, save_drafter

from dspark.decoding.sampling import SamplingParams, sample, to_probs

from dspark.decoding.specdec import RoundStats, target_generate

from dspark.models.target import load_target
from tests.paths import REPO
from tests.mlflow_store import new_sqlite_store, register_drafter_dir
from tests.tiny_models import build_tiny_model



GAMMA = 3



@pytest.fixture(scope="module")
def tiny():
    return load_target("tiny")



def tiny_drafter(target, algo: str = "dspark", seed: int = 0):
    torch.manual_seed(seed)
    cfg = DrafterConfig(algo=algo, block_size=GAMMA, num_layers=1, num_context_layers=2, rank=8)
    return build_drafter(cfg, target)



class OracleDrafter:
    """Proposes from the target itself (p_d == p_t), so every verified draft is accepted: τ = γ + 1."""

    def __init__(self, target, gamma: int = GAMMA):
        self.target = target
        self.config = SimpleNamespace(block_size=gamma, target_layer_ids=[0], algo="oracle")
        self.target_meta = {"layer_ids": [0]}
        self.calibration = None

    def new_state(self):
        return {"ids": []}

    def extend_context(self, state, features, token_ids):
        state["ids"] += token_ids.tolist()

    def propose(self, state, anchor, gamma, sp, generator):
        ids, tokens, probs = state["ids"] + [anchor], [], []
        for _ in range(gamma):
            logits = self.target.forward(torch.tensor([ids]), logits_at="last").logits[0, -1]
            p = to_probs(logits, sp)
            tok = int(sample(p, generator))
            tokens.append(tok)
            probs.append(p)
            ids.append(tok)
        return DraftProposal(torch.tensor(tokens), torch.stack(probs), torch.full((gamma,), 0.9))



def write_jsonl(path, records) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return str(path)



def test_parse_benchmark_errors_name_file_and_line():
    assert ev.parse_benchmark('{"turns": ["a"]}\n\n{"turns": ["b", "c"]}\n', "f.jsonl") == [["a"], ["b", "c"]]
    with pytest.raises(ev.BenchmarkError, match=r"f\.jsonl:2: not valid JSON"):
        ev.parse_benchmark('{"turns": ["a"]}\n{oops\n', "f.jsonl")
    with pytest.raises(ev.BenchmarkError, match=r"f\.jsonl:1: expected"):
        ev.parse_benchmark('{"prompt": "a"}\n', "f.jsonl")
    with pytest.raises(ev.BenchmarkError, match=r"f\.jsonl:1: expected"):
        ev.parse_benchmark('{"turns": []}\n', "f.jsonl")
    with pytest.raises(ev.BenchmarkError, match=r"f\.jsonl: no prompts"):
        ev.parse_benchmark("\n", "f.jsonl")



def test_one_bad_benchmark_does_not_discard_the_others(tmp_path):
    write_jsonl(tmp_path / "gsm8k.jsonl", [{"turns": [f"q{i}"]} for i in range(5)])
    (tmp_path / "broken.jsonl").write_text('{"turns": ["ok"]}\nnot json\n')
    (tmp_path / "empty.jsonl").write_text("")
    specs = [ev.BenchmarkSpec(path=p) for p in ("gsm8k.jsonl", "missing.jsonl", "broken.jsonl", "empty.jsonl")]
    benches, problems = ev.load_benchmarks(specs, str(tmp_path), max_prompts=3)
    assert [(b.name, b.domain, len(b.prompts)) for b in benches] == [("gsm8k", "math", 3)]
    assert len(problems) == 3
    assert "missing.jsonl" in problems[0] and "broken.jsonl:2" in problems[1] and "empty.jsonl" in problems[2]
    with pytest.raises(ev.BenchmarkError, match="no benchmark could be loaded"):
        ev.load_benchmarks(specs[1:], str(tmp_path))
    with pytest.raises(ev.BenchmarkError, match="unique"):
        ev.load_benchmarks([specs[0], specs[0]], str(tmp_path))
    with pytest.raises(ev.BenchmarkError, match="read_text"):
        ev.load_benchmark(ev.BenchmarkSpec(path="s3://bucket/gsm8k.jsonl"))



def test_benchmark_spec_defaults_and_repo_copies():
    assert ev.BenchmarkSpec(path="x/mt-bench.jsonl").resolved_domain() == "chat"
    assert ev.BenchmarkSpec(path="mine.jsonl", domain="law").resolved_name() == "mine"
    repo = str(REPO / "data" / "eval")
    for name, domain in (("gsm8k", "math"), ("humaneval", "code"), ("mt-bench", "chat")):
        bench = ev.load_benchmark(ev.BenchmarkSpec(path=f"{name}.jsonl"), repo)
        assert bench.domain == domain and len(bench.prompts) >= 10
    assert all(len(p) == 2 for p in ev.load_benchmark(ev.BenchmarkSpec(path="mt-bench.jsonl"), repo).prompts)



def test_prompt_seed_is_stable_and_distinct():
    assert ev.prompt_seed(0, "gsm8k", 3) == ev.prompt_seed(0, "gsm8k", 3)
    seeds = {ev.prompt_seed(s, b, i) for s in (0, 1) for b in ("gsm8k", "mt-bench") for i in range(10)}
    assert len(seeds) == 40 and all(0 <= s < 2**63 for s in seeds)



def test_second_turn_is_asked_after_the_targets_own_first_answer(tiny):
    seen = []
    sp = SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(0)

    def decode(ids, max_new_tokens):
        seen.append(list(ids))
        return target_generate(tiny, ids, sp, max_new_tokens, generator=gen)

    conv = ev.run_conversation(tiny, ["what is 2 + 3?", "and 4 + 5?"], decode, max_new_tokens=8)
    first = conv.turns[0].answer
    assert first == tiny.tokenizer.decode(conv.turns[0].tokens, skip_special_tokens=True)
    assert seen[1] == tiny.chat_ids([{"role": "user", "content": "what is 2 + 3?"},
                                     {"role": "assistant", "content": first},
                                     {"role": "user", "content": "and 4 + 5?"}])
    assert seen[1][: len(seen[0])] == seen[0]  # the first exchange is a prefix of the second prompt
    assert conv.turns[1].prompt_len == len(seen[1])



def test_real_run_tau_is_in_range_and_counts_emitted_tokens(tiny):
    drafters = {"oracle": OracleDrafter(tiny), "dspark": tiny_drafter(tiny)}
    modes = [ev.Mode(), ev.Mode("oracle"), ev.Mode("dspark")]
    settings = ev.DecodeSettings(max_new_tokens=13)
    convs = ev.evaluate_prompt(tiny, drafters, "b", 0, ["count: one two", "again"], modes, settings, seed=1)
    by_mode = {c.mode: c for c in convs}
    assert all(c.error is None for c in convs) and set(by_mode) == {"target", "oracle", "dspark"}
    for mode in ("oracle", "dspark"):
        s = ev.summarize_conversations([by_mode[mode]])
        rounds = [r for t in by_mode[mode].turns for r in t.rounds]
        assert 1 <= s["tau"] <= GAMMA + 1
        assert s["tau"] == pytest.approx(sum(r.accepted + 1 for r in rounds) / len(rounds))
        for turn in by_mode[mode].turns:  # every token after the prefill one comes from a round
            assert sum(r.emitted for r in turn.rounds) == len(turn.tokens) - 1
            if turn.finish_reason == "length":
                assert len(turn.tokens) == 13
    oracle_rounds = [r for t in by_mode["oracle"].turns for r in t.rounds]
    assert all(r.accepted == GAMMA for r in oracle_rounds)  # p_d == p_t: nothing is ever rejected
    assert ev.summarize_conversations([by_mode["oracle"]])["tau"] == GAMMA + 1



def test_results_do_not_depend_on_prompt_order(tiny):
    drafters = {"dspark": tiny_drafter(tiny)}
    modes, settings = [ev.Mode(), ev.Mode("dspark"), ev.Mode("dspark", 0.5)], ev.DecodeSettings(max_new_tokens=6)
    prompts = [("a", 0, ["hello there"]), ("a", 1, ["what is 1 + 1?"]), ("b", 0, ["def f(x):"])]

    def tokens(order):
        out = {}
        for bench, index, turns in order:
            for c in ev.evaluate_prompt(tiny, drafters, bench, index, turns, modes, settings, seed=7):
                out[(c.benchmark, c.index, c.mode)] = [t.tokens for t in c.turns]
        return out

    assert tokens(prompts) == tokens(prompts[::-1])



def test_threshold_verify_len_truncates_on_prefix_or_confidence():
    proposal = SimpleNamespace(confidences=torch.tensor([0.9, 0.8, 0.75, 0.9]))
    assert ev.threshold_verify_len(0.0)(0, proposal) == 4
    assert ev.threshold_verify_len(0.7)(0, proposal) == 2  # a = .9, .72, .54, ...
    assert ev.threshold_verify_len(0.7, on="confidence")(0, proposal) == 4
    assert ev.threshold_verify_len(0.95)(0, proposal) == 0
    with pytest.raises(ValueError, match="confidence head"):
        ev.threshold_verify_len(0.5)(0, SimpleNamespace(confidences=None))



def _rs(accepted: int, verified: int = 4) -> RoundStats:
    outcomes = [True] * accepted + ([False] if accepted < verified else [])
    return RoundStats(proposed=4, verified=verified, accepted=accepted, outcomes=outcomes, emitted=accepted + 1)



def _conv(bench, mode, accepted, wall=1.0, tokens=None, index=0):
    rounds = [_rs(a) for a in accepted]
    n = tokens if tokens is not None else 1 + sum(a + 1 for a in accepted)
    turn = ev.TurnResult(5, list(range(n)), rounds, wall_s=wall + 0.5, prefill_s=0.5, finish_reason="length", answer="")
    return ev.ConversationResult(bench, index, mode, [turn])



def synthetic_results():
    benches = [ev.Benchmark("gsm8k", "math", "g", [["q"]]), ev.Benchmark("math500", "math", "m", [["q"]]),
               ev.Benchmark("mt-bench", "chat", "c", [["q"]])]
    convs = [
        _conv("gsm8k", "target", [], wall=2.0, tokens=11),  # 10 decode tokens in 2 s -> 5 tok/s
        _conv("math500", "target", [], wall=1.0, tokens=11),
        _conv("mt-bench", "target", [], wall=1.0, tokens=11),
        _conv("gsm8k", "dspark", [4, 2, 0, 3]),  # τ = (5+3+1+4)/4 = 3.25; 13 tokens in 1 s
        _conv("math500", "dspark", [1, 1]),  # τ = 2
        _conv("mt-bench", "dspark", [0, 1]),  # τ = 1.5
        _conv("gsm8k", "dflash", [1, 1, 1, 2]),  # τ = 2.25
        _conv("math500", "dflash", [0, 1]),  # τ = 1.5
        _conv("mt-bench", "dflash", [0, 0]),  # τ = 1
        ev.ConversationResult("mt-bench", 1, "dflash", error="mt-bench[1] dflash: prompt too long"),
    ]
    sweep_convs = [_conv("gsm8k", "dspark@0.5", [1, 2]), _conv("math500", "dspark@0.5", [0])]
    sweep_convs[0].turns[0].rounds = [_rs(1, verified=2), _rs(2, verified=2)]
    sweep_convs[1].turns[0].rounds = [_rs(0, verified=1)]
    return ev.aggregate(convs + sweep_convs, benches, {"dspark": "dspark", "dflash": "dflash"},
                        sweep_modes=[ev.Mode("dspark", 0.5)])



def test_aggregate_matches_hand_computed_values():
    res = synthetic_results()
    g = res["drafters"]["dspark"]["per_benchmark"]["gsm8k"]
    assert g["tau"] == pytest.approx(3.25)
    # accepted [4, 2, 0, 3]: k=1: 3/4; k=2: 3/3; k=3: 2/3; k=4: 1/2
    assert g["cond_accept"] == pytest.approx({1: 0.75, 2: 1.0, 3: 2 / 3, 4: 0.5})
    assert g["prefix_survival"] == pytest.approx({1: 0.75, 2: 0.75, 3: 0.5, 4: 0.25})
    assert g["mean_proposal_len"] == 4
    assert g["decode_tokens_per_s"] == pytest.approx(13.0)
    assert g["speedup"] == pytest.approx(13.0 / 5.0)
    math = res["drafters"]["dspark"]["per_domain"]["math"]  # macro: unweighted mean of gsm8k and math500
    assert math["tau"] == pytest.approx((3.25 + 2.0) / 2)
    assert math["cond_accept"][1] == pytest.approx((0.75 + 1.0) / 2)
    assert res["drafters"]["dspark"]["overall"]["tau"] == pytest.approx((3.25 + 2 + 1.5) / 3)
    ratio = res["ratios"]["dspark/dflash"]
    assert ratio["per_benchmark"]["gsm8k"]["tau"] == pytest.approx(3.25 / 2.25)
    assert ratio["per_domain"]["chat"]["tau"] == pytest.approx(1.5 / 1.0)
    assert res["drafters"]["dflash"]["per_benchmark"]["mt-bench"]["errors"] == 1
    assert any("prompt too long" in w for w in res["warnings"])
    math_sweep = res["threshold_sweep"]["dspark"]["math"]
    assert math_sweep == [{"threshold": 0.5, "rounds": 3, "verified_per_step": 5 / 3, "accepted_per_step": 1.0,
                           "rejected_per_step": 2 / 3, "acceptance_rate": 0.6, "tau": 2.0}]
    json.dumps(res)  # results.json must serialise



def test_comparison_pairs_use_dspark_as_reference():
    assert ev.comparison_pairs({"a": "eagle3", "b": "dspark", "c": "dflash"}) == [("b", "a"), ("b", "c")]
    assert ev.comparison_pairs({"x": "dflash", "y": "eagle3"}) == [("x", "y")]
    assert ev.comparison_pairs({"x": "dflash"}) == []
    with pytest.raises(ValueError, match="reference"):
        ev.comparison_pairs({"x": "dflash", "y": "eagle3"}, reference="z")



def test_markdown_report_and_plots(tmp_path):
    res = synthetic_results()
    md = report.markdown_report(res, title="t")
    assert "| dspark | 3.25 | 2.00 | 1.50 | 2.62 | 1.50 | 2.25 |" in md
    assert "| dspark/dflash | 1.44 |" in md and "target tokens/s" in md and "static threshold sweep" in md
    for plot in (report.plot_tau_by_benchmark(res, str(tmp_path / "tau.png")),
                 report.plot_cond_accept(res, str(tmp_path / "cond.png")),
                 report.plot_threshold_sweep(res["threshold_sweep"], str(tmp_path / "sweep.png"))):
        with open(plot, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"



def test_parse_ref_kinds():
    from dspark.io.drafter_source import parse_ref

    assert parse_ref("/tmp/x").kind == "local" and parse_ref("s3://b/k").kind == "s3"
    assert parse_ref("runs:/abc/drafter").kind == "run"
    ref = parse_ref("models:/tiny-dspark@latest")
    assert (ref.kind, ref.model_name, ref.model_version) == ("model", "tiny-dspark", "@latest")
    assert parse_ref("models:/m/3").model_version == "3"
    with pytest.raises(ValueError, match="unsupported scheme"):
        parse_ref("gs://b/k")
    with pytest.raises(ValueError, match="expected models"):
        parse_ref("models:/only-name")



def test_drafter_references_resolve_through_mlflow(tiny, tmp_path, monkeypatch):
    """Local dir, runs:/ and models:/ (alias and version) all load the same weights; a drafter built
    for another target is refused with its reference in the message."""
    import mlflow

    from dspark.io.drafter_source import load_drafter_ref, local_dir, resolve_ref

    monkeypatch.setenv("MLFLOW_TRACKING_URI", new_sqlite_store(tmp_path))
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))
    saved = save_drafter(tiny_drafter(tiny), str(tmp_path / "drafter"))
    run_id, version = register_drafter_dir(saved, tmp_path / "artifacts", "t", "tiny-d")
    mlflow.MlflowClient().set_registered_model_alias("tiny-d", "best", version)
    assert resolve_ref("models:/tiny-d@latest").uri == f"models:/tiny-d/{version}"  # no such alias: newest
    assert resolve_ref("models:/tiny-d@best").model_version == str(version)
    weights = None
    for ref in (saved, f"runs:/{run_id}/drafter", "models:/tiny-d@best", f"models:/tiny-d/{version}"):
        drafter = load_drafter_ref(ref, tiny)
        state = {k: v.clone() for k, v in drafter.state_dict().items()}
        weights = weights or state
        assert all(torch.equal(weights[k], state[k]) for k in weights)
    assert os.path.isfile(os.path.join(local_dir(f"runs:/{run_id}/drafter"), "config.json"))
    with pytest.raises(ValueError, match=r"drafter models:/tiny-d/1: .*another target"):
        load_drafter_ref("models:/tiny-d/1", build_tiny_model(vocab_size=16))
    with pytest.raises(FileNotFoundError, match="not found"):
        local_dir(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="nothere"):
        resolve_ref("models:/tiny-d@nothere")



def test_drafter_cache_is_keyed_by_tracking_server(tiny, tmp_path, monkeypatch):
    """Two MLflow stores register the same name and version with different weights: each loads its own."""
    from dspark.io.drafter_source import load_drafter_ref

    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))  # one cache, shared by both stores
    states = {}
    for store in ("a", "b"):
        drafter = tiny_drafter(tiny, seed={"a": 1, "b": 2}[store])
        saved = save_drafter(drafter, str(tmp_path / store / "drafter"))
        uri = new_sqlite_store(tmp_path / store)
        assert register_drafter_dir(saved, Path(saved).parent / "artifacts", "t", "same-name", uri)[1] == "1"
        states[uri] = {k: v.clone() for k, v in drafter.state_dict().items()}
    assert not all(torch.equal(v, states[f"sqlite:///{tmp_path / 'b' / 'mlflow.db'}"][k])
                   for k, v in states[f"sqlite:///{tmp_path / 'a' / 'mlflow.db'}"].items())
    for uri in list(states) * 2:  # a, b, a, b: the second round is served from the cache
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        loaded = load_drafter_ref("models:/same-name/1", tiny).state_dict()
        assert all(torch.equal(loaded[k], states[uri][k]) for k in states[uri]), f"wrong weights from {uri}"
    assert len(list((tmp_path / "cache" / "drafters").iterdir())) == 2



def job_config(tmp_path, drafters: list[str], num_workers: int, **extra):
    from jobs.evaluate import EvalConfig

    bench_dir = tmp_path / "bench"
    bench_dir.mkdir(exist_ok=True)
    write_jsonl(bench_dir / "gsm8k.jsonl", [{"turns": ["what is 2 + 3?"]}, {"turns": ["one plus two"]}])
    write_jsonl(bench_dir / "mt-bench.jsonl", [{"turns": ["say hello", "now say it again"]}])
    (bench_dir / "humaneval.jsonl").write_text("{broken\n")
    data = {"target": "tiny", "drafters": drafters, "benchmark_dir": str(bench_dir),
            "benchmarks": [{"path": "gsm8k.jsonl"}, {"path": "humaneval.jsonl"}, {"path": "mt-bench.jsonl"}],
            "decode": {"max_new_tokens": 8}, "output": str(tmp_path / f"out{num_workers}"),
            "threshold_sweep": {"enabled": True, "thresholds": [0.0, 0.5], "max_prompts_per_benchmark": 1},
            "workers": {"num_workers": num_workers}, "ray": {"num_cpus": 2},
            "tracking": {"experiment": "eval-test"}, **extra}
    return EvalConfig.model_validate(data)



@pytest.fixture
def two_drafters(tiny, tmp_path):
    return [save_drafter(tiny_drafter(tiny, "dspark", seed=1), str(tmp_path / "dspark")),
            save_drafter(tiny_drafter(tiny, "dflash", seed=2), str(tmp_path / "dflash"))]



def test_evaluate_job_refuses_a_drafter_for_another_target(tmp_path, two_drafters, monkeypatch):
    from jobs.evaluate import run

    monkeypatch.setenv("MLFLOW_TRACKING_URI", new_sqlite_store(tmp_path))
    other = build_tiny_model(vocab_size=16)
    wrong = save_drafter(tiny_drafter(other), str(tmp_path / "wrong"))
    with pytest.raises(ValueError, match=r"cannot evaluate: drafter .*wrong.*another target"):
        run(job_config(tmp_path, two_drafters + [wrong], num_workers=0))


def test_a_speedup_above_tau_is_reported_as_a_broken_baseline_not_quoted():
    from dspark.eval.evaluate import _guard_speedup

    warnings: list[str] = []
    broken, fine = {"tau": 1.4, "speedup": 1.9}, {"tau": 1.4, "speedup": 1.3}
    _guard_speedup(broken, "drafter 'd' on benchmark 'b'", warnings)
    _guard_speedup(fine, "drafter 'd' on benchmark 'c'", warnings)
    assert broken["speedup"] is None and broken["speedup_above_tau"] == 1.9
    assert fine == {"tau": 1.4, "speedup": 1.3}
    assert len(warnings) == 1 and "broken target-only baseline" in warnings[0] and "'b'" in warnings[0]


def test_oversized_prompts_and_answer_budgets_are_clipped_or_skipped_and_counted(tiny):
    """A prompt near the context end gets max_new_tokens cut to what is left (the turn says so, the results
    count it); a prompt past the context is skipped as prompt_too_long and counted, never a crash in a forward."""
    limit, settings = tiny.max_positions, ev.DecodeSettings(greedy=True, max_new_tokens=64)
    overhead = len(tiny.chat_ids([{"role": "user", "content": "x " * 100}])) - 100  # "x " is one token
    near_end = "x " * (limit - 30 - overhead)
    prompt_len = len(tiny.chat_ids([{"role": "user", "content": near_end}]))
    assert prompt_len + 1 < limit < prompt_len + 64 + 1  # the answer budget must be cut
    (clipped,) = ev.evaluate_prompt(tiny, {}, "long", 0, [near_end], [ev.Mode()], settings, seed=0)
    assert clipped.error is None and clipped.turns[0].clipped
    assert len(clipped.turns[0].tokens) <= limit - prompt_len - 1
    (skipped,) = ev.evaluate_prompt(tiny, {}, "long", 1, ["x " * 25_000], [ev.Mode()], settings, seed=0)
    assert "prompt_too_long" in skipped.error
    summary = ev.summarize_conversations([clipped, skipped])
    assert (summary["clipped_turns"], summary["errors"], summary["prompts"]) == (1, 1, 1)
    results = ev.aggregate([clipped, skipped], [ev.Benchmark("long", "chat", "x", [[near_end]])], {})
    assert any("max_new_tokens cut" in w for w in results["warnings"])
