"""Deploy the OpenAI-compatible speculative-decoding server on Ray Serve.

    python -m jobs.serve --config configs/serve/tiny.yaml [--set engine.scheduler.mode=fixed ...]
    python -m jobs.serve --config configs/serve/smollm2-135m.yaml --detach   # onto a running cluster

Connects to the Ray cluster in `ray.address` / $RAY_ADDRESS (e.g. the embedded stack's), else starts
a local Ray on 127.0.0.1. Starts the Serve HTTP proxy on http.host:http.port, deploys the app, waits
until GET /healthz answers 200 and prints one JSON line (URL, model, scheduler, SPS table). Then it
blocks until Ctrl-C / SIGTERM and removes the app — or, with --detach, leaves it running on the
cluster (`serve status` / `serve shutdown` manage it; detaching needs a cluster that outlives this
process, i.e. a ray.address). For `serve deploy` use infra/serve/serve_config.yaml.

Every key is documented in dspark/serve/config.py (ServeConfig) and dspark/decoding/engine.py (EngineConfig).
"""
from __future__ import annotations

from pydantic import Field

import argparse
import json
import signal
import sys
import threading

from dspark.config import ConfigError, load_config
from dspark.io import storage
from dspark.serve.config import ServeConfig, served_name
from dspark.serve.deployment import deployment_for
from pipelines.ray_cluster import init_ray
from dspark.config import RayConfig


class ServeJobConfig(ServeConfig):
    ray: RayConfig = RayConfig()
    ready_timeout_s: float = Field(600.0, description="replica start: model load + SPS profiling")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Deploy the dspark OpenAI-compatible server on Ray Serve")
    parser.add_argument("--config", help="YAML config (configs/serve/*.yaml; local path or s3:// URI)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value (repeatable): --set engine.scheduler.mode=threshold")
    parser.add_argument("--detach", action="store_true", help="leave the app running on the cluster and exit")
    return parser.parse_args(argv)


def wait_ready(url: str, timeout_s: float, headers: dict | None = None) -> dict:
    """Poll GET /healthz until it answers 200; return its JSON."""
    from dspark.io.http import wait_healthy

    return wait_healthy(f"{url}/healthz", timeout_s, headers=headers, hint=(
        "check the replica logs (Ray dashboard or /tmp/ray/session_latest/logs/serve)")).json()


def deploy(cfg: ServeJobConfig) -> tuple[str, dict]:
    """Start Serve's proxy, deploy the app, wait for health. Returns (base URL, /healthz JSON)."""
    from ray import serve

    serve.start(proxy_location=cfg.http.proxy_location, http_options={"host": cfg.http.host, "port": cfg.http.port})
    serve.run(deployment_for(cfg), name=cfg.deployment.name, route_prefix=cfg.http.route_prefix, blocking=False)
    prefix = cfg.http.route_prefix.rstrip("/")
    url = f"http://{cfg.http.host}:{cfg.http.port}{prefix}"
    return url, wait_ready(url, cfg.ready_timeout_s)


def block_until_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(ServeJobConfig, args.config, args.overrides, read_text=storage.read_text)
    except ConfigError as err:
        sys.exit(f"error: {err}")
    address = init_ray(cfg.ray)
    if args.detach and address == "local":
        sys.exit("error: --detach needs a Ray cluster that outlives this process; set ray.address (or RAY_ADDRESS), "
                 "e.g. start the embedded stack first, or run without --detach")
    from ray import serve

    try:
        url, health = deploy(cfg)
    except Exception as err:
        serve.shutdown()
        sys.exit(f"error: deployment failed: {err}")
    summary = {"url": url, "openai_base_url": f"{url}/v1", "model": served_name(cfg), "app": cfg.deployment.name,
               "scheduler": health.get("mode"), "gamma": health.get("gamma"), "replicas": cfg.deployment.num_replicas,
               "device": health.get("device"), "sps_table": health.get("sps_table"),
               "api_key_required": bool(_api_key(cfg)), "detached": args.detach}
    print(f"[serve] {summary['model']} ready at {summary['openai_base_url']} (scheduler {summary['scheduler']}, "
          f"device {summary['device']})", file=sys.stderr)
    print(json.dumps(summary), flush=True)
    if args.detach:
        return 0
    try:
        block_until_signal()
    finally:
        print("[serve] shutting down", file=sys.stderr)
        serve.delete(cfg.deployment.name)
        serve.shutdown()
    return 0


def _api_key(cfg: ServeConfig) -> str | None:
    import os

    return os.environ.get(cfg.api.api_key_env) or None


if __name__ == "__main__":
    sys.exit(main())
