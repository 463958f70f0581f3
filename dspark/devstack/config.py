"""The local stack's configuration: state dir, loopback ports (primary and derived), credentials and
the client environment written to `<state>/env.sh`."""
from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from dspark.settings import settings

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
# The environment a Ray on this machine starts with (the stack's `ray start`, and a job's own local Ray through
# pipelines/ray_cluster.loopback_env), unless the shell sets a variable itself: bound to loopback
# (PLATFORM-NOTES), and Serve's proxy given a minute. That Ray shares its cores with the work it runs: Serve kills
# a proxy that misses 3 health checks of 10 s (Ray's defaults), and on a loaded 2-core machine the proxy is still
# importing then (measured: `serve.start` failed with ActorDiedError "killed by ray.kill ... never ran" beside 2
# busy processes, and passed with these).
LOCAL_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0", "DS_ACCELERATOR": "cpu",
                 "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60"}


class StackError(RuntimeError):
    """A stack operation failed; the message names the cause and the fix in one line."""


# ---------------------------------------------------------------------------- configuration
def default_state_dir() -> Path:
    return settings().absolute_state_dir


def _port_from_env(name: str) -> int:
    raw = os.environ.get(PORT_ENV[name], "").strip()
    if not raw:
        return DEFAULT_PORTS[name]
    if not raw.isdigit() or not 1024 <= int(raw) <= MAX_PORT[name]:
        raise StackError(f"{PORT_ENV[name]}={raw!r} is not a usable port; set it to an integer in "
                         f"1024..{MAX_PORT[name]}")
    return int(raw)


# SeaweedFS's admin server listens on its HTTP port + 10000 for gRPC (no flag moves it). Its default,
# 23646, puts that at 33646: inside Linux's ephemeral range (32768-60999), where any client connection
# can hold the port for a while and `stack up` then fails its free-port check. 21646 keeps it below.
ADMIN_PORT = 21646
EPHEMERAL_FLOOR = 32768


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
        num_cpus = settings().ray_num_cpus
        return cls(state_dir=Path(state_dir).absolute() if state_dir else default_state_dir(),
                   s3_port=_port_from_env("s3"), mlflow_port=_port_from_env("mlflow"),
                   ray_port=_port_from_env("ray"), dashboard_port=_port_from_env("dashboard"),
                   num_cpus=num_cpus or os.cpu_count() or 1)

    # -- derived ports
    def weed_ports(self) -> dict[str, int]:
        shift = self.s3_port - DEFAULT_PORTS["s3"]
        http = {"s3": self.s3_port, "master": 9333 + shift, "volume": 9340 + shift,
                "filer": 8888 + shift, "admin": ADMIN_PORT + shift}
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
