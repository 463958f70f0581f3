"""Local stack (dspark.devstack.stack, `dspark stack ...`) and the MLflow wrapper (dspark.io.tracking).

Unit tests here start no servers. Integration tests (marked) bring a real stack up through the
CLI on their own ports; run them under `flock /tmp/dspark-heavy.lock`.
"""

from __future__ import annotations

import json

import os

import re

import shutil


import subprocess

import sys

import tempfile


from pathlib import Path

import pytest

from dspark.devstack import stack

from tests.unit.devstack.test_stack import VENV_BIN, base_env, listening_blocker, run_cli  # noqa: F401 (shared helpers and fixtures)



CLI_PORTS = {"DSPARK_S3_PORT": "8633", "DSPARK_MLFLOW_PORT": "5300",
             "DSPARK_RAY_PORT": "6679", "DSPARK_DASHBOARD_PORT": "8565"}



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
@pytest.mark.slow  # Ray jobs against the stack also run in test_rollouts (make test)
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
