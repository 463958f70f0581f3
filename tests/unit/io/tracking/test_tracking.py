"""MLflow lineage and run hygiene (dspark.io.tracking), against SQLite stores in temp dirs (no server).

- dataset inputs (name, source URI, digest, context) and the source commit on every run;
- per-position series and system metrics;
- a run never stays RUNNING: SIGTERM -> KILLED, an uncaught exception -> FAILED (real subprocesses);
- logging never blocks the caller when the tracking server hangs or is down.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from dspark.io import storage, tracking
from tests.paths import REPO
from tests.mlflow_store import new_sqlite_store

ROOT = REPO


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """One SQLite store for the module (runs are cheap; a store's tables are not: tests/mlflow_store.py)."""
    return new_sqlite_store(tmp_path_factory.mktemp("mlflow-state"))


@pytest.fixture
def run_env(store, monkeypatch, tmp_path):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("DSPARK_STATE_DIR", str(tmp_path))
    yield store
    tracking.end_run()


def get_run(store: str, run_id: str):
    import mlflow

    return mlflow.MlflowClient(store).get_run(run_id)


# ---------------------------------------------------------------------------- lineage
def test_dataset_inputs_record_name_source_digest_and_context(run_env, tmp_path, monkeypatch):
    monkeypatch.setenv(tracking.GIT_COMMIT_ENV, "0123abcd" * 5)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"turns": ["hi"]}\n')
    rollouts = tmp_path / "rollouts"
    (rollouts / "data").mkdir(parents=True)
    (rollouts / "data" / "part-0.parquet").write_bytes(b"rows")
    run_id = tracking.start_run("lineage", run_name="gen")
    computed = tracking.log_dataset_input("prompts", str(prompts), None, "prompts")
    given = tracking.log_dataset_input("rollouts", str(rollouts), "f" * 64, "output")
    missing = tracking.log_dataset_input("nope", str(tmp_path / "missing.jsonl"), None, "prompts")
    tracking.log_dataset_input("eval", "s3://bucket/eval/gsm8k.jsonl", "abc123", "evaluation")
    tracking.end_run()

    assert computed == storage.dataset_digest(str(prompts)) and len(computed) == 32
    assert given == "f" * 32, "a digest longer than MLflow's 36-char column keeps its first 32 chars"
    assert missing is None
    run = get_run(run_env, run_id)
    inputs = {d.dataset.name: d for d in run.inputs.dataset_inputs}
    assert set(inputs) == {"prompts", "rollouts", "eval"}
    assert inputs["prompts"].dataset.digest == computed
    assert str(prompts) in inputs["prompts"].dataset.source and inputs["prompts"].dataset.source_type == "local"
    assert inputs["eval"].dataset.source_type == "s3" and "s3://bucket/eval/gsm8k.jsonl" in inputs["eval"].dataset.source
    contexts = {name: {t.key: t.value for t in d.tags}["mlflow.data.context"] for name, d in inputs.items()}
    assert contexts == {"prompts": "prompts", "rollouts": "output", "eval": "evaluation"}
    assert run.data.tags[tracking.GIT_COMMIT_TAG] == "0123abcd" * 5


def test_dataset_digest_changes_with_content_and_names(tmp_path):
    root = tmp_path / "d"
    root.mkdir()
    (root / "a.jsonl").write_text("1\n")
    first = storage.dataset_digest(str(root))
    (root / "a.jsonl").write_text("2\n")
    edited = storage.dataset_digest(str(root))
    (root / "a.jsonl").rename(root / "b.jsonl")
    renamed = storage.dataset_digest(str(root))
    assert len({first, edited, renamed}) == 3
    assert storage.dataset_digest(str(root)) == renamed  # deterministic
    with pytest.raises(FileNotFoundError, match="no file at"):
        storage.dataset_digest(str(tmp_path / "empty"))


def test_git_commit_comes_from_the_submission_env_else_git(monkeypatch):
    monkeypatch.setenv(tracking.GIT_COMMIT_ENV, "deadbeef")
    assert tracking.git_commit() == "deadbeef"
    assert tracking.submission_env() == {tracking.GIT_COMMIT_ENV: "deadbeef"}
    monkeypatch.delenv(tracking.GIT_COMMIT_ENV)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    if not head:
        pytest.skip("not a git checkout")
    assert tracking.git_commit().removesuffix("-dirty") == head


def test_series_by_position_and_system_metrics(run_env, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.2")
    run_id = tracking.start_run("lineage", run_name="train", system_metrics=True)
    tracking.log_series("dspark.accept_by_position", {2: 0.5, 1: 0.9, 3: float("nan")})
    time.sleep(1.0)
    tracking.end_run()
    history = mlflow.MlflowClient(run_env).get_metric_history(run_id, "dspark.accept_by_position")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.9), (2, 0.5)]
    run = get_run(run_env, run_id)
    assert run.info.status == "FINISHED"
    assert any(key.startswith("system/cpu_utilization") for key in run.data.metrics), run.data.metrics


# ---------------------------------------------------------------------------- never left RUNNING
CHILD = """
import sys, time
from dspark.io import tracking
run_id = tracking.start_run("lineage", run_name="child")
tracking.log_metrics({"step_loss": 1.0}, step=1)
print(run_id, flush=True)
if sys.argv[1] == "raise":
    raise RuntimeError("the job failed")
time.sleep(120)
"""


