"""Fault injection on the local stack (S3 + MLflow + Ray): each failure of issue #12, end to end.

- a dummy actor holds every CPU: evaluation and rollouts fail within seconds, naming it;
- a worker that is not up in time, or that dies mid-run: its items go to the other workers;
- a JSONL benchmark / prompt file in S3 with U+2028, U+2029 and \\x85 inside strings loads;
- the MLflow server and a second (file) store both hold `models:/<name>/1`: each loads its own weights;
- a restarted training logger against the MLflow server does not log the redone steps again.

Run under `flock /tmp/dspark-heavy.lock`.
"""
from __future__ import annotations

import json
import os
import sys
import time
import uuid

import pytest
import torch

pytestmark = [pytest.mark.integration, pytest.mark.slow]

START_TIMEOUT_S = 4.0


@pytest.fixture(scope="module")
def stack_ray(local_stack):
    import ray

    from pipelines.ray_cluster import init_ray
    from dspark.config import RayConfig

    init_ray(RayConfig(address=local_stack.ray_gcs_address))
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    yield local_stack
    ray.shutdown()


class Hog:
    """Holds CPUs and does nothing, like a Serve replica kept by an endpoint."""

    def ping(self) -> int:
        return 1


class Squarer:
    """A pool worker: squares items; `dies` makes it exit on its first item; `slow_start` delays its start."""

    def __init__(self, dies: bool = False, slow_start_s: float = 0.0):
        time.sleep(slow_start_s)
        self.dies = dies

    def run(self, x: int) -> tuple[int, int]:
        if self.dies:
            os._exit(1)
        return x, x * x


def _wait_all_cpus_free(timeout_s: float = 30.0) -> float:
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        free, total = ray.available_resources().get("CPU", 0.0), ray.cluster_resources().get("CPU", 0.0)
        if free >= total:
            return total
        time.sleep(0.2)
    raise AssertionError(f"CPUs still held: {ray.available_resources()} of {ray.cluster_resources()}")


@pytest.fixture
def cpu_hog(stack_ray):
    """A named actor holding all CPUs but `leave` of the cluster."""
    import ray

    holders = []

    def make(leave: float = 0.0) -> str:
        total = _wait_all_cpus_free()
        name = f"cpu-hog-{uuid.uuid4().hex[:6]}"
        actor = ray.remote(Hog).options(name=name, num_cpus=total - leave).remote()
        ray.get(actor.ping.remote())
        holders.append(actor)
        return name

    yield make
    for actor in holders:
        ray.kill(actor)


# ---- 1. workers that cannot start -------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_evaluate_fails_fast_naming_what_holds_the_cpus(cpu_hog, tmp_path):
    from dspark.drafters import DrafterConfig, build_drafter, save_drafter
    from dspark.models.target import load_target
    from jobs.evaluate import EvalConfig, run
    from pipelines.actor_pool import WorkersUnavailable

    torch.manual_seed(0)
    target = load_target("tiny")
    drafter = save_drafter(build_drafter(DrafterConfig(algo="dspark", block_size=3, num_layers=1,
                                                       num_context_layers=2, rank=8), target), str(tmp_path / "d"))
    (tmp_path / "b.jsonl").write_text('{"turns": ["say hi"]}\n{"turns": ["and bye"]}\n')
    cfg = EvalConfig.model_validate({
        "target": "tiny", "drafters": [drafter], "benchmark_dir": str(tmp_path), "benchmarks": [{"path": "b.jsonl"}],
        "decode": {"max_new_tokens": 4}, "output": str(tmp_path / "out"), "tracking": {"enabled": False},
        "workers": {"num_workers": 2, "start_timeout_s": START_TIMEOUT_S}})
    hog = cpu_hog()
    start = time.monotonic()
    with pytest.raises(WorkersUnavailable) as caught:
        run(cfg)
    assert time.monotonic() - start < 30
    message = str(caught.value)
    assert "asked for 2 x (1 CPU)" in message and "0 CPU free" in message and hog in message, message


@pytest.mark.timeout(180)
def test_rollouts_fail_fast_naming_what_holds_the_cpus(cpu_hog, tmp_path, monkeypatch):
    import ray

    from pipelines import actor_pool
    from pipelines.actor_pool import WorkersUnavailable
    from pipelines.generate import RolloutConfig, run_rollouts

    (tmp_path / "p.jsonl").write_text('{"turns": ["hello there"]}\n')
    cfg = RolloutConfig.model_validate({
        "target": "tiny", "sources": [{"uri": str(tmp_path / "p.jsonl")}], "output": str(tmp_path / "out"),
        "holdout_fraction": 0.0, "sampling": {"max_new_tokens": 4},
        "compute": {"replicas": 1, "start_timeout_s": START_TIMEOUT_S}})
    hog = cpu_hog()
    start = time.monotonic()
    with pytest.raises(WorkersUnavailable, match=hog):  # the fit check, before Ray Data starts
        run_rollouts(cfg, progress=False)
    assert time.monotonic() - start < 30
    # The same shortage seen only once Ray Data starts (e.g. the CPUs were taken just after the check):
    # the reservation of its placement group ends after start_timeout_s with the same explanation.
    monkeypatch.setattr(actor_pool, "check_fit", lambda ask: ask.count)
    start = time.monotonic()
    with pytest.raises(WorkersUnavailable, match=rf"{hog}.*Not placed after {START_TIMEOUT_S:g} s"):
        run_rollouts(cfg, progress=False)
    assert time.monotonic() - start < 60
    ray.kill(ray.get_actor(hog))
    _wait_all_cpus_free(timeout_s=15)  # the replica that never started does not start (and hold a CPU) now


