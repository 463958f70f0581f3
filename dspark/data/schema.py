"""The on-disk layout and Parquet schemas of a rollout dataset (the contract with the training job).

Layout under the job's `output` (a local directory or an `s3://bucket/prefix`):

    config.yaml                  the resolved job config (written by jobs/generate.py)
    _plan.json                   the chunk plan: fingerprint of the inputs + settings, chunk count
    data/part-00000.parquet      one shard per chunk, rows sorted by prompt_id   (ROLLOUT_SCHEMA)
    errors/load.parquet          records rejected while reading the sources       (ERROR_SCHEMA)
    errors/part-00000.parquet    records rejected during generation, per chunk    (ERROR_SCHEMA)
    _commits/part-00000.json     commit marker of chunk 0 (its counts and files); a shard without a
                                 marker is an uncommitted leftover and is ignored (then overwritten)
    manifest.json                written last: counts, token totals, errors by reason, config, shards

Readers should take the shard list from `manifest.json` (or the commit markers), not from a listing.
dspark/io/storage/rollout_store.py writes and reads this layout on storage; this module stays storage-free.

Rollout rows (one per unique prompt):
- prompt_id: 32 hex chars, sha256 of the normalised prompt (system + user turns); duplicates collapse.
- source / domain / split: the source name, its domain tag ("" if none), "train" or "holdout".
- messages: the conversation with the regenerated assistant turns, [{role, content}, ...]
  (an optional leading system message, then user/assistant alternating, ending with assistant).
- input_ids: the exact token sequence the target saw and produced: the chat-templated first prompt,
  then for every turn the target's own generated ids followed by the template tokens of the next
  user turn. Invariant: every position i with loss_mask[i] == 1 holds a token the target sampled
  conditioned on exactly input_ids[:i].
- loss_mask: 1 on the generated tokens (including each turn's stop token), 0 elsewhere.
- num_prompt_tokens: positions with loss_mask 0; num_generated_tokens: positions with loss_mask 1.
- num_turns: assistant turns generated. finish_reason: "length" if any turn hit its token budget,
  else "stop"; turn_finish_reasons: one per turn.
- target / target_revision: the target spec and its revision; sampling: JSON of the sampling
  parameters (temperature, top_p, top_k, max_new_tokens, seed); chunk: the chunk it belongs to.
"""
from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

MESSAGE_TYPE = pa.struct([("role", pa.string()), ("content", pa.string())])

ROLLOUT_SCHEMA = pa.schema([
    ("prompt_id", pa.string()),
    ("source", pa.string()),
    ("domain", pa.string()),
    ("split", pa.string()),
    ("messages", pa.list_(MESSAGE_TYPE)),
    ("input_ids", pa.list_(pa.int32())),
    ("loss_mask", pa.list_(pa.int8())),
    ("num_prompt_tokens", pa.int32()),
    ("num_generated_tokens", pa.int32()),
    ("num_turns", pa.int32()),
    ("finish_reason", pa.string()),
    ("turn_finish_reasons", pa.list_(pa.string())),
    ("target", pa.string()),
    ("target_revision", pa.string()),
    ("sampling", pa.string()),
    ("chunk", pa.int32()),
])

ERROR_SCHEMA = pa.schema([
    ("prompt_id", pa.string()),  # null when the record could not be parsed
    ("source", pa.string()),
    ("location", pa.string()),  # uri:line for JSONL, uri#row for tables
    ("reason", pa.string()),  # one of ERROR_REASONS
    ("detail", pa.string()),
    ("raw", pa.string()),  # the record as read, truncated to RAW_LIMIT characters
])

# Stable reason codes, counted in the manifest and in MLflow as errors.<reason>.
ERROR_REASONS = ("malformed_json", "bad_encoding", "bad_record", "missing_field", "no_user_turn", "empty_prompt",
                 "prompt_too_long", "template_error")
RAW_LIMIT = 2000

# What the generation actor returns: a rollout row plus the error columns (null when the row is ok).
RESULT_SCHEMA = pa.schema(list(ROLLOUT_SCHEMA) + [("error_reason", pa.string()), ("error_detail", pa.string()),
                                                  ("location", pa.string()), ("raw", pa.string())])


def shard_name(chunk: int) -> str:
    return f"part-{chunk:05d}"


# ---------------------------------------------------------------- the chunk plan and its commit markers
@dataclass
class Plan:
    """The work of a chunked output (rollouts, synthesis): its items cut into chunks (prompts, or
    synthesis slots) and the fingerprint of the inputs + settings stored as `_plan.json`."""
    chunks: list[list]
    fingerprint: str

    def describe(self) -> dict:
        return {"fingerprint": self.fingerprint, "num_chunks": len(self.chunks),
                "num_prompts": sum(len(c) for c in self.chunks)}


def add_counts(total: dict, part: dict) -> None:
    """Add a commit marker's counters (e.g. errors_by_reason) into running totals."""
    for key, value in part.items():
        total[key] = total.get(key, 0) + value
