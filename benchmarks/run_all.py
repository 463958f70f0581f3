"""Run every benchmark script in benchmarks/ and collect their results into one JSON report.

    python benchmarks/run_all.py                 # full settings, report in benchmarks/report.json
    python benchmarks/run_all.py --quick         # small settings (minutes), e.g. to check they all run
    python benchmarks/run_all.py --only decode_speed,serve_load --out /tmp/report.json

Each benchmark is a standalone script whose last stdout line is one JSON object. Scripts run one
after another (they measure speed, so never in parallel), with the arguments from `SCRIPT_ARGS`
below; their output streams through. A script that fails, times out or prints no JSON is recorded
as a failure with the tail of its output, and the runner carries on. The report is rewritten after
every script, so an interrupted run keeps what finished. Exit status: 0 if all succeeded, else 1.
Helper modules (names starting with `_`) and this file are not benchmarks.
"""
from __future__ import annotations

import argparse
import collections
import datetime as dt
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from dspark.devstack.processes import last_json_object

REPO_ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = Path(__file__).resolve().parent
TAIL_LINES = 400  # output lines kept to find the JSON result
REPORT_TAIL_LINES = 40  # of which a failed script's report shows the last


@dataclass(frozen=True)
class ScriptArgs:
    full: list[str] = field(default_factory=list)    # the measured settings quoted in README
    quick: list[str] = field(default_factory=list)   # small settings: each script in a few minutes


# Per-script arguments; a script not listed runs with no arguments. Keep in step with each
# script's argparse options (the scripts' owners document them in their module docstrings).
# Full settings use the smollm2-135m drafters registered by `python -m jobs.demo --profile full` (or
# the configs/train/smollm2-135m-*.yaml runs), found through MLflow (the stack's .dspark/env.sh).
TRAINED = [arg for algo in ("dspark", "dflash", "eagle3")
           for arg in ("--drafter", f"models:/smollm2-135m-{algo}-drafter@champion")]
SCRIPT_ARGS: dict[str, ScriptArgs] = {
    "decode_speed": ScriptArgs(full=["--target", "smollm2-135m", *TRAINED, "--prompts", "3",
                                     "--max-new-tokens", "128"],
                               quick=["--quick"]),
    "rollout_throughput": ScriptArgs(full=[],  # smollm2-135m, 64 prompts x 128 tokens: sequential, HF batched, engine
                                     quick=["--target", "tiny", "--num-prompts", "8", "--max-new-tokens", "16"]),
    "train_throughput": ScriptArgs(full=[], quick=["--quick"]),  # smollm2-135m, ZeRO 0/2/3, 2 CPU workers
    "serve_load": ScriptArgs(full=[], quick=["--quick"]),  # smollm2-135m + its trained DSpark drafter
    "decode_core": ScriptArgs(full=[],  # smollm2-135m + the committed CPU drafter, eager vs compiled vs dynamic
                              quick=["--target", "tiny", "--drafter", "untrained", "--prompts", "1",
                                     "--max-new-tokens", "16", "--rollout-rows", "4", "--out", "/dev/null"]),
    "engine_core": ScriptArgs(full=[],  # the serving engine on the core (eager) vs the ragged store, c = 1/4/16
                              quick=["--target", "tiny", "--drafter", "untrained", "--concurrency", "1,4",
                                     "--max-new-tokens", "8", "--rounds", "1", "--out", "/dev/null"]),
    "train_step": ScriptArgs(full=["--baseline", "01b9160"],  # the lean step (2026-12-06) against the step before it
                             quick=["--baseline", "HEAD", "--target", "tiny", "--steps", "1", "--rounds", "1",
                                    "--out", "/dev/null"]),
    "accept_rows": ScriptArgs(full=[], quick=["--rows", "1,8", "--repeats", "3"]),  # the rejection step, batched
    "mlflow_logging": ScriptArgs(full=[], quick=["--calls", "200", "--pending", "20"]),  # SQLite store + a hung port
}


STACK_VARS = ("MLFLOW_TRACKING_URI", "MLFLOW_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID",
              "AWS_SECRET_ACCESS_KEY", "AWS_REGION")