# ---- 2. a slow, unplaceable or dead worker's items go to the others ---------------------------------
def _squares(workers, count: int, timeout_s: float = START_TIMEOUT_S) -> dict[int, int]:
    import ray

    from pipelines.actor_pool import WorkerAsk, map_unordered

    actor = ray.remote(Squarer).options(num_cpus=0.5)
    kwargs = iter(workers)
    out = map_unordered(lambda: actor.remote(**next(kwargs)), lambda w, x: w.run.remote(x), range(count),
                        WorkerAsk("squarers", len(workers), num_cpus=0.5), timeout_s)
    return dict(out)


@pytest.mark.timeout(120)
def test_dead_and_late_workers_items_go_to_the_others(stack_ray):
    from pipelines.actor_pool import WorkersUnavailable

    _wait_all_cpus_free()
    expected = {x: x * x for x in range(8)}
    assert _squares([{"dies": True}, {}], 8) == expected  # the dying worker's item is redone elsewhere
    assert _squares([{"slow_start_s": 60.0}, {}], 8) == expected  # not up in time: dropped, not waited on
    with pytest.raises(WorkersUnavailable, match=r"No worker is up \(a worker died on item 0"):
        _squares([{"dies": True}], 2)


@pytest.mark.timeout(120)
def test_only_the_workers_that_fit_start(cpu_hog):
    cpu_hog(leave=0.5)  # room for one 0.5-CPU worker of the four asked for
    assert _squares([{}] * 4, 6) == {x: x * x for x in range(6)}


# ---- 3. JSONL with Unicode line separators inside strings, read from S3 -----------------------------
@pytest.mark.timeout(60)
def test_jsonl_with_unicode_separators_loads_from_s3(stack_ray):
    from dspark.io import storage
    from dspark.eval.benchmark_files import BenchmarkSpec, load_benchmark
    from dspark.data.prompts import PromptSource, load_prompts

    turns = ["a\u2028b", "c\u2029d", "e\x85f"]
    uri = f"s3://dspark/tests/faults-{uuid.uuid4().hex[:8]}/bench.jsonl"
    storage.write_text(uri, "".join(json.dumps({"turns": [t]}, ensure_ascii=False) + "\n" for t in turns))
    assert load_benchmark(BenchmarkSpec(path=uri), read_text=storage.read_text).prompts == [[t] for t in turns]
    loaded = load_prompts([PromptSource(uri=uri)], holdout_fraction=0.0, files=storage)
    assert loaded.errors == [] and sorted(p.turns[0] for p in loaded.prompts) == sorted(turns)


# ---- 4. two MLflow stores, one models:/ name and version ---------------------------------------------
@pytest.mark.timeout(120)
def test_drafter_cache_tells_two_tracking_servers_apart(stack_ray, tmp_path, monkeypatch):
    import mlflow

    from dspark.io.drafter_source import load_drafter_ref
    from dspark.drafters import DrafterConfig, build_drafter, save_drafter
    from dspark.models.target import load_target

    target = load_target("tiny")
    name = f"faults-drafter-{uuid.uuid4().hex[:6]}"
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))
    stores = {"server": os.environ["MLFLOW_TRACKING_URI"], "file": f"sqlite:///{tmp_path / 'other.db'}"}
    weights = {}
    for seed, (label, uri) in enumerate(stores.items()):
        torch.manual_seed(seed)
        drafter = build_drafter(DrafterConfig(algo="dspark", block_size=3, num_layers=1, num_context_layers=2,
                                              rank=8), target)
        saved = save_drafter(drafter, str(tmp_path / label))
        client = mlflow.MlflowClient(tracking_uri=uri)
        experiment = client.create_experiment(f"faults-{uuid.uuid4().hex[:6]}",
                                              artifact_location=None if label == "server" else
                                              (tmp_path / "artifacts").as_uri())
        run = client.create_run(experiment)
        client.log_artifacts(run.info.run_id, saved, "drafter")
        client.create_registered_model(name)
        version = client.create_model_version(name, f"runs:/{run.info.run_id}/drafter", run.info.run_id).version
        assert str(version) == "1"
        weights[uri] = {k: v.clone() for k, v in drafter.state_dict().items()}
    for uri in list(stores.values()) * 2:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        loaded = load_drafter_ref(f"models:/{name}/1", target).state_dict()
        assert all(torch.equal(loaded[k], weights[uri][k]) for k in loaded), f"wrong weights for {uri}"


# ---- 5. a restarted training worker logs each step once ----------------------------------------------
@pytest.mark.timeout(60)
def test_restarted_logger_against_the_server_logs_each_step_once(stack_ray):
    import mlflow

    from dspark.io import tracking
    from dspark.training.config import TrainJobConfig
    from jobs.train_worker import RankZeroLogger

    cfg = TrainJobConfig.model_validate({"run_name": "r", "data": {"rollouts": "unused"},
                                         "tracking": {"experiment": "test-faults"}})
    run_id = tracking.start_run("test-faults", f"resume-{uuid.uuid4().hex[:6]}")
    for attempt, steps in enumerate((range(1, 8), range(5, 11))):  # crash after 7, checkpoint at 4
        logger = RankZeroLogger(cfg, run_id)
        for step in steps:
            logger.log(step, {"loss": float(step + attempt)})
        tracking.end_run("FAILED" if attempt == 0 else "FINISHED")
    history = mlflow.MlflowClient().get_metric_history(run_id, "loss")
    assert sorted(m.step for m in history) == list(range(1, 11))
