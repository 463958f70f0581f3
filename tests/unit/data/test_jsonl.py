"""JSONL is split on "\n" only: U+2028, U+2029, \x85 and \x1c-\x1e are legal raw inside JSON strings."""
from __future__ import annotations

import json

from dspark.eval import evaluate as ev
from dspark.data.jsonl import jsonl_lines
from dspark.data.prompts import PromptSource, load_prompts

# Each question holds a character str.splitlines() breaks at; JSON allows all of them unescaped.
QUESTIONS = ["first\u2028line separator", "para\u2029graph separator", "next\x85line", "group\x1dseparator"]


def _jsonl_text(records: list[dict]) -> str:
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    assert "\u2028" in text and "\x85" in text  # written raw, not as \\u escapes
    return text


def test_jsonl_lines_split_on_newline_only():
    text = 'a\u2028b\r\n\n  \nc\x85d\n'
    assert list(jsonl_lines(text)) == [(1, "a\u2028b"), (4, "c\x85d")]


def test_benchmark_with_unicode_separators_in_strings_parses():
    text = _jsonl_text([{"turns": [q]} for q in QUESTIONS])
    assert ev.parse_benchmark(text, "bench.jsonl") == [[q] for q in QUESTIONS]


def test_prompt_source_with_unicode_separators_in_strings_loads(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(_jsonl_text([{"turns": [q]} for q in QUESTIONS]), encoding="utf-8")
    result = load_prompts([PromptSource(uri=str(path))], holdout_fraction=0.0)
    assert result.errors == []
    assert sorted(p.turns[0] for p in result.prompts) == sorted(QUESTIONS)
    assert result.records_read == len(QUESTIONS)


def test_jsonl_lines_on_bytes_keep_line_numbers_of_undecodable_lines():
    data = '{"a": "x\u2028y"}\r\n\n'.encode() + b'\xff\xfe\n{"b": 1}\n'
    assert list(jsonl_lines(data)) == [(1, '{"a": "x\u2028y"}'.encode()), (3, b"\xff\xfe"), (4, b'{"b": 1}')]
