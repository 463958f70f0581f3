"""Multi-node Ray on one machine (issue #24): see cluster_fixture.py."""
from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest

from tests.cluster.cluster_fixture import REPO, job_result, log_tail, ray_cluster, stack_services, stop_job, wait_for  # noqa: F401
from dspark.config import read_yaml

pytestmark = [pytest.mark.integration, pytest.mark.cluster, pytest.mark.slow]


@pytest.mark.timeout(300)
def test_nodes_have_their_own_disks_and_die_by_pid(ray_cluster):
    import ray

    ray.init(address=ray_cluster.address)
    try:
        @ray.remote(num_cpus=0)
        def where():
            import tempfile
            return ray.get_runtime_context().get_node_id(), tempfile.gettempdir()

        seen = {name: ray.get(where.options(resources={name: 0.01}).remote()) for name in ("worker-a", "worker-b")}
        for name, (node_id, tmp) in seen.items():
            assert node_id == ray_cluster.nodes[name].node_id and tmp == str(ray_cluster.root / name / "tmp")
        killed = ray_cluster.kill("worker-a")
        assert killed
        wait_for(lambda: seen["worker-a"][0] not in ray_cluster.alive_node_ids(), 60, "worker-a dead")
        assert len(ray_cluster.alive_node_ids()) == 2
    finally:
        ray.shutdown()


# ---- rollouts ------------------------------------------------------------------------------------------
PROMPTS, CHUNKS = 48, 12


