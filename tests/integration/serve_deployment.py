"""A real Ray Serve deployment of `tiny` for the slow serving tests (replica_kill, overload): the fixture's
factory and the replica processes, found by the title Ray gives an actor's worker process."""
from __future__ import annotations

import os
from contextlib import contextmanager

from tests.unit.serve.test_serve import KEY_ENV, _free_port, _serve_config

HEADERS = {"authorization": "Bearer test-key"}


@contextmanager
def serve_tiny(drafter_dir: str, app: str, max_tokens_limit: int = 400, graceful_shutdown_s: float | None = None,
               **engine):
    """Deploy `tiny` + the drafter as Serve app `app` on a free 127.0.0.1 port; yields its URL."""
    import ray
    from ray import serve

    from dspark.config import RayConfig
    from dspark.serve.deployment import deployment_for
    from jobs.serve import wait_ready
    from pipelines.ray_cluster import init_ray

    os.environ[KEY_ENV] = "test-key"
    cfg = _serve_config(drafter_dir, **engine)
    cfg.api.max_tokens_limit = max_tokens_limit
    cfg.deployment.num_cpus = 1
    if graceful_shutdown_s is not None:
        cfg.deployment.graceful_shutdown_timeout_s = graceful_shutdown_s
    port = _free_port()
    init_ray(RayConfig(num_cpus=2))
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(deployment_for(cfg), name=app, route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, timeout_s=120)
        yield url
    finally:
        os.environ.pop(KEY_ENV, None)
        serve.shutdown()
        ray.shutdown()


def replica_pids(app: str) -> list[int]:
    """Ray titles an actor's worker process `ray::ServeReplica:<app>:<deployment>`."""
    import psutil

    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if f"ServeReplica:{app}:" in " ".join(proc.info["cmdline"] or []):
            found.append(proc.info["pid"])
    return found
