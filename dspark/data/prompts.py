"""Prompt sources → normalised prompts with stable ids, a deterministic split and a domain tag.

A source is a local path or `s3://` URI holding one of:
- a JSONL file (`.jsonl`/`.json`/`.ndjson`, one record per line), a Parquet file, a directory / prefix
  of such files, or a `datasets` directory written with `save_to_disk`.
Each record is one of (detected per record when `record_format: auto`):
- `{"turns": ["user turn 1", "user turn 2", ...], "system": "..."?}`  (the eval format; jobs.synthesize output)
- `{"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]}`   (OpenAI style)
- `{"conversations": [{"from": "system"|"human"|"gpt", "value": ...}, ...]}`     (ShareGPT style)
- `{"prompt": "..."}`                                                 (a single user turn)
- `{"instruction": "...", "input": "..."?}`                           (Alpaca style; a non-empty `input`
                                                                      is appended after a blank line)
Assistant turns in the input are dropped: the target regenerates them. `field` renames the column that
holds the conversation / prompt (e.g. `field: dialog` with `record_format: messages`); `user_turns: first`
keeps only the first user turn. With an explicit record_format, a record without the field is a
`missing_field` error row naming the field.
A directory written by jobs.synthesize (its manifest.json says "dspark-prompts/1") is read through the
shards its manifest lists. JSONL lines are split on "\n" only (U+2028/U+2029 may sit inside strings).

Normalisation: NFC unicode, `\\r\\n` → `\\n`, surrounding whitespace stripped. The prompt id is the
sha256 of the normalised system prompt + user turns, so identical prompts from any source collapse
to one (the first occurrence wins). The split is a pure function of the id.
Bad records never stop the job: each becomes an error row (see dspark/data/schema.py for reasons).
Sources are read through `files` (dspark/data/files.py): the jobs and pipelines pass dspark.io.storage
(local and s3://); by default only local paths are read.
"""
from __future__ import annotations

import hashlib
import json
import os
import unicodedata
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Iterator, Literal

from pydantic import Field, field_validator, model_validator

from dspark.config import StrictModel
from dspark.data.files import LOCAL, Files
from dspark.data.jsonl import jsonl_lines
from dspark.data.schema import RAW_LIMIT

RecordFormat = Literal["auto", "turns", "messages", "sharegpt", "prompt", "instruction"]
DEFAULT_FIELDS = {"turns": "turns", "messages": "messages", "sharegpt": "conversations", "prompt": "prompt",
                  "instruction": "instruction"}
PROMPTS_FORMAT = "dspark-prompts/1"  # manifest format of a jobs.synthesize output
FileFormat = Literal["auto", "jsonl", "parquet", "hf_disk"]
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant"}
HF_DISK_MARKERS = ("dataset_dict.json", "state.json", "dataset_info.json")


class PromptSource(StrictModel):
    uri: str = Field(description="local path or s3://bucket/key (a file, a directory/prefix, or a save_to_disk dir)")
    name: str | None = Field(None, description="shown in the `source` column; default: the file/dir name")
    domain: str = Field("", description="optional tag, e.g. math / code / chat")
    file_format: FileFormat = Field("auto", description="auto: by extension; a directory with dataset_dict.json/state.json is hf_disk")
    record_format: RecordFormat = "auto"
    hf_split: str = Field("train", description="which split of a save_to_disk DatasetDict to read")
    limit: int | None = Field(None, description="read at most this many records")
    field: str | None = Field(None, description="the column holding the conversation / prompt; default: turns, "
                              "messages, conversations, prompt or instruction after record_format")
    user_turns: Literal["all", "first"] = Field("all", description="keep every user turn or only the first")

    @model_validator(mode="after")
    def _field_needs_format(self) -> "PromptSource":
        if self.field is not None and self.record_format == "auto":
            raise ValueError("`field` needs an explicit record_format (turns, messages, sharegpt, prompt, instruction)")
        return self

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


