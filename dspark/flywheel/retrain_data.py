"""The retraining set: captured traffic (train split) mixed with the drafter's original rollouts, and
the captured hold-out prompts as per-domain benchmark files for jobs.evaluate.

Mixing rule: every captured training row is used; original rows are added so that captured rows make
up `capture_fraction` of the result (n_orig = n_cap (1 - f) / f, capped by what exists, drawn with a
seeded RNG). Written as a one-shard rollout store (data/part-00000.parquet + commit marker +
manifest.json), which jobs.train reads through its commit marker like jobs.generate's output.
"""
from __future__ import annotations

import json
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dspark.flywheel.capture import read_captures
from dspark.io import storage
from dspark.data import schema
from dspark.io.storage.rollout_store import path_in, rollout_files, write_parquet


def read_original(uri: str) -> pa.Table:
    """The original rollouts' train rows (only the columns the rollout schema shares with them)."""
    tables = []
    for f in rollout_files(uri):
        fs, path = storage.pyarrow_fs(f)
        table = pq.read_table(path, filesystem=fs)
        tables.append(table.select([c for c in schema.ROLLOUT_SCHEMA.names if c in table.column_names]))
    table = pa.concat_tables(tables, promote_options="default") if tables else schema.ROLLOUT_SCHEMA.empty_table()
    return table.filter(pa.compute.equal(table["split"], "train"))


def mix(captured: pa.Table, original: pa.Table, capture_fraction: float, seed: int) -> tuple[pa.Table, dict]:
    """(mixed rows in rollout-schema columns, counts)."""
    if not 0 < capture_fraction <= 1:
        raise ValueError(f"capture_fraction must be in (0, 1], got {capture_fraction}")
    cap = _to_rollout(captured.filter(pa.compute.equal(captured["split"], "train")))
    want = round(cap.num_rows * (1 - capture_fraction) / capture_fraction)
    take = min(want, original.num_rows)
    picks = np.sort(np.random.default_rng(seed).choice(original.num_rows, size=take, replace=False)) if take else []
    orig = _to_rollout(original.take(pa.array(picks, pa.int64())) if take else original.slice(0, 0))
    mixed = pa.concat_tables([cap, orig])
    counts = {"captured_rows": cap.num_rows, "original_rows": orig.num_rows, "original_wanted": want,
              "capture_fraction": cap.num_rows / mixed.num_rows if mixed.num_rows else None,
              "captured_by_domain": _counts(cap, "domain")}
    return mixed, counts


def write_training_set(out: str, table: pa.Table, info: dict) -> str:
    """One committed shard + manifest under `out`; returns `out`."""
    name = schema.shard_name(0)
    files = {"data": f"data/{name}.parquet"}
    write_parquet(path_in(out, files["data"]), table.to_pylist(), schema.ROLLOUT_SCHEMA)
    marker = {"chunk": 0, "rows": table.num_rows, "errors": 0, "files": files,
              "rows_by_split": _counts(table, "split"), "committed_at": time.time()}
    storage.write_text(path_in(out, "_commits", f"{name}.json"), json.dumps(marker))
    storage.write_text(path_in(out, "manifest.json"), json.dumps({**info, "rows": table.num_rows, "shards": [files]},
                                                                 indent=2))
    return out


def write_heldout_benchmarks(out: str, captured: pa.Table, max_per_domain: int | None) -> dict[str, str]:
    """Captured hold-out rows' user turns as jobs.evaluate benchmark files: {domain: <out>/<domain>.jsonl}."""
    held = captured.filter(pa.compute.equal(captured["split"], "holdout")).to_pylist()
    by_domain: dict[str, list[dict]] = {}
    for row in sorted(held, key=lambda r: r["prompt_id"]):
        turns = [m["content"] for m in row["messages"] if m["role"] == "user"]
        if turns and (max_per_domain is None or len(by_domain.get(row["domain"], [])) < max_per_domain):
            by_domain.setdefault(row["domain"], []).append({"turns": turns, "capture_id": row["prompt_id"]})
    paths = {}
    for domain, lines in by_domain.items():
        paths[domain] = storage.join(out, f"{domain}.jsonl")
        storage.write_text(paths[domain], "".join(json.dumps(line) + "\n" for line in lines))
    return paths


def load_captures(output: str) -> pa.Table:
    return read_captures(output)


def _to_rollout(table: pa.Table) -> pa.Table:
    return table.select(schema.ROLLOUT_SCHEMA.names).cast(schema.ROLLOUT_SCHEMA)


def _counts(table: pa.Table, column: str) -> dict:
    values = table[column].to_pylist()
    return {v: values.count(v) for v in sorted(set(values))}
