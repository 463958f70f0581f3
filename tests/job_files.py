"""Files tests write as a job's input and read back from its output, where the product itself only
writes them: a JSONL prompt file, the error rows of a jobs.generate output and the dropped candidates
of a jobs.synthesize output."""
from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq

from dspark.data import schema
from dspark.data.files import LOCAL, Files
from dspark.data.magpie import DROPPED_SCHEMA
from dspark.io import storage
from dspark.io.storage.rollout_store import path_in, read_commits


def write_jsonl(records: list, uri: str, files: Files = LOCAL) -> None:
    """Records (dicts or raw strings, e.g. a malformed line) -> a JSONL file (or an object, with
    files=dspark.io.storage)."""
    buf = io.StringIO()
    for r in records:
        buf.write((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n")
    files.write_text(uri, buf.getvalue())


def read_errors(output_uri: str) -> pa.Table:
    """The error rows of a jobs.generate output: those of loading the prompts and of every committed chunk."""
    out = output_uri.rstrip("/")
    uris = [path_in(out, "errors", "load.parquet")] + [
        path_in(out, m["files"]["errors"]) for _, m in sorted(read_commits(out).items()) if "errors" in m["files"]]
    tables = []
    for uri in uris:
        if storage.exists(uri):
            fs, path = storage.pyarrow_fs(uri)
            tables.append(pq.read_table(path, filesystem=fs, schema=schema.ERROR_SCHEMA))
    return pa.concat_tables(tables) if tables else schema.ERROR_SCHEMA.empty_table()


def read_dropped(output_uri: str) -> pa.Table:
    """The candidates a jobs.synthesize output dropped, with their reasons (dropped/filtered.parquet)."""
    fs, path = storage.pyarrow_fs(path_in(output_uri.rstrip("/"), "dropped", "filtered.parquet"))
    return pq.read_table(path, filesystem=fs, schema=DROPPED_SCHEMA)
