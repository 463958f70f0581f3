"""A multi-node Ray cluster on 127.0.0.1 for the node-failure tests (tests/cluster/test_cluster.py).

`stack_services` (module scope): the local stack's SeaweedFS S3 and MLflow server (dspark.devstack, no
Ray head) on free ports in a temporary state dir; their client env is applied to os.environ.

`ray_cluster` (function scope): a head and two worker nodes started with `ray.cluster_utils.Cluster`
(Ray's own multi-raylet test utility: one GCS, one raylet + object store per node). Each node has
  - its own Ray temp dir and its own TMPDIR (`<root>/<name>/`): its "local disk" — a file written
    there by a worker is invisible to the other nodes' code paths, as on separate machines;
  - its own logical CPUs and a custom resource named after it ({"worker-a": 1}), so a test can size
    work to force placement (the machine has 2 real cores; the CPUs here are bookkeeping only).
`kill(name)` ends a worker node the way a lost machine ends: SIGKILL to its raylet, object store,
agents and every worker process the raylet started (found by PID, as the raylet's descendants).
Teardown kills every node by process id, then stops S3/MLflow by their recorded PIDs.

Drivers (jobs.generate / jobs.train / jobs.serve) run as subprocesses on the head with
`--set ray.address=<GCS address>` and the env of `cluster.job_env()`.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
HEAD_CPUS = 1.0      # drivers' own Ray Data tasks (reads, small maps); too little for a 1.5-CPU worker
WORKER_CPUS = 2.0    # each worker node holds exactly one 1.5-CPU actor: two actors must spread
OBJECT_STORE_BYTES = 200 * 1024 * 1024
NODE_START_TIMEOUT_S = 300.0  # a node's raylet registering with the GCS (Ray's own limit: 30 s)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ClusterNode:
    name: str
    node: object            # ray._private.node.Node
    root: Path              # this node's "local disk"
    node_id: str = ""

    def pids(self) -> set[int]:
        """Every live process of this node: the processes Ray started for it (raylet, object store,
        agents, log monitor) and all their descendants (the raylet's worker processes)."""
        found: set[int] = set()
        for infos in self.node.all_processes.values():
            for info in infos:
                if info.process is None or info.process.poll() is not None:
                    continue
                found.add(info.process.pid)
                try:
                    found.update(c.pid for c in psutil.Process(info.process.pid).children(recursive=True))
                except psutil.Error:
                    pass
        return found


@dataclass
class LocalCluster:
    root: Path
    cluster: object         # ray.cluster_utils.Cluster
    dashboard_url: str
    nodes: dict[str, ClusterNode] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return self.cluster.address

    def add_worker(self, name: str, num_cpus: float = WORKER_CPUS) -> ClusterNode:
        """Start a worker node named `name` (its custom resource is {name: 1}) and wait until it is alive."""
        root = self.root / name
        (root / "tmp").mkdir(parents=True, exist_ok=True)
        node = self.cluster.add_node(
            num_cpus=num_cpus, resources={name: 1.0}, node_ip_address="127.0.0.1",
            object_store_memory=OBJECT_STORE_BYTES, temp_dir=str(root / "ray"),
            env_vars={"TMPDIR": str(root / "tmp"), "RAY_ADDRESS": self.address})
        entry = ClusterNode(name, node, root, node.node_id)
        self.nodes[name] = entry
        return entry

    def kill(self, name: str) -> set[int]:
        """SIGKILL every process of node `name`, by PID; returns the PIDs killed."""
        entry = self.nodes.pop(name)
        pids = entry.pids()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(psutil.pid_exists(p) and psutil.Process(p).status()
                                                  != psutil.STATUS_ZOMBIE for p in pids):
            time.sleep(0.1)
        for infos in entry.node.all_processes.values():  # reap our direct children
            for info in infos:
                if info.process is not None:
                    info.process.poll()
        self.cluster.worker_nodes.discard(entry.node)
        return pids

    def node_name(self, node_id: str) -> str | None:
        return next((n.name for n in self.nodes.values() if n.node_id == node_id), None)

    def alive_node_ids(self) -> set[str]:
        from ray.util.state import list_nodes

        return {n.node_id for n in list_nodes(address=self.dashboard_url, filters=[("state", "=", "ALIVE")],
                                              raise_on_missing_output=False)}

    def actors(self, class_contains: str, state: str | None = "ALIVE") -> list:
        """Actors whose class name contains `class_contains` (in `state`; None: any), from Ray's state API."""
        from ray.util.state import list_actors

        filters = [("state", "=", state)] if state else None
        return [a for a in list_actors(address=self.dashboard_url, filters=filters, detail=True,
                                       limit=10000, raise_on_missing_output=False)
                if class_contains in (a.class_name or "")]

    def job_env(self) -> dict[str, str]:
        """Environment of a driver subprocess: the stack's client env (already in os.environ), the
        cluster's auth token, loopback Ray, CPU DeepSpeed."""
        return {**os.environ, "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
                "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
                "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}

    def start_job(self, module: str, config: Path, overrides: list[str], log: Path,
                  extra_args: list[str] = ()) -> subprocess.Popen:
        """`python -m <module> --config <config> --set ray.address=<this cluster> ...`, stdout+stderr to `log`."""
        cmd = [sys.executable, "-m", module, "--config", str(config), "--set", f"ray.address={self.address}",
               *extra_args]
        for item in overrides:
            cmd += ["--set", item]
        out = open(log, "ab")
        try:
            return subprocess.Popen(cmd, cwd=REPO, env=self.job_env(), stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            out.close()

    def shutdown(self) -> None:
        """Kill every node by PID (workers first, the head last)."""
        for name in list(self.nodes):
            if name != "head":
                self.kill(name)
        head = self.nodes.pop("head", None)
        if head is not None:
            pids = head.pids()
            head.node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


def job_result(proc: subprocess.Popen, log: Path, timeout_s: float) -> dict:
    """Wait for a job subprocess; assert it succeeded; its last JSON stdout line."""
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise AssertionError(f"job did not finish within {timeout_s:g} s; log tail:\n{log_tail(log)}") from None
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, f"job failed ({proc.returncode}); log tail:\n{log_tail(log)}"
    return json.loads(lines[-1])


def log_tail(log: Path, chars: int = 6000) -> str:
    return log.read_text(errors="replace")[-chars:] if log.exists() else "(no log)"


def stop_job(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def free_s3_port() -> int:
    """An S3 port whose derived SeaweedFS ports (master, volume, filer, admin, each + its gRPC port) are free."""
    import random

    from dspark.devstack.config import StackConfig
    from dspark.devstack.processes import port_is_free

    for _ in range(200):
        port = random.randrange(12000, 20000)
        if all(port_is_free(p) for p in StackConfig(state_dir=Path("/"), s3_port=port).weed_ports().values()):
            return port
    raise RuntimeError("no free port set for SeaweedFS")


# ---- fixtures ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stack_services():
    """SeaweedFS S3 + MLflow of the local stack (no Ray head), on free ports, env applied to os.environ."""
    from dspark.devstack import stack

    state_dir = Path(tempfile.mkdtemp(prefix="dsc-stack-"))
    ports = {"DSPARK_S3_PORT": str(free_s3_port()), "DSPARK_MLFLOW_PORT": str(free_port())}
    with pytest.MonkeyPatch.context() as patch:
        for key, value in ports.items():
            patch.setenv(key, value)
        patch.setenv("DSPARK_STATE_DIR", str(state_dir))
        cfg = stack.StackConfig.from_env()
        try:
            env = stack.up(cfg, say=lambda msg: None, services=("s3", "mlflow"))
        except BaseException:
            shutil.rmtree(state_dir, ignore_errors=True)
            raise
        try:
            for key, value in env.items():
                if not key.startswith("RAY_") and key != "DSPARK_RAY_GCS_ADDRESS":
                    patch.setenv(key, value)
            patch.delenv("RAY_ADDRESS", raising=False)
            yield env
        finally:
            stack.down(cfg, say=lambda msg: None)
            shutil.rmtree(state_dir, ignore_errors=True)


@pytest.fixture
def ray_cluster(stack_services):
    """Head (1 CPU) + worker-a + worker-b (2 CPUs each), every node with its own temp dir; token auth
    with a token file of its own. Killed by PID at the end."""
    root = Path(tempfile.mkdtemp(prefix="dsc-", dir="/tmp"))  # short: Ray's socket paths stay < 108 bytes
    token = root / "auth_token"
    token.write_text(os.urandom(32).hex())
    token.chmod(0o600)
    with pytest.MonkeyPatch.context() as patch:
        for key, value in {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token),
                           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}.items():
            patch.setenv(key, value)
        patch.delenv("RAY_ADDRESS", raising=False)
        import ray._private.ray_constants as ray_constants
        import ray._private.utils
        from ray.cluster_utils import Cluster

        from pipelines.ray_cluster import _refresh_ray_auth

        ray_constants.ENABLE_RAY_CLUSTER = False  # bind to 127.0.0.1 even if ray was imported earlier
        _refresh_ray_auth()
        # Cluster() records its address in /tmp/ray/ray_current_cluster, where any later ray.init() on
        # this machine would find it; this cluster is reached by its address only.
        patch.setattr(ray._private.utils, "write_ray_address", lambda *a, **k: None)
        (root / "head" / "tmp").mkdir(parents=True)
        dashboard_port = free_port()
        local = None
        try:
            _patient_node_start(patch)
            cluster = Cluster(initialize_head=False, shutdown_at_exit=True)
            cluster._wait_for_node = lambda node, timeout=NODE_START_TIMEOUT_S: Cluster._wait_for_node(
                cluster, node, timeout)
            gcs_port = free_port()
            # RAY_ADDRESS on every node: Ray code that looks the cluster up without an address (e.g. Ray
            # Train's placement-group cleaner) must find this one, not another Ray on the machine
            cluster.add_node(
                num_cpus=HEAD_CPUS, resources={"head": 1.0}, node_ip_address="127.0.0.1", gcs_server_port=gcs_port,
                object_store_memory=OBJECT_STORE_BYTES, temp_dir=str(root / "head" / "ray"),
                env_vars={"TMPDIR": str(root / "head" / "tmp"), "RAY_ADDRESS": f"127.0.0.1:{gcs_port}"},
                include_dashboard=True,
                dashboard_host="127.0.0.1", dashboard_port=dashboard_port, min_worker_port=0, max_worker_port=0)
            local = LocalCluster(root, cluster, f"http://127.0.0.1:{dashboard_port}")
            local.nodes["head"] = ClusterNode("head", cluster.head_node, root / "head", cluster.head_node.node_id)
            local.add_worker("worker-a")
            local.add_worker("worker-b")
            wait_for(lambda: len(_alive_or_none(local)) == 3, 90, "3 nodes alive in the state API")
            yield local
        finally:
            if local is not None:
                local.shutdown()
            shutil.rmtree(root, ignore_errors=True)


def _patient_node_start(patch: pytest.MonkeyPatch) -> None:
    """Ray gives a starting raylet 30 s to register with the GCS (ray._private.node, not configurable);
    on a shared 2-core machine under load that is not always enough. Let
    the registration poll retry for NODE_START_TIMEOUT_S instead."""
    import ray._private.services as services

    real = services.get_node

    def get_node(gcs_address, node_id):
        deadline = time.monotonic() + NODE_START_TIMEOUT_S
        while True:
            try:
                return real(gcs_address, node_id)
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    patch.setattr(services, "get_node", get_node)


def _alive_or_none(local: LocalCluster) -> set[str]:
    try:
        return local.alive_node_ids()
    except Exception:  # noqa: BLE001 - the dashboard is still starting
        return set()
