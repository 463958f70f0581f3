"""Prompt sources → normalised prompts with stable ids, a deterministic split and a domain tag.

A source is a local path or `s3://` URI holding one of:
- a JSONL file (`.jsonl`/`.json`/`.ndjson`, one record per line), a Parquet file, a directory / prefix
  of such files, or a `datasets` directory written with `save_to_disk`.
Each record is one of (detected per record when `record_format: auto`):
- `{"turns": ["user turn 1", "user turn 2", ...]}`                   (the eval format)
- `{"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]}`   (OpenAI style)
- `{"conversations": [{"from": "system"|"human"|"gpt", "value": ...}, ...]}`     (ShareGPT style)
- `{"prompt": "..."}`                                                 (a single user turn)
Assistant turns in the input are dropped: the target regenerates them.

Normalisation: NFC unicode, `\\r\\n` → `\\n`, surrounding whitespace stripped. The prompt id is the
sha256 of the normalised system prompt + user turns, so identical prompts from any source collapse
to one (the first occurrence wins). The split is a pure function of the id.
Bad records never stop the job: each becomes an error row (see pipelines/schema.py for reasons).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import unicodedata
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Iterator, Literal

from pydantic import field_validator

from dspark import storage
from dspark.config import StrictModel
from dspark.jsonl import jsonl_lines
from pipelines.schema import RAW_LIMIT

RecordFormat = Literal["auto", "turns", "messages", "sharegpt", "prompt"]
FileFormat = Literal["auto", "jsonl", "parquet", "hf_disk"]
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant"}
HF_DISK_MARKERS = ("dataset_dict.json", "state.json", "dataset_info.json")


class PromptSource(StrictModel):
    uri: str  # local path or s3://bucket/key (a file, a directory/prefix, or a save_to_disk dir)
    name: str | None = None  # shown in the `source` column; default: the file/dir name
    domain: str = ""  # optional tag, e.g. math / code / chat
    file_format: FileFormat = "auto"  # auto: by extension; a directory with dataset_dict.json/state.json is hf_disk
    record_format: RecordFormat = "auto"
    hf_split: str = "train"  # which split of a save_to_disk DatasetDict to read
    limit: int | None = None  # read at most this many records

    @field_validator("limit")
    @classmethod
    def _limit(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError("limit must be >= 1 (or null for no limit)")
        return v

    @property
    def label(self) -> str:
        return self.name or PurePosixPath(self.uri.rstrip("/")).name


@dataclass
class Prompt:
    prompt_id: str
    source: str
    domain: str
    split: str
    system: str  # "" when the record has no system prompt
    turns: list[str]  # user turns, in order
    location: str = ""  # where it was first read (uri:line or uri#row)

    def as_row(self) -> dict:
        return {"prompt_id": self.prompt_id, "source": self.source, "domain": self.domain, "split": self.split,
                "system": self.system, "turns": list(self.turns), "location": self.location}


@dataclass
class LoadResult:
    prompts: list[Prompt] = field(default_factory=list)  # unique, in first-seen order
    errors: list[dict] = field(default_factory=list)  # ERROR_SCHEMA rows
    records_read: int = 0
    duplicates: int = 0


class BadRecord(ValueError):
    """A record that cannot become a prompt; `reason` is one of schema.ERROR_REASONS."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


# ---------------------------------------------------------------- normalisation and ids
def normalise_text(text: str) -> str:
    return unicodedata.normalize("NFC", text).replace("\r\n", "\n").strip()


def prompt_id_of(system: str, turns: list[str]) -> str:
    canonical = json.dumps({"system": system, "turns": turns}, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:32]


def split_of(prompt_id: str, holdout_fraction: float) -> str:
    """Deterministic: the first 52 bits of the id as a uniform number in [0, 1)."""
    return "holdout" if int(prompt_id[:13], 16) / 16**13 < holdout_fraction else "train"


