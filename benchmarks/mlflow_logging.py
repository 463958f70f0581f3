"""MLflow metric logging from a training step loop: what a log call costs the step, and what a hung
tracking server costs at exit. Three ways: `sync` (MlflowClient.log_batch, waiting), `queue` (dspark's
bounded background queue, dspark.io.tracking.log_metrics) and `async` (MLflow's own async logging,
log_batch(..., synchronous=False)). The reason dspark keeps its queue (dspark.io.tracking.background_logger).

    python benchmarks/mlflow_logging.py                 # 1000 calls to a local SQLite store, 100 pending on a hung server
    python benchmarks/mlflow_logging.py --calls 200 --pending 30

Every case runs in its own process. Live store: `--calls` step-loop calls of 5 metrics each; per-call
time, time to drain what was queued, points stored. Hung server (a port that accepts connections and
never answers; MLFLOW_HTTP_REQUEST_TIMEOUT=3 s, DSPARK_MLFLOW_FLUSH_TIMEOUT_S=1): `--pending` calls,
then a normal exit; the seconds from the script's last line to the end of the process, and the peak
memory the pending calls added. Last stdout line: JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HTTP_TIMEOUT_S = "3"


def child(mode: str, uri: str, calls: int, live: bool) -> None:
    """One case: log `calls` steps in `mode`, print a JSON line, then exit normally."""
    from dspark.io import tracking
    from dspark.io.tracking import store as tracking_store

    mlflow = tracking.mlflow_module()
    client = mlflow.MlflowClient(uri)
    run_id = client.create_run(tracking_store.ensure_experiment(client, "bench")).info.run_id if live else "0" * 32
    tracking.attach_run(run_id)
    rss0, ops = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, []
    started = time.perf_counter()
    for step in range(calls):
        values = {f"m{i}": step * 0.1 + i for i in range(5)}
        if mode == "queue":
            tracking.log_metrics(values, step=step)
        else:
            now = int(time.time() * 1000)
            metrics = [mlflow.entities.Metric(k, v, now, step) for k, v in values.items()]
            ops.append(client.log_batch(run_id, metrics=metrics, synchronous=mode == "sync"))
    loop_s = time.perf_counter() - started
    result = {"mode": mode, "calls": calls, "per_call_ms": round(loop_s / calls * 1000, 3),
              "added_mb": round((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024, 1)}
    if live:
        started = time.perf_counter()
        if mode == "queue":
            tracking.flush(600)
        for op in ops:
            if op is not None:  # (sync: None)
                op.wait()
        result |= {"drain_s": round(time.perf_counter() - started, 2),
                   "points": len(client.get_metric_history(run_id, "m0"))}
    print(json.dumps(result | {"ended_at": time.time()}), flush=True)


def run_case(mode: str, uri: str, calls: int, live: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "MLFLOW_TRACKING_URI": uri, "MLFLOW_HTTP_REQUEST_TIMEOUT": HTTP_TIMEOUT_S,
           "DSPARK_MLFLOW_FLUSH_TIMEOUT_S": "1", "DSPARK_STATE_DIR": tempfile.mkdtemp()}
    args = [sys.executable, __file__, "--child", mode, uri, str(calls), "live" if live else "hung"]
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=3600)
    ended = time.time()
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{mode} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    result = json.loads(lines[-1])
    result["exit_s"] = round(ended - result.pop("ended_at"), 1)  # includes interpreter teardown
    print(json.dumps(result), flush=True)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000, help="step-loop calls against the live store")
    parser.add_argument("--pending", type=int, default=100, help="calls left pending on the hung server")
    args = parser.parse_args(argv)
    report: dict = {"http_timeout_s": float(HTTP_TIMEOUT_S)}
    with tempfile.TemporaryDirectory() as tmp:
        store = f"sqlite:///{tmp}/mlflow.db"
        report["live_sqlite"] = [run_case(mode, store, args.calls, live=True) for mode in ("sync", "queue", "async")]
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(4096)
        uri = f"http://127.0.0.1:{hung.getsockname()[1]}"
        report["hung_server"] = [run_case(mode, uri, args.pending, live=False) for mode in ("queue", "async")]
    print(json.dumps(report))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5] == "live")
    else:
        main()