def _auto_format(record: dict) -> str:
    fmt = next((fmt for fmt, key in DEFAULT_FIELDS.items() if record.get(key) is not None), "")
    if not fmt:
        raise BadRecord("bad_record", "record has none of the fields turns / messages / conversations / prompt / "
                                      "instruction")
    return fmt


def _user_turns_of(record: dict, fmt: str, key: str) -> tuple[str, list[str]]:
    value = record.get(key)
    if fmt == "turns":
        if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
            raise BadRecord("bad_record", f"'{key}' must be a list of strings")
        system = record.get("system") or ""
        if not isinstance(system, str):
            raise BadRecord("bad_record", "'system' must be a string")
        return system, list(value)
    if fmt in ("messages", "sharegpt"):
        role_key, text_key, role_map = ("role", "content", None) if fmt == "messages" else ("from", "value",
                                                                                            SHAREGPT_ROLES)
        if not isinstance(value, list):
            raise BadRecord("bad_record", f"'{key}' must be a list")
        return _from_roles(value, role_key, text_key, role_map)
    if not isinstance(value, str):
        raise BadRecord("bad_record", f"'{key}' must be a string")
    extra = record.get("input") if fmt == "instruction" else None
    return "", [f"{value}\n\n{extra}" if isinstance(extra, str) and extra.strip() else value]


def parse_record(record, record_format: RecordFormat = "auto", field: str | None = None,
                 user_turns: str = "all") -> tuple[str, list[str]]:
    """One input record -> (system prompt, user turns), normalised. Raises BadRecord."""
    if not isinstance(record, dict):
        raise BadRecord("bad_record", f"record is a {type(record).__name__}, expected a JSON object")
    fmt = _auto_format(record) if record_format == "auto" else record_format
    key = field or DEFAULT_FIELDS[fmt]
    if record_format != "auto" and record.get(key) is None:
        raise BadRecord("missing_field", f"field {key!r} is missing or null (record_format {fmt})")
    system, turns = _user_turns_of(record, fmt, key)
    if not turns:
        raise BadRecord("no_user_turn", f"field {key!r} has no user turn")
    turns = [normalise_text(t) for t in (turns[:1] if user_turns == "first" else turns)]
    empty = [i for i, t in enumerate(turns) if not t]
    if empty:
        raise BadRecord("empty_prompt", f"field {key!r}: user turn {empty[0]} is empty")
    return normalise_text(system), turns


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


def _source_files(src: PromptSource, files: Files) -> tuple[str, list[str]]:
    """-> (file format, data files). A single file, a directory/prefix of files, or a save_to_disk dir."""
    uri = src.uri
    if src.file_format == "hf_disk":
        return "hf_disk", [uri]
    if files.is_s3(uri):  # an object lists itself; a prefix (with or without "/") lists what is below it
        is_file = files.list_files(uri) == [uri]
    else:
        if not os.path.exists(uri):
            raise FileNotFoundError(f"prompt source not found: {uri} (check `sources[].uri` in the config)")
        is_file = os.path.isfile(uri)
    if is_file:
        return _file_format(uri, src.file_format), [uri]
    listed = sorted(files.list_files(uri))
    if not listed:
        raise FileNotFoundError(f"prompt source {uri} is empty or missing (check `sources[].uri`)")
    if _is_hf_disk(listed, uri.rstrip("/")):
        return "hf_disk", [uri]
    shards = _synthesized_shards(uri, listed, files)
    if shards is not None:
        return "parquet", shards
    data = [f for f in listed if f.lower().endswith((".jsonl", ".json", ".ndjson", ".parquet"))]
    if not data:
        raise ValueError(f"prompt source {uri} holds no .jsonl/.json/.parquet files")
    formats = {_file_format(f, src.file_format) for f in data}
    if len(formats) > 1:
        raise ValueError(f"prompt source {uri} mixes JSONL and Parquet files; split it into two sources")
    return formats.pop(), data