@pytest.mark.parametrize("how,status", [("sigterm", "KILLED"), ("raise", "FAILED")])
def test_run_ends_killed_or_failed_when_the_process_is_stopped_or_crashes(store, tmp_path, how, status):
    env = {**os.environ, "MLFLOW_TRACKING_URI": store, "DSPARK_STATE_DIR": str(tmp_path),
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(CHILD), how], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        run_id = proc.stdout.readline().strip()
        assert run_id, proc.stderr.read()
        if how == "sigterm":
            started = time.monotonic()
            proc.send_signal(signal.SIGTERM)  # what `ray job stop` sends the driver
        rc = proc.wait(timeout=60)
    finally:
        proc.kill()
    if how == "sigterm":
        assert rc == -signal.SIGTERM, "the process must still die of SIGTERM (default action re-raised)"
        assert time.monotonic() - started < tracking.RAY_STOP_GRACE_S, "Ray SIGKILLs after 3 s"
    else:
        assert rc == 1
    run = get_run(store, run_id)
    assert run.info.status == status
    assert run.data.metrics == {"step_loss": 1.0}, "queued metrics are flushed before the run ends"


# ---------------------------------------------------------------------------- never blocks
@pytest.fixture
def hanging_server():
    """A TCP port that accepts connections (backlog) but never answers: a hung tracking server."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


@pytest.mark.parametrize("server", ["hanging", "down"])
def test_logging_returns_at_once_when_the_server_hangs_or_is_down(server, hanging_server, monkeypatch, caplog):
    if server == "down":
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            uri = f"http://127.0.0.1:{probe.getsockname()[1]}"  # closed again: connection refused
    else:
        uri = hanging_server
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "3")  # frees the logging thread after the test
    monkeypatch.setattr(tracking, "BACKOFF_S", 0.0)
    monkeypatch.setattr(tracking, "_background", tracking.new_background_logger(maxsize=50))
    monkeypatch.setattr(tracking, "_current", None)
    tracking.attach_run("0" * 32)  # a worker logging into the driver's run: no request needed
    caplog.set_level(logging.WARNING, logger="dspark.io.tracking")
    started = time.monotonic()
    for step in range(200):  # 200 training steps' worth of metrics
        tracking.log_metrics({"loss": 1.0 / (step + 1)}, step=step)
    tracking.log_params({"lr": 1e-3})
    tracking.set_tags({"stage": "train"})
    logged_s = time.monotonic() - started
    assert logged_s < 1.0, f"200 log calls took {logged_s:.2f} s against an unresponsive server"
    started = time.monotonic()
    drained = tracking.flush(timeout_s=0.5)
    assert time.monotonic() - started < 1.5, "flush must honour its bound"
    # (down: refused connections are retried on the logging thread and warned about, never raised)
    if server == "hanging":  # nothing can complete: the queue fills, calls are dropped, flush gives up
        assert drained is False and "still pending after 0.5 s" in caplog.text
        assert tracking._background.dropped == 200 + 2 - 50 and "not keeping up" in caplog.text
    monkeypatch.setattr(tracking, "_current", None)


HUNG_EXIT = """
from dspark.io import tracking
tracking.attach_run("0" * 32)
for step in range(100):
    tracking.log_metrics({"loss": 1.0}, step=step)
print("logged", flush=True)
"""


def test_exit_is_not_held_by_calls_pending_on_a_hung_server(hanging_server, tmp_path):
    """Why the queue is ours and not MLflow's async logging, whose worker pool is joined at exit (with
    these 100 calls pending and a 3 s HTTP timeout, that process took 61 s to exit): ours exits after
    its bounded at-exit flush, whatever is still pending."""
    env = {**os.environ, "MLFLOW_TRACKING_URI": hanging_server, "MLFLOW_HTTP_REQUEST_TIMEOUT": "3",
           "DSPARK_MLFLOW_FLUSH_TIMEOUT_S": "0.5", "DSPARK_STATE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", HUNG_EXIT], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "logged\n", proc.stderr.read()
        started = time.monotonic()
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    assert time.monotonic() - started < 5.0, "exit must not wait for calls pending on a hung server"
    assert "still pending after 0.5 s" in proc.stderr.read()


# ---------------------------------------------------------------------------- launchers
def test_cli_runtime_env_carries_the_commit_and_stays_valid(tmp_path, monkeypatch, capsys):
    from ray.runtime_env import RuntimeEnv

    from dspark import cli

    monkeypatch.setenv(tracking.GIT_COMMIT_ENV, "cafe" * 10)
    out = tmp_path / "re.yaml"
    assert cli.main(["runtime-env", "--base", str(ROOT / "infra" / "runtime_env.yaml"), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    import yaml

    data = yaml.safe_load(out.read_text())
    RuntimeEnv(**data)  # still a valid runtime env
    assert data["env_vars"][tracking.GIT_COMMIT_ENV] == "cafe" * 10
    base = yaml.safe_load((ROOT / "infra" / "runtime_env.yaml").read_text())
    assert {k: v for k, v in data["env_vars"].items() if k != tracking.GIT_COMMIT_ENV} == base["env_vars"]


def test_flush_gives_up_instead_of_deadlocking_when_its_thread_holds_the_queue():
    """A SIGTERM handler runs on the main thread, possibly while it is inside queue.put: flush must
    give up after its bound rather than wait on a lock its own thread holds."""
    background = tracking.new_background_logger(maxsize=10)
    background._queue.mutex.acquire()  # as if interrupted inside put()
    try:
        started = time.monotonic()
        assert background.flush(timeout_s=0.3) is False
        assert time.monotonic() - started < 1.0
    finally:
        background._queue.mutex.release()
    assert background.flush(timeout_s=0.3) is True  # nothing queued
