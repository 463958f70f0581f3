"""The object store going away (slow tier, a real SeaweedFS on 127.0.0.1): a rollout shard written while it is
down is retried with backoff and lands whole once it returns; a store down for longer than DSPARK_S3_RETRY_S
fails the chunk cleanly, leaving no commit marker, so the resumed run regenerates that chunk and nothing else."""
from __future__ import annotations

import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest

from dspark.data import schema
from dspark.io import storage
from dspark.io.storage import rollout_store
from tests.cluster.cluster_fixture import free_port, free_s3_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
def s3_only(monkeypatch):
    """SeaweedFS alone, on free ports, in a temporary state dir; (stop, start) callables for the test."""
    from dspark.devstack import stack

    state = Path(tempfile.mkdtemp(prefix="dspark-store-down-"))
    monkeypatch.setenv("DSPARK_STATE_DIR", str(state))
    monkeypatch.setenv("DSPARK_S3_PORT", str(free_s3_port()))
    monkeypatch.setenv("DSPARK_MLFLOW_PORT", str(free_port()))
    cfg = stack.StackConfig.from_env()
    quiet = dict(say=lambda msg: None, services=("s3",))
    for key, value in stack.up(cfg, **quiet).items():
        if key.startswith(("AWS_", "DSPARK_S3")):
            monkeypatch.setenv(key, value)

    def stop():
        stack.stop_record(cfg, stack.read_record(cfg, "s3"))

    try:
        yield stop, lambda: stack.up(cfg, **quiet)
    finally:
        stack.down(cfg, say=lambda msg: None)
        shutil.rmtree(state, ignore_errors=True)


def commit(out: str, chunk: int) -> None:
    row = {**{k: None for k in schema.RESULT_SCHEMA.names}, "prompt_id": f"{chunk}".ljust(32, "x"), "source": "p",
           "domain": "", "split": "train", "messages": [], "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1],
           "num_prompt_tokens": 1, "num_generated_tokens": 2, "num_turns": 1, "finish_reason": "stop",
           "turn_finish_reasons": ["stop"], "target": "tiny", "target_revision": "", "sampling": "{}",
           "chunk": chunk, "location": "p:1"}
    rollout_store.commit_chunk(out, chunk, [row])


def test_store_down_a_shard_write_waits_for_the_store_and_lands_whole(s3_only, monkeypatch):
    stop, start = s3_only
    out = "s3://dspark/rollouts/store-down"
    commit(out, 0)
    stop()
    monkeypatch.setenv("DSPARK_S3_RETRY_S", "120")
    errors: list[BaseException] = []
    writer = threading.Thread(target=lambda: _run(lambda: commit(out, 1), errors))
    t0 = time.monotonic()
    writer.start()
    time.sleep(4)
    assert writer.is_alive(), "the write waits for the store instead of failing"
    start()
    writer.join(timeout=120)
    assert not writer.is_alive() and not errors, errors
    assert time.monotonic() - t0 >= 4
    assert sorted(rollout_store.read_commits(out)) == [0, 1]
    assert rollout_store.read_rollouts(out).num_rows == 2


def test_store_down_past_the_budget_fails_the_chunk_without_a_commit(s3_only, monkeypatch):
    stop, start = s3_only
    out = "s3://dspark/rollouts/store-down-long"
    commit(out, 0)
    stop()
    monkeypatch.setenv("DSPARK_S3_RETRY_S", "3")
    with pytest.raises(storage.StorageUnavailable, match="unreachable"):
        commit(out, 1)
    start()
    assert sorted(rollout_store.read_commits(out)) == [0]  # a resume regenerates chunk 1 only
    commit(out, 1)
    assert sorted(rollout_store.read_commits(out)) == [0, 1]


def _run(fn, errors: list) -> None:
    try:
        fn()
    except BaseException as err:  # noqa: BLE001 - reported by the test
        errors.append(err)