def _synthesized_shards(root: str, listed: list[str], files: Files) -> list[str] | None:
    """The data shards of a jobs.synthesize output directory, or None if `root` is not one."""
    manifest_uri = files.join(root.rstrip("/"), "manifest.json")
    if not any(f.rstrip("/") == manifest_uri for f in listed):
        return None
    try:
        manifest = json.loads(files.read_text(manifest_uri))
    except ValueError:
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != PROMPTS_FORMAT:
        return None
    return [files.join(root.rstrip("/"), shard) for shard in manifest["shards"]]


def _jsonl_records(uri: str, files: Files) -> Iterator[tuple[str, object, str]]:
    """-> (location, parsed record or BadRecord, raw line) per non-blank line."""
    for number, raw in jsonl_lines(_read_file(uri, files)):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            yield f"{uri}:{number}", BadRecord("bad_encoding", f"not UTF-8 at byte {err.start}"), repr(raw[:200])
            continue
        try:
            yield f"{uri}:{number}", json.loads(line), line
        except json.JSONDecodeError as err:
            yield f"{uri}:{number}", BadRecord("malformed_json", f"invalid JSON: {err.msg} at column {err.colno}"), line


def _read_file(uri: str, files: Files) -> bytes:
    try:
        return files.read_bytes(uri)
    except (OSError, RuntimeError) as err:  # RuntimeError: the store's own (dspark.io.storage.StorageError)
        raise ValueError(f"cannot read prompt source file {uri}: {err}") from None


def _parquet_records(uri: str, files: Files) -> Iterator[tuple[str, object, str]]:
    import pyarrow.parquet as pq

    fs, path = files.pyarrow_fs(uri)
    try:
        parquet = pq.ParquetFile(path, filesystem=fs)
        batches = list(parquet.iter_batches(batch_size=1024))
    except (OSError, ValueError) as err:  # pyarrow raises ArrowInvalid (a ValueError) on a corrupt file
        raise ValueError(f"cannot read prompt source file {uri} as Parquet: {err}") from None
    row = 0
    for batch in batches:
        for record in batch.to_pylist():
            yield f"{uri}#{row}", record, ""
            row += 1


def _hf_disk_records(uri: str, hf_split: str, files: Files) -> Iterator[tuple[str, object, str]]:
    import datasets

    local = files.local_copy(uri) if files.is_s3(uri) else uri
    try:
        loaded = datasets.load_from_disk(local)
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot read prompt source {uri} as a `datasets` save_to_disk directory: {err}") from None
    if isinstance(loaded, datasets.DatasetDict):
        if hf_split not in loaded:
            raise ValueError(f"{uri} has splits {list(loaded)}; set `hf_split` on the source to one of them")
        loaded = loaded[hf_split]
    for row, record in enumerate(loaded):
        yield f"{uri}#{row}", record, ""


def iter_source(src: PromptSource, files: Files = LOCAL) -> Iterator[tuple[str, object, str]]:
    file_format, data_files = _source_files(src, files)
    count = 0
    for uri in data_files:
        reader = {"jsonl": _jsonl_records, "parquet": _parquet_records}.get(file_format)
        records = reader(uri, files) if reader else _hf_disk_records(uri, src.hf_split, files)
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


def load_prompts(sources: list[PromptSource], holdout_fraction: float = 0.0, files: Files = LOCAL) -> LoadResult:
    """Read every source in order (through `files`: pass dspark.io.storage for s3:// sources); normalise,
    id, split, collapse duplicates, collect bad records."""
    if not 0 <= holdout_fraction < 1:
        raise ValueError(f"holdout_fraction must be in [0, 1), got {holdout_fraction}")
    result, seen = LoadResult(), set()
    for src in sources:
        label = src.label
        for location, record, raw in iter_source(src, files):
            result.records_read += 1
            try:
                if isinstance(record, BadRecord):
                    raise record
                system, turns = parse_record(record, src.record_format, src.field, src.user_turns)
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
