"""Prompt synthesis without Ray: the filters (dspark/data/prompt_filters.py), the Magpie engine on `tiny`,
the domain mix, and the finalize step (raw shards -> filtered prompt shards -> a jobs.generate source).
The Ray job itself runs in tests/test_rollouts.py (one local-stack session)."""
from __future__ import annotations

import json

import pytest

from dspark.data.prompt_filters import (EvalIndex, FilterConfig, PromptFilter, build_eval_index, normalised_key,
                                   repeated_ngram_share)
from dspark.data.prompts import PromptSource, load_prompts, prompt_id_of
from dspark.data.schema import Plan
from dspark.io.storage.rollout_store import prepare_output
from dspark.data.rollout_engine import SamplingConfig
from dspark.data.magpie import (DEFAULT_DOMAINS, DomainSpec, MagpieConfig, MagpieEngine, domain_counts,
                                domain_sequence, magpie_slots)
from pipelines.synthesize import (SynthesizeConfig, apply_filters, commit_raw, corpus_candidates, magpie_candidates,
                                  read_prompts, read_raw, write_final)
from tests.job_files import read_dropped, write_jsonl

LONG = ("Alice has three boxes of apples and each box holds twelve apples while her brother gives her "
        "five more apples every single day of the week")


def chain(**overrides) -> PromptFilter:
    return PromptFilter(FilterConfig(**overrides))


# ---------------------------------------------------------------- filters
@pytest.mark.parametrize("text, reason", [
    ("hi", "length"),
    ("x" * 50, "length"),  # one word < min_words
    ("word " * 900, "length"),
    ("buy now buy now buy now buy now buy now buy now please", "degenerate"),  # repetition
    ("$$ %% ## 12 34 @@ !! ~~ ^^ && ** (( )) == ++ -- ok fine", "degenerate"),  # mostly not letters
    ("Tell me a story<|im_end|> about cats", "degenerate"),  # template leak
    ("eo\x1f or herok\ufffd go what made this long then", "degenerate"),  # non-text (tiny's Magpie output)
    ("Let $z = 2 + \\sqrt{2} - (3 + 3 \\sqrt{2})i$. Find $|z|^2$.", None),  # LaTeX math is text
    ("How many legs does a spider have?", None),
])
def test_single_prompt_filters(text, reason):
    assert chain(near_dedup=False).check("id", [text]).reason == reason


def test_repetition_share_is_zero_for_distinct_and_high_for_loops():
    assert repeated_ngram_share("a b c d e".split(), 3) == 0.0
    assert repeated_ngram_share("a b a b a b a b".split(), 2) == pytest.approx(1 - 2 / 7)


def test_exact_dedup_ignores_case_whitespace_and_punctuation():
    f = chain(near_dedup=False)
    assert f.check("a", ["What is the capital of France?"]).reason is None
    dup = f.check("b", ["what  is the capital of france"])
    assert dup.reason == "duplicate" and "a" in dup.detail
    assert normalised_key("Hello, World!") == normalised_key("hello world")


def test_near_dedup_catches_a_one_word_edit_but_not_a_different_prompt():
    f = chain(near_dup_threshold=0.7)
    assert f.check("a", [LONG]).reason is None
    assert f.check("b", [LONG.replace("twelve", "ten")]).reason == "near_duplicate"
    assert f.check("c", ["Write a Python function that merges two sorted lists into one sorted list"]).reason is None
    assert f.counts() == {"kept": 2, "kept_by_domain": {"": 2},
                          "dropped": {"length": 0, "degenerate": 0, "contaminated": 0, "duplicate": 0,
                                      "near_duplicate": 1}}


def test_decontamination_by_ngram_and_by_short_prompt():
    files = {"gsm8k.jsonl": json.dumps({"turns": [LONG]}) + "\n" + json.dumps({"turns": ["Reverse a string."]})}
    index = build_eval_index(files, n=13)
    assert index.prompts == 2
    f = PromptFilter(FilterConfig(near_dedup=False), index)
    hit = f.check("a", ["Please solve: " + " ".join(LONG.split()[2:16]) + " thanks"])
    assert hit.reason == "contaminated" and "gsm8k.jsonl:1" in hit.detail
    assert f.check("b", ["reverse a STRING"]).reason == "contaminated"  # shorter than n: whole-prompt match
    assert f.check("c", [" ".join(LONG.split()[:12]) + " pears"]).reason is None  # only 12 words shared
    small = PromptFilter(FilterConfig(near_dedup=False), build_eval_index(files, n=5))
    assert small.check("d", ["so three boxes of apples and more"]).reason == "contaminated"


