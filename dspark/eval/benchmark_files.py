"""Benchmark files of the offline evaluation: `{"turns": [...]}` JSONL, local or s3:// (through a given
reader), each with a name and a domain (math / code / chat / ...). `BenchmarkSpec` names a file,
`load_benchmarks` reads them into `Benchmark`s (a bad file becomes a warning), `parse_benchmark` checks
one file's lines; every problem is a BenchmarkError naming the file (and line)."""
from __future__ import annotations

import json
import logging
import posixpath
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from dspark.config import StrictModel
from dspark.data.jsonl import jsonl_lines

log = logging.getLogger(__name__)

KNOWN_DOMAINS = {"gsm8k": "math", "math500": "math", "aime": "math", "mbpp": "code", "humaneval": "code",
                 "livecodebench": "code", "mt-bench": "chat", "alpaca": "chat", "arena-hard": "chat"}


class BenchmarkError(ValueError):
    """A benchmark file is missing, malformed or empty; the message names the file."""


class BenchmarkSpec(StrictModel):
    path: str  # JSONL, local or s3://; a relative path is taken under the job's benchmark_dir
    name: str | None = None  # default: file stem
    domain: str | None = None  # math / code / chat / ...; default: KNOWN_DOMAINS[name] or "other"

    def resolved_name(self) -> str:
        return self.name or self.path.rstrip("/").rsplit("/", 1)[-1].removesuffix(".jsonl")

    def resolved_domain(self) -> str:
        return self.domain or KNOWN_DOMAINS.get(self.resolved_name().lower(), "other")


@dataclass
class Benchmark:
    name: str
    domain: str
    source: str
    prompts: list[list[str]]  # the turns of each prompt


def parse_benchmark(text: str, source: str) -> list[list[str]]:
    """JSONL text -> turns per prompt. Raises BenchmarkError naming the file and line."""
    prompts = []
    for lineno, line in jsonl_lines(text):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise BenchmarkError(f"{source}:{lineno}: not valid JSON ({err.msg}); each line must be "
                                 '{"turns": ["first question", ...]}') from None
        turns = record.get("turns") if isinstance(record, dict) else None
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise BenchmarkError(f'{source}:{lineno}: expected {{"turns": [non-empty strings]}}, got {line[:80]!r}')
        prompts.append(turns)
    if not prompts:
        raise BenchmarkError(f"{source}: no prompts (empty file); add lines of the form {{\"turns\": [...]}}")
    return prompts


def load_benchmark(spec: BenchmarkSpec, base_dir: str | None = None, max_prompts: int | None = None,
                   read_text: Callable[[str], str] | None = None) -> Benchmark:
    """One benchmark file (relative paths under `base_dir`). `read_text` reads non-local sources
    (jobs pass dspark.io.storage.read_text for s3://); default: the local file."""
    source = spec.path
    if base_dir and "://" not in source and not source.startswith("/"):
        source = posixpath.join(base_dir, source)
    if read_text is None and "://" in source:
        raise BenchmarkError(f"benchmark {spec.resolved_name()!r}: {source} is not a local file; pass "
                             f"read_text (e.g. dspark.io.storage.read_text) to read object-store paths")
    try:
        text = read_text(source) if read_text else Path(source).read_text()
    except FileNotFoundError:
        raise BenchmarkError(f"benchmark {spec.resolved_name()!r}: file not found: {source} "
                             f"(check benchmark_dir / the path)") from None
    prompts = parse_benchmark(text, source)
    return Benchmark(spec.resolved_name(), spec.resolved_domain(), source, prompts[:max_prompts])


def load_benchmarks(specs: Sequence[BenchmarkSpec], base_dir: str | None = None, max_prompts: int | None = None,
                    read_text: Callable[[str], str] | None = None) -> tuple[list[Benchmark], list[str]]:
    """Load every benchmark; a bad one becomes a warning, not a failure. Raises only if none loads."""
    benchmarks, problems = [], []
    names = [s.resolved_name() for s in specs]
    duplicates = {n for n in names if names.count(n) > 1}
    if duplicates:
        raise BenchmarkError(f"benchmark names must be unique, repeated: {sorted(duplicates)}; set `name:` explicitly")
    for spec in specs:
        try:
            benchmarks.append(load_benchmark(spec, base_dir, max_prompts, read_text))
        except BenchmarkError as err:
            log.warning("skipping benchmark: %s", err)
            problems.append(str(err))
    if not benchmarks:
        raise BenchmarkError("no benchmark could be loaded: " + " | ".join(problems or ["none configured"]))
    return benchmarks, problems