def _generate_config(tmp_path, output: str) -> Path:
    """configs/generate/tiny.yaml with 48 prompts in 12 chunks and two 1.5-CPU replicas: one fits per
    worker node (2 CPUs) and none on the head (1 CPU), so the pool spans both workers."""
    import yaml

    cfg = yaml.safe_load((REPO / "configs/generate/tiny.yaml").read_text())
    cfg["sources"] = [{"uri": str(REPO / "data/train/math.jsonl"), "domain": "math", "limit": 20},
                      {"uri": str(REPO / "data/train/code.jsonl"), "domain": "code", "limit": 16},
                      {"uri": str(REPO / "data/train/chat.jsonl"), "domain": "chat", "limit": 12}]
    cfg.update(output=output, chunk_size=PROMPTS // CHUNKS)
    cfg["sampling"]["max_new_tokens"] = 16
    cfg["compute"] = {"replicas": 2, "batch_size": 4, "num_cpus": 1.5, "torch_threads": 1, "dtype": "float32",
                      "start_timeout_s": 180}
    cfg["tracking"] = {"experiment": "test-cluster-generate"}
    path = tmp_path / "generate.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.timeout(900)
def test_rollouts_spread_over_nodes_and_survive_losing_one(ray_cluster, tmp_path):
    """jobs.generate with a replica on each worker node (placement read from Ray's state API); worker-b
    is killed, with its replica busy, after the first committed chunk. The same run finishes on
    worker-a: Ray Data retries the dead replica's batches (it restarts the replica in the pool's
    placement group once the survivor has drained the input) and every prompt is in the output
    exactly once."""
    from dspark.io import storage
    from dspark.io.storage.rollout_store import read_commits, read_rollouts

    output = f"s3://dspark/tests/cluster/rollouts-{uuid.uuid4().hex[:8]}"
    config = _generate_config(tmp_path, output)
    log = tmp_path / "generate.log"
    proc = ray_cluster.start_job("jobs.generate", config, [], log)
    try:
        def replica_nodes():
            return {a.node_id for a in ray_cluster.actors("MapWorker")} or None

        nodes = wait_for(lambda: (n := replica_nodes()) and len(n) == 2 and n, 300, "2 rollout replicas",
                         interval_s=1.0)
        worker_nodes = {ray_cluster.nodes[n].node_id for n in ("worker-a", "worker-b")}
        assert nodes == worker_nodes, f"replicas on {nodes}, workers are {worker_nodes}"
        wait_for(lambda: len(read_commits(output)) >= 1 or proc.poll() is not None, 300, "a committed chunk")
        assert proc.poll() is None, f"finished before the kill; log:\n{log_tail(log)}"
        committed_before = len(read_commits(output))
        killed = ray_cluster.kill("worker-b")
        result = job_result(proc, log, 600)
    finally:
        stop_job(proc)
    text = log.read_text(errors="replace")
    assert "MapWorker(MapBatches(RolloutActor)).submit failed" in text, "the dead replica held batches"
    manifest = json.loads(storage.read_text(f"{output}/manifest.json"))
    counts = manifest["counts"]
    assert result["complete"] and manifest["complete"] and len(read_commits(output)) == CHUNKS
    assert counts["unique_prompts"] == PROMPTS and counts["rows_out"] + counts["generation_errors"] == PROMPTS
    ids = read_rollouts(output).column("prompt_id").to_pylist()
    assert len(ids) == len(set(ids)) == counts["rows_out"], "every prompt exactly once"
    print(f"\n[cluster] rollouts: {committed_before}/{CHUNKS} chunks committed when worker-b died "
          f"({len(killed)} processes killed); the same run finished: {result}")


# ---- training ------------------------------------------------------------------------------------------
TRAIN_STEPS, CKPT_EVERY = 12, 4


def _upload_rollouts(uri: str, rows: int = 64) -> str:
    """Rollouts as jobs.generate writes their training columns: chat prompts answered by the tiny target."""
    import io

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dspark.io import storage
    from dspark.models.target import load_target

    target = load_target("tiny")
    rng = np.random.default_rng(0)
    words = "the a of to and in is it that for on with as was he she they we you are be this have".split()
    prompts = [target.chat_ids([{"role": "user", "content": " ".join(rng.choice(words, 8))}]) for _ in range(rows)]
    answers = target.generate(prompts, max_new_tokens=24, temperature=0.7, seed=0)
    table = pa.table({
        "prompt_id": [f"p{i:05d}" for i in range(rows)], "split": ["train"] * rows,
        "input_ids": pa.array([p + a for p, a in zip(prompts, answers)], pa.list_(pa.int32())),
        "loss_mask": pa.array([[0] * len(p) + [1] * len(a) for p, a in zip(prompts, answers)], pa.list_(pa.int8()))})
    buf = io.BytesIO()
    pq.write_table(table, buf)
    storage.write_bytes(uri, buf.getvalue())
    return uri


def _train_config(tmp_path, run_name: str, rollouts: str, max_failures: int) -> Path:
    """configs/train/tiny-dspark.yaml with ZeRO-3, 2 workers of 1.5 CPUs (one per worker node, none fits
    on the head), SPREAD placement, checkpoints to S3 every 4 steps."""
    import yaml

    cfg = read_yaml(REPO / "configs/train/tiny-dspark.yaml")
    cfg.update(run_name=run_name, ray={})
    cfg["data"] = {"rollouts": rollouts, "max_seq_len": 128}
    cfg["optim"].update(max_steps=TRAIN_STEPS, micro_batch_size=2, global_batch_size=8)
    cfg["deepspeed"] = {"zero_stage": 3, "precision": "fp32"}
    cfg["scaling"] = {"num_workers": 2, "cpus_per_worker": 1.5, "placement_strategy": "SPREAD"}
    cfg["checkpoint"] = {"storage_path": "s3://dspark/tests/cluster/checkpoints", "every_steps": CKPT_EVERY,
                         "num_to_keep": 2, "max_failures": max_failures}
    cfg["tracking"] = {"experiment": "test-cluster-train", "registered_model": f"{run_name}-drafter"}
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _rank_nodes(ray_cluster, log: Path) -> list[dict[int, str]]:
    """Per worker-group start, {rank: node id}: ranks and PIDs from the Train controller's
    "Started training worker group" lines in the driver log, nodes from Ray's state API."""
    import re

    pids = {a.pid: a.node_id for a in ray_cluster.actors("RayTrainWorker", state=None)}
    groups: list[dict[int, str]] = []
    for pid, rank in re.findall(r"pid=(\d+)\) world_rank=(\d+)", log.read_text(errors="replace")):
        if not groups or int(rank) in groups[-1]:
            groups.append({})
        groups[-1][int(rank)] = pids.get(int(pid), "?")
    return groups


def _latest_checkpoint_step(run_dir: str) -> int:
    """Step of the checkpoint Ray Train has registered (its manager snapshot in the run dir), 0 if none."""
    from dspark.io import storage

    try:
        snapshot = json.loads(storage.read_text(f"{run_dir}/checkpoint_manager_snapshot.json"))
    except (FileNotFoundError, ValueError, OSError):
        return 0
    latest = snapshot.get("latest_checkpoint_result") or {}
    metrics = latest.get("metrics") or {}
    if isinstance(metrics, str):
        metrics = json.loads(metrics)
    return int(metrics.get("step", 0))


def _train_until_rank1_node_dies(ray_cluster, tmp_path, max_failures: int):
    """Start jobs.train; once Ray Train registered a checkpoint, SIGKILL the node of rank 1, then add
    worker-c. Returns (process, log, run_name, rank placement before the kill, checkpoint step)."""
    run_name = f"cluster-{uuid.uuid4().hex[:6]}"
    rollouts = _upload_rollouts(f"s3://dspark/tests/cluster/rollouts-train-{run_name}/part-00000.parquet")
    config = _train_config(tmp_path, run_name, rollouts, max_failures)
    log = tmp_path / "train.log"
    proc = ray_cluster.start_job("jobs.train", config, [], log)
    run_dir = f"s3://dspark/tests/cluster/checkpoints/{run_name}"
    first = wait_for(lambda: (g := _rank_nodes(ray_cluster, log)) and len(g[0]) == 2 and g[0]
                     or proc.poll() is not None,
                     420, "both ranks placed", interval_s=1.0)
    assert proc.poll() is None, log_tail(log)
    step = wait_for(lambda: _latest_checkpoint_step(run_dir) or proc.poll() is not None, 420,
                    "a registered checkpoint", interval_s=1.0)
    assert proc.poll() is None, log_tail(log)
    victim = ray_cluster.node_name(first[1])
    assert victim in ("worker-a", "worker-b") and first[0] != first[1], f"ranks on {first}"
    ray_cluster.kill(victim)
    wait_for(lambda: first[1] not in ray_cluster.alive_node_ids(), 120, f"{victim} marked dead")
    ray_cluster.add_worker("worker-c")  # the replacement node (as an autoscaler would add it)
    return proc, log, run_name, first, step


@pytest.mark.timeout(1200)
def test_zero3_training_resumes_after_losing_the_node_of_rank_1(ray_cluster, tmp_path):
    """jobs.train, ZeRO-3, rank 0 and rank 1 on different worker nodes, checkpoints in S3. The node of
    rank 1 is killed after a registered checkpoint; Ray Train (FailureConfig.max_failures) restarts the
    worker group once worker-c joins, the workers restore the S3 checkpoint (written on other nodes),
    and the run reaches its step count in one MLflow run with one metric point per step."""
    from mlflow import MlflowClient

    from dspark.io import storage

    proc, log, run_name, first, ckpt_step = _train_until_rank1_node_dies(ray_cluster, tmp_path, max_failures=2)
    try:
        summary = job_result(proc, log, 900)
    finally:
        stop_job(proc)
    groups = _rank_nodes(ray_cluster, log)
    assert len(groups) >= 2, f"the worker group restarted: {groups}"
    assert set(groups[-1].values()) == {ray_cluster.nodes["worker-c"].node_id,
                                        ray_cluster.nodes[ray_cluster.node_name(first[0])].node_id}, groups
    assert summary["metrics"]["step"] == TRAIN_STEPS
    state = json.loads(storage.read_text(storage.join(summary["checkpoint"], "train_state.json")))
    assert state["restarts"] == 1 and state["restored_from"] >= ckpt_step >= CKPT_EVERY, state
    files = storage.list_files(f"s3://dspark/tests/cluster/checkpoints/{run_name}/")
    assert any("zero_pp_rank_1_mp_rank_00_optim_states.pt" in f for f in files), "rank 1's ZeRO-3 shard in S3"

    client = MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name("test-cluster-train")
    runs = client.search_runs([exp.experiment_id], f"tags.mlflow.runName = '{run_name}'")
    assert len(runs) == 1 and runs[0].info.run_id == summary["mlflow_run_id"], "one MLflow run"
    assert runs[0].info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(summary["mlflow_run_id"], "loss")]
    assert sorted(steps) == list(range(1, TRAIN_STEPS + 1)), f"one point per step, none duplicated: {steps}"
    resumed = [m.value for m in client.get_metric_history(summary["mlflow_run_id"], "resumed_from_step")]
    assert resumed == [float(state["restored_from"])]
    print(f"\n[cluster] training: ranks {first} -> {groups[-1]}; checkpoint step {ckpt_step} registered "
          f"before the kill, resumed from {state['restored_from']}; {summary['wall_s']} s")