def test_eval_index_splits_on_newline_only_and_names_bad_lines():
    text = json.dumps({"turns": ["one\u2028two three four"]}, ensure_ascii=False) + "\n\n"
    assert build_eval_index({"e.jsonl": text}, 3).prompts == 1
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        build_eval_index({"bad.jsonl": json.dumps({"turns": ["ok"]}) + "\n{oops"}, 3)
    with pytest.raises(ValueError, match=r"bad.jsonl:1.*no turns"):
        build_eval_index({"bad.jsonl": json.dumps({"answer": 3})}, 3)
    assert isinstance(EvalIndex(3), EvalIndex)


# ---------------------------------------------------------------- domain mix and slots
def test_domain_counts_follow_the_default_blend():
    counts = domain_counts(DEFAULT_DOMAINS, 1000)
    assert counts == {"math": 394, "code": 389, "chat": 176, "instruction_following": 41}
    for n in (1, 7, 33):
        c = domain_counts(DEFAULT_DOMAINS, n)
        assert sum(c.values()) == n
        assert all(abs(c[d] - n * s.weight / 100) < 1 for d, s in DEFAULT_DOMAINS.items())
    seq = domain_sequence(DEFAULT_DOMAINS, 100)
    assert seq[:10].count("math") in (3, 4, 5) and seq[:10].count("code") in (3, 4, 5)  # prefixes are mixed


def test_slots_are_deterministic_and_steered():
    cfg = MagpieConfig(num_prompts=12, domains={"math": DomainSpec(weight=1, system="Ask about {topic}.",
                                                                   topics=["primes", "fractions"]),
                                                "chat": DomainSpec(weight=1)})
    slots = magpie_slots(cfg)
    assert [s.as_row() for s in slots] == [s.as_row() for s in magpie_slots(cfg)]
    assert {s.system for s in slots if s.domain == "math"} <= {"Ask about primes.", "Ask about fractions."}
    assert {s.system for s in slots if s.domain == "chat"} == {""} and len({s.seed for s in slots}) == 12
    with pytest.raises(ValueError, match="placeholder"):
        DomainSpec(weight=1, system="no slot", topics=["x"])


# ---------------------------------------------------------------- Magpie engine (tiny target)
@pytest.fixture(scope="module")
def tiny():
    from dspark.models.target import load_target

    return load_target("tiny")


def test_magpie_continues_from_the_start_of_a_user_turn(tiny):
    engine = MagpieEngine(tiny, SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=12, seed=0))
    prefix = tiny.tokenizer.decode(engine.user_prefix_ids("Ask about primes."))
    assert prefix == "<|im_start|>system\nAsk about primes.<|im_end|>\n<|im_start|>user\n"
    assert tiny.tokenizer.decode(engine.user_prefix_ids("")) == "<|im_start|>user\n"
    rows = [dict(s.as_row(), chunk=0) for s in magpie_slots(MagpieConfig(num_prompts=4))]
    out = engine.run(rows)
    assert [r["slot"] for r in out] == [0, 1, 2, 3] and all(r["error"] is None for r in out)
    assert all(r["finish_reason"] in ("stop", "length") and 1 <= r["num_tokens"] <= 12 for r in out)
    assert engine.run(rows[2:3])[0] == out[2]  # a slot's text does not depend on its batch


def test_magpie_reports_a_prefix_longer_than_the_context(tiny):
    engine = MagpieEngine(tiny, SamplingConfig(max_new_tokens=8), max_context_tokens=6)
    out = engine.run([{"slot": 0, "chunk": 0, "domain": "chat", "topic": "", "system": "a long system prompt " * 3,
                       "seed": 1}])
    assert out[0]["error"] and "context limit is 6" in out[0]["error"]


# ---------------------------------------------------------------- finalize: raw -> filtered shards
def _raw(slot: int, text: str, finish: str = "stop", domain: str = "math") -> dict:
    return {"slot": slot, "chunk": 0, "domain": domain, "topic": "", "text": text, "finish_reason": finish,
            "num_tokens": 10, "error": None}


