"""Prompt sources: every input format, normalisation, stable ids, split, domain, bad records."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dspark.data.prompts import (BadRecord, PromptSource, load_prompts, normalise_text, parse_record, prompt_id_of,
                               split_of)
from tests.job_files import write_jsonl
from tests.paths import FIXTURES, REPO


def test_record_formats_parse_to_the_same_prompt():
    turns = [{"turns": ["Hi there", "And then?"]},
             {"messages": [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "old answer"},
                           {"role": "user", "content": [{"type": "text", "text": "And then?"}]}]},
             {"conversations": [{"from": "human", "value": "Hi there"}, {"from": "gpt", "value": "x"},
                                {"from": "human", "value": "And then?"}]}]
    parsed = [parse_record(r) for r in turns]
    assert parsed == [("", ["Hi there", "And then?"])] * 3
    assert parse_record({"prompt": "  Solve x \r\n"}) == ("", ["Solve x"])
    system = parse_record({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q"}]})
    assert system == ("Be brief.", ["Q"])


@pytest.mark.parametrize("record, reason", [
    ([1, 2], "bad_record"),
    ({"text": "no known field"}, "bad_record"),
    ({"turns": "not a list"}, "bad_record"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "bad_record"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "system", "content": "late"}]}, "bad_record"),
    ({"messages": [{"role": "assistant", "content": "only an answer"}]}, "no_user_turn"),
    ({"turns": []}, "no_user_turn"),
    ({"turns": ["ok", "   "]}, "empty_prompt"),
    ({"prompt": ""}, "empty_prompt"),
])
def test_bad_records_name_their_reason(record, reason):
    with pytest.raises(BadRecord) as err:
        parse_record(record)
    assert err.value.reason == reason and err.value.detail


def test_prompt_id_is_stable_and_normalised():
    a = prompt_id_of("", [normalise_text("Caf\u0065\u0301 question\r\n ")])
    b = prompt_id_of("", [normalise_text("Caf\u00e9 question")])
    assert a == b and len(a) == 32
    assert prompt_id_of("sys", ["q"]) != prompt_id_of("", ["q"])
    assert prompt_id_of("", ["q1", "q2"]) != prompt_id_of("", ["q1 q2"])
    assert a == "%s" % prompt_id_of("", ["Café question"])  # same value across calls/processes


def test_split_is_deterministic_and_close_to_the_fraction():
    ids = [prompt_id_of("", [f"prompt {i}"]) for i in range(4000)]
    splits = [split_of(i, 0.1) for i in ids]
    assert splits == [split_of(i, 0.1) for i in ids]
    assert 0.08 < splits.count("holdout") / len(ids) < 0.12
    assert all(split_of(i, 0.0) == "train" for i in ids)


def test_load_jsonl_collapses_duplicates_and_collects_errors(tmp_path):
    path = tmp_path / "mixed.jsonl"
    write_jsonl([{"turns": ["What is 2+2?"]}, '{"turns": ["broken"', {"turns": ["What is 2+2?  "]},
                 {"messages": [{"role": "assistant", "content": "x"}]}, {"turns": [""]},
                 {"conversations": [{"from": "human", "value": "Write code"}], "domain": "code"}, ""], str(path))
    result = load_prompts([PromptSource(uri=str(path), domain="math")], holdout_fraction=0.0)
    assert [p.turns for p in result.prompts] == [["What is 2+2?"], ["Write code"]]
    assert result.records_read == 6 and result.duplicates == 1  # the blank line is skipped
    assert [p.domain for p in result.prompts] == ["math", "math"]  # the source tag wins over the record's
    assert [(e["reason"], e["location"].rsplit(":", 1)[1]) for e in result.errors] == [
        ("malformed_json", "2"), ("no_user_turn", "4"), ("empty_prompt", "5")]
    assert all(e["source"] == "mixed.jsonl" and e["raw"] for e in result.errors)


def test_load_parquet_directory_and_hf_disk(tmp_path):
    import datasets

    table_dir = tmp_path / "tables"
    table_dir.mkdir()
    pq.write_table(pa.Table.from_pylist([{"prompt": "p1"}, {"prompt": "p2"}]), table_dir / "a.parquet")
    pq.write_table(pa.Table.from_pylist([{"prompt": "p3"}]), table_dir / "b.parquet")
    ds = datasets.DatasetDict({"train": datasets.Dataset.from_list(
        [{"messages": [{"role": "user", "content": "h1"}]}, {"messages": [{"role": "user", "content": "p1"}]}])})
    ds.save_to_disk(str(tmp_path / "hf"))
    sources = [PromptSource(uri=str(table_dir), name="tables", domain="chat"),
               PromptSource(uri=str(tmp_path / "hf"), limit=5)]
    result = load_prompts(sources, holdout_fraction=0.5)
    assert [(p.source, p.turns[0]) for p in result.prompts] == [
        ("tables", "p1"), ("tables", "p2"), ("tables", "p3"), ("hf", "h1")]
    assert result.duplicates == 1 and not result.errors
    assert {p.split for p in result.prompts} <= {"train", "holdout"}


def test_sources_read_through_the_callers_files(tmp_path):
    """The edges pass dspark.io.storage as `files`: on local paths it reads exactly what the local default
    reads; without it an object-store URI is refused with the fix (never taken for a local path)."""
    from dspark.io import storage

    (tmp_path / "src").mkdir()
    pq.write_table(pa.Table.from_pylist([{"prompt": "p1"}, {"prompt": "p2"}]), tmp_path / "src" / "a.parquet")
    pq.write_table(pa.Table.from_pylist([{"prompt": "p3"}]), tmp_path / "src" / "b.parquet")
    write_jsonl([{"turns": ["q1", "q2"]}, "not json"], str(tmp_path / "one.jsonl"), storage)
    sources = [PromptSource(uri=str(tmp_path / "src")), PromptSource(uri=str(tmp_path / "one.jsonl"))]
    default, through = load_prompts(sources, 0.5), load_prompts(sources, 0.5, files=storage)
    assert [p.as_row() for p in through.prompts] == [p.as_row() for p in default.prompts]
    assert [p.turns for p in default.prompts] == [["p1"], ["p2"], ["p3"], ["q1", "q2"]]
    assert through.errors == default.errors and [e["reason"] for e in default.errors] == ["malformed_json"]
    for uri in ("s3://bucket/prompts.jsonl", "s3://bucket/prefix"):
        with pytest.raises(ValueError, match="files=dspark.io.storage"):
            load_prompts([PromptSource(uri=uri)])
    with pytest.raises(ValueError, match="files=dspark.io.storage"):
        write_jsonl([{"turns": ["q"]}], "s3://bucket/prompts.jsonl")
    assert not (tmp_path / "s3:").exists() and not Path("s3:").exists()


def test_limit_and_missing_source(tmp_path):
    path = tmp_path / "p.jsonl"
    write_jsonl([{"turns": [f"q{i}"]} for i in range(10)], str(path))
    assert len(load_prompts([PromptSource(uri=str(path), limit=3)]).prompts) == 3
    with pytest.raises(FileNotFoundError, match="sources"):
        load_prompts([PromptSource(uri=str(tmp_path / "missing.jsonl"))])
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="file_format"):
        load_prompts([PromptSource(uri=str(tmp_path / "notes.txt"))])


def test_repo_eval_prompts_load_cleanly():
    path = REPO / "data" / "eval" / "mt-bench.jsonl"
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    result = load_prompts([PromptSource(uri=str(path), domain="chat")])
    assert len(result.prompts) == len(lines) and not result.errors
    assert all(len(p.turns) == 2 for p in result.prompts)
    json.dumps([p.as_row() for p in result.prompts])  # rows are plain JSON-able data for Ray


# ---------------------------------------------------------------- real corpora fixtures (tests/fixtures/corpora)
CORPORA = FIXTURES / "corpora"


def _load_one(**src):
    return load_prompts([PromptSource(**src)])


def test_sharegpt_jsonl_fixture_all_and_first_user_turns():
    uri = str(CORPORA / "sharegpt.jsonl")
    result = _load_one(uri=uri, record_format="sharegpt")
    assert [(p.system, p.turns) for p in result.prompts] == [
        ("You are terse.", ["How do I boil an egg?", "And a soft one?"]),
        ("", ["Name three primary colours.\u2028Keep it short."])]  # U+2028 stays inside its line
    errors = {e["location"]: (e["reason"], e["detail"]) for e in result.errors}
    assert errors == {f"{uri}:3": ("missing_field", "field 'conversations' is missing or null (record_format sharegpt)"),
                      f"{uri}:4": ("empty_prompt", "field 'conversations': user turn 0 is empty")}
    first = _load_one(uri=uri, record_format="sharegpt", user_turns="first")
    assert first.prompts[0].turns == ["How do I boil an egg?"]
    renamed = _load_one(uri=uri, record_format="sharegpt", field="dialog")  # the other rows now miss `dialog`
    assert [p.turns for p in renamed.prompts] == [["wrong field name"]] and len(renamed.errors) == 3


def test_openai_messages_parquet_fixture():
    uri = str(CORPORA / "openai_messages.parquet")
    result = _load_one(uri=uri, record_format="messages", domain="code")
    assert [(p.system, p.turns, p.domain) for p in result.prompts] == [
        ("", ["Write a Python function that reverses a string.", "Now without slicing."], "code"),
        ("Answer in French.", ["What is the capital of Italy?"], "code")]
    assert [(e["location"], e["reason"]) for e in result.errors] == [(f"{uri}#2", "missing_field")]
    assert "'messages'" in result.errors[0]["detail"]


def test_plain_prompt_jsonl_fixture():
    uri = str(CORPORA / "prompt.jsonl")
    result = _load_one(uri=uri, record_format="prompt")
    assert [p.turns for p in result.prompts] == [["A train travels 60 km in 45 minutes. What is its average speed "
                                                  "in km/h?"]]
    assert [(e["location"], e["reason"]) for e in result.errors] == [(f"{uri}:2", "empty_prompt"),
                                                                      (f"{uri}:3", "missing_field")]
    auto = _load_one(uri=uri)  # auto: the last record has none of the known fields
    assert [e["reason"] for e in auto.errors] == ["empty_prompt", "bad_record"]


def test_instruction_save_to_disk_fixture():
    uri = str(CORPORA / "instruction_hf")
    result = _load_one(uri=uri, record_format="instruction")
    assert [p.turns for p in result.prompts] == [
        ["Summarise the following paragraph in one sentence.\n\nBees pollinate many crops."],
        ["List four prime numbers greater than 10."]]
    assert [(e["location"], e["reason"]) for e in result.errors] == [(f"{uri}#2", "missing_field")]
    assert [p.turns for p in _load_one(uri=uri).prompts] == [p.turns for p in result.prompts]  # auto finds it


def test_field_mapping_needs_an_explicit_format():
    with pytest.raises(ValueError, match="record_format"):
        PromptSource(uri="x.jsonl", field="dialog")


def test_unreadable_files_name_the_file(tmp_path):
    bad = tmp_path / "broken.parquet"
    bad.write_bytes(b"PAR1 not really parquet")
    with pytest.raises(ValueError, match="broken.parquet"):
        load_prompts([PromptSource(uri=str(bad))])
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    result = load_prompts([PromptSource(uri=str(latin))])
    assert [p.turns for p in result.prompts] == [["ok"]]
    assert [(e["location"], e["reason"]) for e in result.errors] == [(f"{latin}:2", "bad_encoding")]