# ---- serving -------------------------------------------------------------------------------------------
def _upload_drafter(uri: str) -> str:
    """An untrained tiny DSpark drafter in S3 (the replicas load it from there, not from a node's disk)."""
    import tempfile

    import torch

    from dspark.drafters import DrafterConfig, build_drafter, save_drafter
    from dspark.io import storage
    from dspark.models.target import load_target

    torch.manual_seed(0)
    drafter = build_drafter(DrafterConfig(algo="dspark", block_size=4, num_layers=1, num_context_layers=2, rank=16),
                            load_target("tiny"))
    with tempfile.TemporaryDirectory() as tmp:
        storage.upload_dir(save_drafter(drafter, tmp), uri)
    return uri


def _serve_config(tmp_path, drafter: str, port: int) -> Path:
    """configs/serve/tiny.yaml: 2 replicas of 1.5 CPUs (one per worker node), fixed SPS table (no
    profiling), Serve health checks every 2 s, one HTTP proxy on the head (all nodes share 127.0.0.1)."""
    import yaml

    cfg = yaml.safe_load((REPO / "configs/serve/tiny.yaml").read_text())
    cfg["model"]["drafter"] = drafter
    cfg["engine"].update(max_model_len=256, sps_table={1: 300.0, 8: 150.0, 32: 60.0})
    cfg["deployment"].update(name="cluster", num_replicas=2, num_cpus=1.5, torch_threads=1,
                             health_check_period_s=2.0, health_check_timeout_s=10.0)
    cfg["http"] = {"host": "127.0.0.1", "port": port, "route_prefix": "/", "proxy_location": "HeadOnly"}
    cfg.update(ray={}, ready_timeout_s=300)
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _running_replicas(ray_cluster, app: str) -> dict[str, str]:
    """{replica id: node id} of the app's RUNNING replicas, from Serve's REST API on the dashboard."""
    import httpx

    token = open(os.environ["RAY_AUTH_TOKEN_PATH"]).read().strip()
    try:
        body = httpx.get(f"{ray_cluster.dashboard_url}/api/serve/applications/", timeout=10,
                         headers={"Authorization": f"Bearer {token}"}).json()
    except (httpx.HTTPError, ValueError):
        return {}
    deployments = (body.get("applications", {}).get(app) or {}).get("deployments", {})
    return {r["replica_id"]: r["node_id"] for d in deployments.values() for r in d.get("replicas", [])
            if r.get("state") == "RUNNING"}