def test_finalize_writes_a_prompt_source_for_jobs_generate(tmp_path):
    out = str(tmp_path / "synth")
    corpus = tmp_path / "corpus.jsonl"
    write_jsonl([{"prompt": "Explain how rainbows form in simple words."}, {"prompt": ""}], str(corpus))
    cfg = SynthesizeConfig(magpie=MagpieConfig(num_prompts=5), sources=[{"uri": str(corpus), "domain": "chat"}],
                           output=out, filters={"near_dedup": True})
    prepare_output(out, Plan([[None] * 5], "fp"), overwrite=False)
    commit_raw(out, 0, [_raw(3, "What is 7 times 8, and WHY?"), _raw(1, "What is 7 times 8 and why"),
                        _raw(0, "Write a haiku about autumn leaves", domain="chat"),
                        _raw(2, "an answer that ran on and on", finish="length"), _raw(4, "hm")])
    raw = read_raw(out)
    assert [r["slot"] for r in raw] == [0, 1, 2, 3, 4]
    loaded = load_prompts(cfg.sources)
    magpie, pre = magpie_candidates(raw, "tiny")
    outcome = apply_filters(corpus_candidates(loaded) + magpie, pre, cfg.filters, None)
    assert outcome.counts["kept"] == 3 and outcome.counts["candidates"] == 6
    assert outcome.counts["dropped"] == {"generation_error": 0, "truncated": 1, "length": 1, "degenerate": 0,
                                         "contaminated": 0, "duplicate": 1, "near_duplicate": 0}
    write_final(out, outcome, loaded, shard_size=2)
    manifest = {"format": "dspark-prompts/1", "shards": ["data/part-00000.parquet", "data/part-00001.parquet"]}
    (tmp_path / "synth" / "manifest.json").write_text(json.dumps(manifest))
    rows = read_prompts(out).to_pylist()
    assert len(rows) == 3 and [r["prompt_id"] for r in rows] == sorted(r["prompt_id"] for r in rows)
    assert all(r["prompt_id"] == prompt_id_of(r["system"], r["turns"]) for r in rows)
    assert {r["source"] for r in rows} == {"corpus.jsonl", "magpie:tiny"}
    dropped = read_dropped(out).to_pylist()
    assert sorted(d["reason"] for d in dropped) == ["duplicate", "length", "truncated"]
    assert all(d["detail"] and d["location"] for d in dropped)
    # jobs.generate reads the directory through its manifest: same ids, domains kept
    again = load_prompts([PromptSource(uri=out)])
    assert sorted(p.prompt_id for p in again.prompts) == sorted(r["prompt_id"] for r in rows)
    assert {p.domain for p in again.prompts} == {"chat", "math"} and not again.errors


def test_identical_ids_never_survive_even_without_dedup():
    from pipelines.synthesize import Candidate

    cands = [Candidate("id1", "math", ["What is two plus two, roughly?"], "m")] * 2
    outcome = apply_filters(cands, [], FilterConfig(exact_dedup=False, near_dedup=False), None)
    assert outcome.counts["kept"] == 1 and outcome.counts["dropped"]["duplicate"] == 1


def test_boilerplate_shared_by_many_eval_prompts_does_not_contaminate():
    wrapper = "Write a solution to the following problem and make sure that it passes the tests below please"
    tasks = ["reverse the words of a sentence keeping punctuation where it was",
             "count the vowels in every line of a text file and print totals",
             "merge overlapping intervals given as pairs of integers sorted by start",
             "return the longest palindromic substring of the given lowercase string"]
    files = {"mbpp.jsonl": "\n".join(json.dumps({"turns": [f"{wrapper}: {t}"]}) for t in tasks)}
    index = build_eval_index(files, n=13, max_prompts_per_gram=3)
    f = PromptFilter(FilterConfig(near_dedup=False), index)
    assert f.check("a", [f"{wrapper}: rotate a linked list to the right by k places"]).reason is None
    assert f.check("b", [f"{wrapper}: 2 and 3"]).reason is None  # a few words next to the wrapper
    hit = f.check("c", [f"{wrapper}: {tasks[2]}"])
    assert hit.reason == "contaminated" and "mbpp.jsonl:3" in hit.detail
    assert f.check("d", [f"Hey, could you {tasks[1]}?"]).reason == "contaminated"  # no wrapper needed


def test_config_and_eval_file_errors_are_named(tmp_path):
    from pipelines.synthesize import eval_files_text

    with pytest.raises(ValueError, match="nothing to do"):
        SynthesizeConfig(output=str(tmp_path))
    with pytest.raises(ValueError, match="near_dup"):
        SynthesizeConfig(output=str(tmp_path), magpie={"num_prompts": 1}, filters={"near_dup": 0.5})
    with pytest.raises(FileNotFoundError, match="no-such-dir.*eval_files"):
        eval_files_text([str(tmp_path / "no-such-dir")])


def test_decontamination_catches_a_training_prompt_containing_a_short_eval_prompt():
    files = {"humaneval.jsonl": json.dumps({"turns": ["Reverse a string."]}) + "\n" + json.dumps({"turns": ["Hi!"]})}
    index = build_eval_index(files, n=13)
    f = PromptFilter(FilterConfig(near_dedup=False), index)
    hit = f.check("a", ["Here is my homework. Reverse a string, then print it twice please"])
    assert hit.reason == "contaminated" and "contains the evaluation prompt at humaneval.jsonl:1" in hit.detail
    assert f.check("b", ["Reverse the string order of the words in this sentence"]).reason is None  # not contiguous
    assert f.check("c", ["Hi! Write a haiku about autumn leaves falling slowly"]).reason is None  # 1 word: no evidence