# ---------------------------------------------------------------- record parsing
def _text_of(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if len(parts) == len(content) and all(isinstance(p, str) for p in parts):
            return "\n".join(parts)
    raise BadRecord("bad_record", f"{where}: content must be a string or a list of text parts")


def _from_roles(items: list, role_key: str, text_key: str, role_map: dict | None) -> tuple[str, list[str]]:
    system, turns = "", []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise BadRecord("bad_record", f"turn {i} is not an object")
        role = item.get(role_key)
        role = role_map.get(role) if role_map else role
        if role not in ("system", "user", "assistant"):
            raise BadRecord("bad_record", f"turn {i} has unsupported role {item.get(role_key)!r}")
        text = _text_of(item.get(text_key), f"turn {i}")
        if role == "system":
            if i != 0:
                raise BadRecord("bad_record", f"turn {i}: a system message is only allowed first")
            system = text
        elif role == "user":
            turns.append(text)
    return system, turns


def parse_record(record, record_format: RecordFormat = "auto") -> tuple[str, list[str]]:
    """One input record -> (system prompt, user turns), normalised. Raises BadRecord."""
    if not isinstance(record, dict):
        raise BadRecord("bad_record", f"record is a {type(record).__name__}, expected a JSON object")
    fmt = record_format
    if fmt == "auto":
        fmt = next((k for k, key in (("turns", "turns"), ("messages", "messages"), ("sharegpt", "conversations"),
                                     ("prompt", "prompt")) if record.get(key) is not None), "")
        if not fmt:
            raise BadRecord("bad_record", "record has none of the fields turns / messages / conversations / prompt")
    if fmt == "turns":
        turns = record.get("turns")
        if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
            raise BadRecord("bad_record", "'turns' must be a list of strings")
        system, user_turns = "", list(turns)
    elif fmt in ("messages", "sharegpt"):
        key, role_key, text_key, role_map = (("messages", "role", "content", None) if fmt == "messages"
                                             else ("conversations", "from", "value", SHAREGPT_ROLES))
        items = record.get(key)
        if not isinstance(items, list):
            raise BadRecord("bad_record", f"'{key}' must be a list")
        system, user_turns = _from_roles(items, role_key, text_key, role_map)
    else:
        prompt = record.get("prompt")
        if not isinstance(prompt, str):
            raise BadRecord("bad_record", "'prompt' must be a string")
        system, user_turns = "", [prompt]
    if not user_turns:
        raise BadRecord("no_user_turn", "record has no user turn")
    user_turns = [normalise_text(t) for t in user_turns]
    empty = [i for i, t in enumerate(user_turns) if not t]
    if empty:
        raise BadRecord("empty_prompt", f"user turn {empty[0]} is empty")
    return normalise_text(system), user_turns


# ---------------------------------------------------------------- reading sources
def _file_format(uri: str, declared: FileFormat) -> str:
    if declared != "auto":
        return declared
    name = uri.lower()
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith((".jsonl", ".json", ".ndjson")):
        return "jsonl"
    raise ValueError(f"cannot tell the format of {uri}: name it .jsonl/.json/.parquet or set file_format "
                     f"(jsonl, parquet, hf_disk) on the source")


def _is_hf_disk(files: list[str], root: str) -> bool:
    top = {f[len(root):].lstrip("/") for f in files}
    return any(marker in top for marker in HF_DISK_MARKERS)


def _source_files(src: PromptSource) -> tuple[str, list[str]]:
    """-> (file format, files). A single file, a directory/prefix of files, or a save_to_disk dir."""
    uri = src.uri
    if src.file_format == "hf_disk":
        return "hf_disk", [uri]
    if storage.is_s3(uri):
        is_file = not uri.endswith("/") and storage.exists(uri)
    else:
        if not os.path.exists(uri):
            raise FileNotFoundError(f"prompt source not found: {uri} (check `sources[].uri` in the config)")
        is_file = os.path.isfile(uri)
    if is_file:
        return _file_format(uri, src.file_format), [uri]
    files = sorted(storage.list_files(uri))
    if not files:
        raise FileNotFoundError(f"prompt source {uri} is empty or missing (check `sources[].uri`)")
    if _is_hf_disk(files, uri.rstrip("/")):
        return "hf_disk", [uri]
    data = [f for f in files if f.lower().endswith((".jsonl", ".json", ".ndjson", ".parquet"))]
    if not data:
        raise ValueError(f"prompt source {uri} holds no .jsonl/.json/.parquet files")
    formats = {_file_format(f, src.file_format) for f in data}
    if len(formats) > 1:
        raise ValueError(f"prompt source {uri} mixes JSONL and Parquet files; split it into two sources")
    return formats.pop(), data


def _jsonl_records(uri: str) -> Iterator[tuple[str, object, str]]:
    """-> (location, parsed record or BadRecord, raw line) per non-blank line."""
    text = storage.read_bytes(uri).decode("utf-8", errors="replace")
    for number, line in jsonl_lines(text):
        try:
            yield f"{uri}:{number}", json.loads(line), line
        except json.JSONDecodeError as err:
            yield f"{uri}:{number}", BadRecord("malformed_json", f"invalid JSON: {err.msg} at column {err.colno}"), line


def _parquet_records(uri: str) -> Iterator[tuple[str, object, str]]:
    import pyarrow.parquet as pq

    fs, path = storage.pyarrow_fs(uri)
    parquet = pq.ParquetFile(path, filesystem=fs)
    row = 0
    for batch in parquet.iter_batches(batch_size=1024):
        for record in batch.to_pylist():
            yield f"{uri}#{row}", record, ""
            row += 1


def _hf_disk_records(uri: str, hf_split: str) -> Iterator[tuple[str, object, str]]:
    import datasets

    local = storage.local_copy(uri) if storage.is_s3(uri) else uri
    loaded = datasets.load_from_disk(local)
    if isinstance(loaded, datasets.DatasetDict):
        if hf_split not in loaded:
            raise ValueError(f"{uri} has splits {list(loaded)}; set `hf_split` on the source to one of them")
        loaded = loaded[hf_split]
    for row, record in enumerate(loaded):
        yield f"{uri}#{row}", record, ""


def iter_source(src: PromptSource) -> Iterator[tuple[str, object, str]]:
    file_format, files = _source_files(src)
    count = 0
    for uri in files:
        reader = {"jsonl": _jsonl_records, "parquet": _parquet_records}.get(file_format)
        records = reader(uri) if reader else _hf_disk_records(uri, src.hf_split)
        for item in records:
            if src.limit is not None and count >= src.limit:
                return
            count += 1
            yield item


def _raw_text(record, raw: str) -> str:
    if not raw:
        try:
            raw = json.dumps(record, ensure_ascii=False, default=str)
        except (TypeError, ValueError):
            raw = repr(record)
    return raw[:RAW_LIMIT]


def error_row(source: str, location: str, reason: str, detail: str, raw: str = "", prompt_id: str | None = None) -> dict:
    return {"prompt_id": prompt_id, "source": source, "location": location, "reason": reason,
            "detail": detail, "raw": raw[:RAW_LIMIT]}


def load_prompts(sources: list[PromptSource], holdout_fraction: float = 0.0) -> LoadResult:
    """Read every source in order; normalise, id, split, collapse duplicates, collect bad records."""
    if not 0 <= holdout_fraction < 1:
        raise ValueError(f"holdout_fraction must be in [0, 1), got {holdout_fraction}")
    result, seen = LoadResult(), set()
    for src in sources:
        label = src.label
        for location, record, raw in iter_source(src):
            result.records_read += 1
            try:
                if isinstance(record, BadRecord):
                    raise record
                system, turns = parse_record(record, src.record_format)
            except BadRecord as bad:
                result.errors.append(error_row(label, location, bad.reason, bad.detail, _raw_text(record, raw)))
                continue
            pid = prompt_id_of(system, turns)
            if pid in seen:
                result.duplicates += 1
                continue
            seen.add(pid)
            domain = src.domain or (record.get("domain") if isinstance(record.get("domain"), str) else "")
            result.prompts.append(Prompt(pid, label, domain, split_of(pid, holdout_fraction), system, turns, location))
    return result


def write_jsonl(records: list, uri: str) -> None:
    """Small helper for tests and examples: records (dicts or raw strings) -> a JSONL file/object."""
    buf = io.StringIO()
    for r in records:
        buf.write((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n")
    storage.write_text(uri, buf.getvalue())