class Traffic:
    """Closed-loop clients sending short chat requests; records (start, end, status) per request."""

    def __init__(self, url: str, clients: int = 4):
        import threading

        self.url, self.stop, self.records, self.lock = url, threading.Event(), [], threading.Lock()
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(clients)]

    def _loop(self, client: int) -> None:
        import time

        import httpx

        body = {"model": "dspark-tiny", "max_tokens": 8, "temperature": 1.0,
                "messages": [{"role": "user", "content": f"client {client}: say something"}]}
        with httpx.Client(base_url=self.url, timeout=120) as http:
            while not self.stop.is_set():
                start = time.monotonic()
                try:
                    status = http.post("/v1/chat/completions", json=body).status_code
                except httpx.HTTPError as err:
                    status = type(err).__name__
                with self.lock:
                    self.records.append((start, time.monotonic(), status))

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=150)

    def ok_since(self, t: float) -> int:
        with self.lock:
            return sum(1 for s, _, status in self.records if s >= t and status == 200)


@pytest.mark.timeout(900)
def test_serving_keeps_answering_when_a_replica_node_dies(ray_cluster, tmp_path):
    """jobs.serve: 2 replicas on the 2 worker nodes; under steady traffic worker-b is killed. Only
    requests in flight when it died may fail; every request sent after answers 200 from worker-a;
    Serve restarts the lost replica on worker-c once it joins (2 RUNNING replicas again)."""
    import time

    from tests.cluster.cluster_fixture import free_port

    drafter = _upload_drafter(f"s3://dspark/tests/cluster/drafter-{uuid.uuid4().hex[:6]}")
    port = free_port()
    log = tmp_path / "serve.log"
    deployer = ray_cluster.start_job("jobs.serve", _serve_config(tmp_path, drafter, port), [], log,
                                     extra_args=["--detach"])  # deploys, waits for /healthz, exits
    job_result(deployer, log, 420)
    worker_nodes = {ray_cluster.nodes[n].node_id for n in ("worker-a", "worker-b")}
    wait_for(lambda: set(_running_replicas(ray_cluster, "cluster").values()) == worker_nodes, 300,
             "a RUNNING replica on each worker node")
    with Traffic(f"http://127.0.0.1:{port}") as traffic:
        wait_for(lambda: traffic.ok_since(0) >= 12, 300, "steady traffic")
        killed_at = time.monotonic()
        ray_cluster.kill("worker-b")
        wait_for(lambda: traffic.ok_since(killed_at) >= 12, 300, "answers after the kill")
        ray_cluster.add_worker("worker-c")
        nodes_after = {ray_cluster.nodes[n].node_id for n in ("worker-a", "worker-c")}
        wait_for(lambda: set(_running_replicas(ray_cluster, "cluster").values()) == nodes_after, 300,
                 "2 RUNNING replicas again (worker-a, worker-c)")
        recovered_at = time.monotonic()
        wait_for(lambda: traffic.ok_since(recovered_at) >= 8, 300, "answers after the recovery")
    records = traffic.records
    in_flight = [r for r in records if r[0] < killed_at < r[1]]
    failed = [r for r in records if r[2] != 200]
    assert all(r in in_flight for r in failed), f"a request sent after the kill failed: {failed}"
    assert len(failed) <= len(in_flight)
    print(f"\n[cluster] serving: {len(records)} requests, {len(in_flight)} in flight when worker-b died, "
          f"{len(failed)} of them failed ({sorted(set(str(r[2]) for r in failed))}); "
          f"{sum(1 for r in records if r[0] > killed_at and r[2] == 200)} answered after the kill")
