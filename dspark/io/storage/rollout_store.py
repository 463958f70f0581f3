"""The rollout store: a rollout (or synthesis) output directory on storage, local or s3:// — its
plan, shards, commit markers and readers. The layout is documented in dspark/data/schema.py:

    <out>/_plan.json                 the plan's fingerprint (a rerun with another plan is refused)
    <out>/data/part-<k>.parquet      one shard per chunk (dspark/data/schema.py ROLLOUT_SCHEMA)
    <out>/_commits/part-<k>.json     the commit marker: a chunk counts only once its marker exists
    <out>/errors/...                 rows that failed, with their cause
    <out>/manifest.json              counts and settings, written last

A kill at any point loses at most the chunks in flight; their leftovers carry the same names and are
overwritten on the rerun, so the dataset holds every prompt_id exactly once. The plan and the marker
counters are pure data (dspark.data.schema.Plan, add_counts); this module does their storage I/O.
"""
from __future__ import annotations

import io
import json
import time
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq

from dspark.config import ConfigError
from dspark.data import schema
from dspark.data.prompts import error_row
from dspark.data.schema import Plan
from dspark.io import storage


# ---------------------------------------------------------------- plan, commits, manifest
def path_in(out: str, *parts: str) -> str:
    return storage.join(out, *parts)


def write_parquet(uri: str, rows: list[dict], table_schema: pa.Schema) -> None:
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=table_schema), buf)
    storage.write_bytes(uri, buf.getvalue())


def prepare_output(out: str, plan: Plan, overwrite: bool) -> None:
    """Store the plan, or check that the output already holds this same plan."""
    plan_uri = path_in(out, "_plan.json")
    if storage.exists(plan_uri):
        stored = json.loads(storage.read_text(plan_uri))
        if stored.get("fingerprint") == plan.fingerprint:
            return
        if not overwrite:
            raise ValueError(f"{out} already holds rollouts of a different plan (the prompts or the generation "
                             f"settings changed). Use a new `output`, or set overwrite=true to delete and regenerate.")
        for uri in storage.list_files(out):
            storage.delete(uri)
    storage.write_text(plan_uri, json.dumps(plan.describe(), indent=2))


def read_commits(out: str) -> dict[int, dict]:
    """Committed chunks -> their markers. Unreadable (half-written) markers do not count."""
    commits = {}
    try:
        files = storage.list_files(path_in(out, "_commits"))
    except FileNotFoundError:
        return commits
    for uri in files:
        if not uri.endswith(".json"):
            continue
        try:
            marker = json.loads(storage.read_text(uri))
            commits[int(marker["chunk"])] = marker
        except (ValueError, KeyError, TypeError):
            continue
    return commits


def commit_chunk(out: str, chunk: int, results: list[dict]) -> dict:
    """Write the chunk's shard(s), then its marker (the commit point). Returns the marker."""
    name = schema.shard_name(chunk)
    good = sorted((r for r in results if r["error_reason"] is None), key=lambda r: r["prompt_id"])
    bad = [error_row(r["source"], r["location"], r["error_reason"], r["error_detail"], r["raw"],
                     prompt_id=r["prompt_id"])
           for r in results if r["error_reason"] is not None]
    files = {"data": f"data/{name}.parquet"}
    write_parquet(path_in(out, files["data"]), good, schema.ROLLOUT_SCHEMA)
    if bad:
        files["errors"] = f"errors/{name}.parquet"
        write_parquet(path_in(out, files["errors"]), bad, schema.ERROR_SCHEMA)
    marker = {
        "chunk": chunk, "rows": len(good), "errors": len(bad),
        "errors_by_reason": dict(Counter(r["reason"] for r in bad)),
        "rows_by_split": dict(Counter(r["split"] for r in good)),
        "finish_reasons": dict(Counter(r["finish_reason"] for r in good)),
        "prompt_tokens": sum(r["num_prompt_tokens"] for r in good),
        "generated_tokens": sum(r["num_generated_tokens"] for r in good),
        "files": files, "committed_at": time.time(),
    }
    storage.write_text(path_in(out, "_commits", f"{name}.json"), json.dumps(marker))
    return marker


def read_rollouts(output_uri: str) -> pa.Table:
    """All committed rollout rows of a finished (or partial) output, via its commit markers."""
    out = output_uri.rstrip("/")
    tables = []
    for chunk, marker in sorted(read_commits(out).items()):
        fs, path = storage.pyarrow_fs(path_in(out, marker["files"]["data"]))
        tables.append(pq.read_table(path, filesystem=fs, schema=schema.ROLLOUT_SCHEMA))
    return pa.concat_tables(tables) if tables else schema.ROLLOUT_SCHEMA.empty_table()