def stack_env() -> dict[str, str]:
    """MLflow + S3 variables of the local stack (to resolve models:/ drafters), only when the stack is
    up and healthy and the caller set no tracking URI. Ray variables are left out: benchmarks start
    their own Ray unless the caller exports RAY_ADDRESS."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return {}
    try:
        from dspark.devstack import stack

        cfg = stack.StackConfig.from_env()
        if not all(info["healthy"] for name, info in stack.status(cfg).items() if name in ("s3", "mlflow")):
            return {}
        return {k: v for k, v in stack.load_env(cfg.state_dir).items() if k in STACK_VARS}
    except Exception:  # noqa: BLE001 — no stack: scripts that need one record their own failure
        return {}


def discover(bench_dir: Path) -> list[Path]:
    """Benchmark scripts in `bench_dir`, sorted by name (helpers `_*.py` and this runner excluded)."""
    return sorted(p for p in bench_dir.glob("*.py")
                  if not p.name.startswith("_") and p.name != Path(__file__).name)


def _pump(stream, tail: collections.deque) -> None:
    """Copy a child's output to our stdout line by line, keeping the last lines."""
    for line in stream:
        sys.stdout.write(line)
        sys.stdout.flush()
        tail.append(line.rstrip("\n"))


def run_script(script: Path, args: list[str], timeout_s: float) -> dict:
    """Run one script (output streamed through), return its report record."""
    cmd = [sys.executable, str(script), *args]
    print(f"\n=== {script.stem}: {' '.join(cmd)}", flush=True)
    pythonpath = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    env = {**stack_env(), **os.environ, "PYTHONPATH": pythonpath, "PYTHONUNBUFFERED": "1"}
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1, start_new_session=True)
    pump = threading.Thread(target=_pump, args=(proc.stdout, tail), daemon=True)
    pump.start()
    timed_out = False
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: takes its children (Ray, servers) too
        rc = proc.wait()
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait()
        raise
    pump.join(timeout=10)
    wall_s = round(time.monotonic() - start, 1)
    record = {"script": script.name, "command": cmd[1:], "returncode": rc, "wall_s": wall_s}
    result, json_last = last_json_object(list(tail))
    if timed_out:
        record.update(ok=False, error=f"timed out after {timeout_s:.0f} s")
    elif rc != 0:
        record.update(ok=False, error=f"exited with status {rc}")
    elif result is None:
        record.update(ok=False, error="no output line is a JSON object (the last line must be one)")
    else:
        record.update(ok=True, result=result)
        if not json_last:
            record["note"] = "the JSON line was followed by other output (e.g. Ray worker logs)"
    if not record["ok"]:
        record["output_tail"] = list(tail)[-REPORT_TAIL_LINES:]
    print(f"=== {script.stem}: {'ok' if record['ok'] else 'FAILED: ' + record['error']} ({wall_s} s)", flush=True)
    return record


def machine_info() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        pass
    return info


def write_report(report: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(out)  # atomic: a reader never sees half a report


def select(scripts: list[Path], only: str | None, skip: str | None) -> list[Path]:
    names = {p.stem for p in scripts}
    wanted = set(filter(None, (only or "").split(","))) or names
    unwanted = set(filter(None, (skip or "").split(",")))
    unknown = (wanted | unwanted) - names
    if unknown:
        raise SystemExit(f"error: unknown benchmark(s) {sorted(unknown)}; available: {sorted(names)}")
    return [p for p in scripts if p.stem in wanted - unwanted]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small settings for every script")
    ap.add_argument("--out", type=Path, default=BENCH_DIR / "report.json", help="report file (JSON)")
    ap.add_argument("--only", help="comma-separated script names (without .py) to run")
    ap.add_argument("--skip", help="comma-separated script names to skip")
    ap.add_argument("--timeout", type=float, default=3 * 3600, help="per-script limit in seconds")
    ap.add_argument("--bench-dir", type=Path, default=BENCH_DIR, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    scripts = select(discover(opts.bench_dir), opts.only, opts.skip)
    if not scripts:
        raise SystemExit(f"error: no benchmark scripts in {opts.bench_dir}")
    report = {"created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "quick": opts.quick, "machine": machine_info(), "results": {}, "failed": []}
    for script in scripts:
        settings = SCRIPT_ARGS.get(script.stem, ScriptArgs())
        record = run_script(script, settings.quick if opts.quick else settings.full, opts.timeout)
        report["results"][script.stem] = record
        if not record["ok"]:
            report["failed"].append(script.stem)
        write_report(report, opts.out)
    done = len(scripts) - len(report["failed"])
    print(f"\n{done}/{len(scripts)} benchmarks succeeded; report: {opts.out}"
          + (f"; failed: {', '.join(report['failed'])}" if report["failed"] else ""))
    return 0 if not report["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