ROLLOUT_COLUMNS = ("split", "input_ids", "loss_mask")  # what training reads from the rollouts Parquet


# ----------------------------------------------------------------------------- fail-fast checks
def rollout_files(uri: str) -> list[str]:
    """The Parquet shards of a rollouts dataset: one file; the committed shards of a jobs.generate
    output (its commit markers, not a listing); or, for a hand-made directory, its *.parquet files."""
    if uri.endswith(".parquet"):
        if not storage.exists(uri):
            raise ConfigError(f"rollouts file {uri!r} does not exist; point data.rollouts at jobs.generate's output")
        return [uri]
    commits = read_commits(uri.rstrip("/"))
    if commits:
        return [storage.join(uri, marker["files"]["data"]) for _, marker in sorted(commits.items())]
    try:
        files = sorted(f for f in storage.list_files(uri) if f.endswith(".parquet") and "/errors/" not in f)
    except FileNotFoundError:
        files = []
    if not files:
        raise ConfigError(f"no rollouts found at {uri!r} (no committed shards, no .parquet files); run "
                          f"jobs.generate first or fix data.rollouts")
    return files


def check_shards(uri: str, files: list[str]) -> None:
    """Every shard is there and whole, read from its footer only (and, for a jobs.generate output, holds the
    rows its commit marker counted): ConfigError naming the first bad shard and what to do, before any work."""
    from concurrent.futures import ThreadPoolExecutor

    expected = {storage.join(uri, m["files"]["data"]): m.get("rows") for m in read_commits(uri.rstrip("/")).values()}

    def problem(f: str) -> str | None:
        fs, path = storage.pyarrow_fs(f)
        try:
            rows = pq.read_metadata(path, filesystem=fs).num_rows
        except FileNotFoundError:
            return "is missing although its commit marker names it" if f in expected else "is missing"
        except (OSError, pa.ArrowInvalid) as err:
            return f"is corrupt or truncated ({str(err).split(';')[0]})"
        if expected.get(f) is not None and rows != expected[f]:
            return f"holds {rows} rows but its commit marker counted {expected[f]}"
        return None

    with ThreadPoolExecutor(max_workers=16) as pool:
        for f, why in zip(files, pool.map(problem, files)):
            if why and f in expected:
                raise ConfigError(f"rollouts shard {f!r} {why}; remove the shard and its _commits marker and rerun "
                                  f"jobs.generate on the same output (it regenerates only that chunk)")
            if why:
                raise ConfigError(f"rollouts file {f!r} {why}; remove or rewrite it, or point data.rollouts elsewhere")


def parquet_paths(files: list[str]):
    """(pyarrow filesystem, paths inside it) for a list of same-store URIs."""
    pairs = [storage.pyarrow_fs(f) for f in files]
    return pairs[0][0], [path for _, path in pairs]


def check_rollouts(uri: str, split: str) -> tuple[list[str], int]:
    """(shard URIs, number of `split` rows); ConfigError for a missing, empty or schema-mismatched dataset."""
    import pyarrow.dataset as pads

    files = rollout_files(uri)
    check_shards(uri, files)
    fs, paths = parquet_paths(files)
    try:
        dataset = pads.dataset(paths, filesystem=fs, format="parquet")
    except (FileNotFoundError, OSError, pa.ArrowInvalid) as err:
        raise ConfigError(f"cannot read rollouts {uri!r}: {err}; point data.rollouts at the Parquet output of "
                          f"jobs.generate") from None
    missing = [c for c in ROLLOUT_COLUMNS if c not in dataset.schema.names]
    if missing:
        raise ConfigError(f"rollouts {uri!r} lack column(s) {missing} (have {dataset.schema.names}); they must "
                          f"follow dspark/data/schema.py — regenerate them with jobs.generate")
    for name in ("input_ids", "loss_mask"):
        kind = dataset.schema.field(name).type
        if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not (
                pa.types.is_integer(kind.value_type) or pa.types.is_boolean(kind.value_type)):
            raise ConfigError(f"rollouts column {name!r} of {uri!r} has type {kind}, expected a list of integers")
    rows = dataset.count_rows(filter=pads.field("split") == split)
    if rows == 0:
        raise ConfigError(f"rollouts {uri!r} have no rows with split == {split!r}; check data.split or "
                          f"regenerate the rollouts")
    return files, rows
