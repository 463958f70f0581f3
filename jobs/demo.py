"""The whole lifecycle in one command, on the embedded local stack.

    python -m jobs.demo --profile smoke|default|full        (`make demo` runs the default profile)

1. checks: free disk, busy ports, stack state (each failure says how to recover);
2. `dspark stack up` (S3 + MLflow + Ray head on 127.0.0.1) and the target model (`tiny` for smoke,
   `smollm2-135m` otherwise) prepared in the model cache;
3. every stage submitted AS A RAY JOB to the local head, exactly as on a cluster:
       ray job submit --runtime-env infra/runtime_env.yaml --working-dir . -- python -m jobs.<stage> ...
   generate rollouts -> train drafter(s) -> calibrate -> evaluate vs target-only -> deploy the Serve
   endpoint; each command is printed before it runs and its logs stream through;
4. a few chat requests through the `openai` client, then a summary (tau per benchmark, speedup,
   bucket locations, MLflow link, endpoint, how to stop) also written to .dspark/demo/summary.json.

Profiles: `smoke` (tiny target, a few minutes; CI), `default` (smollm2-135m, ~20 min on 2 cores),
`full` (also trains DFlash and Eagle3 with the same budget and prints the comparison table).

Rerunning reuses finished stages: each stage's key hashes its module, config file, overrides and
the keys of the stages it consumes; a stage whose marker (s3://dspark/demo/<profile>/stages/<id>.json)
holds the same key and whose output still exists is skipped. Outputs live under
s3://dspark/demo/<profile>/ (rollouts/<key>, checkpoints/, eval/<key>, ...).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RUNTIME_ENV = "infra/runtime_env.yaml"
BUCKET_ROOT = "s3://dspark/demo"
SERVE_HOST, SERVE_PORT = "127.0.0.1", 8000
JOB_PREFIX = "demo-"


# ----------------------------------------------------------------------------- profiles & stage table
@dataclass(frozen=True)
class Profile:
    name: str
    target: str
    algos: tuple[str, ...]  # drafters trained (the first is the one calibrated and served)
    min_free_gb: float  # free disk needed in the repo's state dir and in the model cache
    budget: str
    chat_max_tokens: int


PROFILES = {
    "smoke": Profile("smoke", "tiny", ("dspark",), 2.0, "a few minutes", 24),
    "default": Profile("default", "smollm2-135m", ("dspark",), 5.0, "about 20 minutes on 2 CPU cores", 64),
    "full": Profile("full", "smollm2-135m", ("dspark", "dflash", "eagle3"), 6.0,
                    "about 45 minutes on 2 CPU cores", 64),
}

# Config file of each stage ({target}, {algo} filled in).
STAGE_CONFIG = {
    "generate": "configs/generate/{target}.yaml",
    "train": "configs/train/{target}-{algo}.yaml",
    "calibrate": "configs/calibrate/{target}.yaml",
    "evaluate": "configs/eval/{target}.yaml",
    "serve": "configs/serve/{target}.yaml",
}

# Budget overrides per stage and profile (part of each stage's key: changing them reruns the stage).
# smoke: the tiny configs as they are. default/full: the smollm2-135m configs cut to fit ~20 minutes
# on 2 CPU cores (full trains three drafters with the same budget each).
_SMOL_TRAIN = ["optim.max_steps=60"]
_SMOL_CALIBRATE = ["data.max_prompts=16", "decode.max_new_tokens=64"]
_SMOL_EVAL = ["max_prompts_per_benchmark=3", "decode.max_new_tokens=64", "threshold_sweep.enabled=false"]
_SMOL_SERVE = ["deployment.num_cpus=1", "deployment.torch_threads=2"]  # leave a CPU for later Ray jobs
STAGE_BUDGET: dict[str, dict[str, list[str]]] = {
    "generate": {"smoke": [], "default": [], "full": []},
    "train": {"smoke": [], "default": _SMOL_TRAIN, "full": _SMOL_TRAIN},
    "calibrate": {"smoke": [], "default": _SMOL_CALIBRATE, "full": _SMOL_CALIBRATE},
    "evaluate": {"smoke": [], "default": _SMOL_EVAL, "full": _SMOL_EVAL},
    "serve": {"smoke": [], "default": _SMOL_SERVE, "full": _SMOL_SERVE},
}

# Wiring overrides: where each stage reads and writes (placeholders filled at run time). They follow
# from the keys, so they are not hashed themselves.
STAGE_WIRING: dict[str, list[str]] = {
    "generate": ["output={rollouts}", "tracking.experiment={experiment}", "tracking.run_name={run_name}"],
    "train": ["run_name={run_name}", "data.rollouts={rollouts}", "checkpoint.storage_path={checkpoints}",
              "tracking.experiment={experiment}", "tracking.alias={alias}"],
    "calibrate": ["drafter={drafter}", "data.rollouts={rollouts}", "output={calibrated}",
                  "tracking.experiment={experiment}", "tracking.run_name={run_name}"],
    "evaluate": ["drafters={drafters}", "output={eval_dir}", "tracking.experiment={experiment}",
                 "tracking.run_name={run_name}"],
    "serve": ["model.drafter={drafter}", "http.host={serve_host}", "http.port={serve_port}"],
}

# Flags given to a stage's module besides --config/--set (the Serve job must exit and leave the app).
STAGE_FLAGS: dict[str, list[str]] = {"serve": ["--detach"]}

CHAT_PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Write a Python function is_prime(n) that returns True when n is a prime number.",
    "Give me three tips for staying focused while working from home.",
]


class DemoError(RuntimeError):
    """A demo step failed; the message says what happened and how to recover."""


# ----------------------------------------------------------------------------- small helpers
def banner(text: str) -> None:
    print(f"\n{'=' * 100}\n== {text}\n{'=' * 100}", flush=True)


def sha(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def fill(templates: list[str], values: dict[str, str]) -> list[str]:
    return [t.format(**values) for t in templates]


def last_json_object(text: str) -> dict | None:
    """The last line of `text` that parses as a JSON object (jobs print their summary last)."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict):
                return value
    return None


def fmt_s(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{seconds:.1f}s"


# ----------------------------------------------------------------------------- the run context
@dataclass
class Demo:
    profile: Profile
    state_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    stages: dict[str, dict] = field(default_factory=dict)  # stage id -> {status, wall_s, command, key, outputs}
    started: float = field(default_factory=time.monotonic)

    @property
    def out(self) -> str:
        return f"{BUCKET_ROOT}/{self.profile.name}"

    @property
    def local_dir(self) -> Path:
        return self.state_dir / "demo" / self.profile.name

    @property
    def runtime_env_file(self) -> Path:
        """infra/runtime_env.yaml plus DSPARK_GIT_COMMIT (the upload has no .git), written by preflight."""
        return self.local_dir / "runtime_env.yaml"

    @property
    def experiment(self) -> str:
        return f"dspark-demo-{self.profile.name}"

    def marker_uri(self, stage_id: str) -> str:
        return f"{self.out}/stages/{stage_id}.json"

    def record(self, stage_id: str, **info) -> dict:
        self.stages.setdefault(stage_id, {}).update(info)
        return self.stages[stage_id]


# ----------------------------------------------------------------------------- 1. checks
def check_disk(demo: Demo) -> None:
    from dspark.models_builtin import cache_root

    for where in {demo.state_dir.parent, cache_root()}:
        probe = next((p for p in [where, *where.parents] if p.exists()), Path("/"))
        free_gb = shutil.disk_usage(probe).free / 2**30
        if free_gb < demo.profile.min_free_gb:
            raise DemoError(f"only {free_gb:.1f} GiB free at {probe}; the {demo.profile.name} profile needs "
                            f"{demo.profile.min_free_gb:.0f} GiB. Free some space (e.g. `dspark stack down` and "
                            f"delete {demo.state_dir}/s3, or old models in {cache_root()}), then rerun")


def check_stack_state(cfg) -> dict:
    """Refuse a stack that is up but unhealthy, and busy ports for services that are down."""
    from dspark.devstack import stack

    report = stack.status(cfg)
    for service, info in report.items():
        if info["running"] and not info["healthy"]:
            raise DemoError(f"the local stack is in a bad state: {service} (pid {info['pid']}) runs but does not "
                            f"answer at {info['url']}. Run `dspark stack down`, then rerun the demo")
        if not info["running"]:
            for role, port in cfg.service_ports(service).items():
                if not stack.port_is_free(port):
                    raise DemoError(f"port {port} ({service} {role}) is in use by {stack.port_owner(port)}, so the "
                                    f"stack cannot start. If it is a leftover dspark stack, run `dspark stack down`; "
                                    f"otherwise stop that process. Then rerun the demo")
    if not report["ray"]["running"] and not stack.port_is_free(SERVE_PORT):
        raise DemoError(f"port {SERVE_PORT} (the Serve endpoint) is in use by {stack.port_owner(SERVE_PORT)}; stop "
                        f"that process (or `dspark stack down` if it is an old demo endpoint), then rerun")
    return report


def preflight(demo: Demo, cfg) -> dict:
    banner(f"checks — profile {demo.profile.name!r}: target {demo.profile.target}, drafters "
           f"{', '.join(demo.profile.algos)}, budget {demo.profile.budget}")
    if not (REPO / RUNTIME_ENV).exists():
        raise DemoError(f"{RUNTIME_ENV} is missing; run the demo from a complete checkout of the repository")
    if shutil.which("ray", path=str(Path(sys.executable).parent)) is None:
        raise DemoError(f"the `ray` CLI is not next to {sys.executable}; install the project "
                        f"(`make venv`, or `pip install -e .` in your venv) and rerun")
    check_disk(demo)
    from dspark.io.lineage import write_runtime_env

    write_runtime_env(REPO / RUNTIME_ENV, demo.runtime_env_file)
    report = check_stack_state(cfg)
    for service, info in report.items():
        state = "healthy" if info["healthy"] else ("stale pid file" if info["stale_pid_file"] else "not running")
        print(f"  {service:7s} {state:15s} {info['url']}")
    print("  checks passed", flush=True)
    return report


# ----------------------------------------------------------------------------- 2. stack and target
def stack_up(demo: Demo, cfg, was_healthy: bool) -> None:
    from dspark.devstack import stack

    banner("dspark stack up — S3 (SeaweedFS), MLflow, Ray head on 127.0.0.1")
    start = time.monotonic()
    try:
        demo.env = stack.up(cfg, say=lambda line: print("  " + line, flush=True))
    except stack.StackError as err:
        raise DemoError(f"{err}. To recover: `dspark stack down`, then rerun the demo") from None
    os.environ.update(demo.env)
    demo.record("stack", status="reused" if was_healthy else "ran", wall_s=time.monotonic() - start,
                command="dspark stack up")


def prepare_target(demo: Demo) -> None:
    from dspark.models_builtin import cache_root, prepare

    banner(f"target {demo.profile.target!r} — built/converted once into the model cache")
    start = time.monotonic()
    cached = (cache_root() / "models" / demo.profile.target / "config.json").exists()
    path = prepare(demo.profile.target)
    print(f"  {demo.profile.target}: {path}{' (cached)' if cached else ''}", flush=True)
    demo.record("target", status="reused" if cached else "ran", wall_s=time.monotonic() - start, path=path)


def stop_leftover_jobs(demo: Demo) -> None:
    """Jobs of an interrupted earlier demo still running would compete for the 2 cores: stop them."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    client = JobSubmissionClient(demo.env["RAY_ADDRESS"])
    for job in client.list_jobs():
        active = job.status in (JobStatus.PENDING, JobStatus.RUNNING)
        if active and (job.submission_id or "").startswith(JOB_PREFIX):
            print(f"  stopping job {job.submission_id} left running by an interrupted demo", flush=True)
            client.stop_job(job.submission_id)


# ----------------------------------------------------------------------------- 3. Ray job stages
def job_command(demo: Demo, submission_id: str, module: str, config: str, overrides: list[str]) -> list[str]:
    """The `ray job submit` command a user would type (python = the one first on the head's PATH)."""
    sets = [arg for item in overrides for arg in ("--set", item)]
    flags = STAGE_FLAGS.get(module.removeprefix("jobs."), [])
    return ["ray", "job", "submit", "--address", demo.env["RAY_ADDRESS"], "--submission-id", submission_id,
            "--runtime-env", str(demo.runtime_env_file), "--working-dir", ".", "--",
            "python", "-m", module, "--config", config, *sets, *flags]


def stream_job(cmd: list[str], submission_id: str, log_path: Path) -> tuple[int, str]:
    """Run `ray job submit` (it streams the job's logs), echo and save the output; Ctrl-C stops the job."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    ray_cli = str(Path(sys.executable).parent / "ray")
    chunks: list[bytes] = []
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([ray_cli, *cmd[1:]], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            while chunk := proc.stdout.read1(65536):
                sys.stdout.buffer.write(chunk)
                sys.stdout.flush()
                log.write(chunk)
                chunks.append(chunk)
            rc = proc.wait()
        except KeyboardInterrupt:
            proc.send_signal(signal.SIGINT)
            print(f"\n  stopping Ray job {submission_id} ...", file=sys.stderr, flush=True)
            try:
                subprocess.run([ray_cli, "job", "stop", submission_id], cwd=REPO, capture_output=True, timeout=60)
            except subprocess.TimeoutExpired:
                print(f"  could not confirm; check `ray job status {submission_id}`", file=sys.stderr)
            raise
    return rc, b"".join(chunks).decode(errors="replace")


def free_endpoint_cpus(demo: Demo) -> None:
    """An endpoint deployed by an earlier demo run holds CPUs the stage jobs need (the local head has
    2): shut Serve down before the first job that runs; the serve stage redeploys it at the end."""
    deployed_file = demo.state_dir / "demo" / "serving.json"
    if not (deployed_file.exists() or endpoint_healthy()):
        return
    print("  stopping the Serve endpoint of an earlier demo run to free its CPUs (redeployed at the end)",
          flush=True)
    serve_cli = str(Path(sys.executable).parent / "serve")
    subprocess.run([serve_cli, "shutdown", "-y", "-a", demo.env["RAY_ADDRESS"]], cwd=REPO, timeout=120,
                   stdout=subprocess.DEVNULL)
    deployed_file.unlink(missing_ok=True)


def stage_key(module: str, config: str, budget: list[str], upstream: list[str]) -> str:
    path = REPO / config
    if not path.exists():
        raise DemoError(f"stage config {config} does not exist; this checkout is incomplete (git pull) or the "
                        f"profile table in jobs/demo.py names a config that was renamed")
    return sha({"module": module, "config": path.read_text(), "budget": budget, "upstream": upstream})[:12]


def read_marker(demo: Demo, stage_id: str) -> dict | None:
    from dspark.io import storage

    uri = demo.marker_uri(stage_id)
    try:
        return json.loads(storage.read_text(uri)) if storage.exists(uri) else None
    except (json.JSONDecodeError, FileNotFoundError):
        return None


def run_job_stage(demo: Demo, stage_id: str, title: str, module: str, config: str, budget: list[str],
                  wiring: list[str], key: str, done_check) -> dict:
    """Submit one stage as a Ray job, unless a marker with the same key says it already finished."""
    from dspark.io import storage

    banner(f"{title}  [{stage_id}, key {key}]")
    marker = read_marker(demo, stage_id)
    if marker and marker.get("key") == key and done_check(marker):
        print(f"  reusing the finished stage (marker {demo.marker_uri(stage_id)}, ran in "
              f"{fmt_s(marker.get('wall_s', 0))}); delete the marker to force a rerun", flush=True)
        return demo.record(stage_id, status="reused", wall_s=0.0, key=key, command=marker.get("command"),
                           summary=marker.get("summary"), outputs=marker.get("outputs", {}))
    if module != "jobs.serve":
        free_endpoint_cpus(demo)
    submission_id = f"{JOB_PREFIX}{demo.profile.name}-{stage_id}-{key[:8]}-{time.strftime('%Y%m%d-%H%M%S')}"
    cmd = job_command(demo, submission_id, module, config, [*budget, *wiring])
    printable = shlex.join(cmd)
    print(f"$ {printable}\n", flush=True)
    start = time.monotonic()
    log_path = demo.local_dir / "logs" / f"{stage_id}.log"
    rc, output = stream_job(cmd, submission_id, log_path)
    wall_s = time.monotonic() - start
    if rc != 0:
        raise DemoError(f"stage {stage_id} failed (ray job {submission_id}, exit {rc}); its log is in {log_path} "
                        f"and `ray job logs {submission_id}`. Fix the cause and rerun the demo: finished stages "
                        f"are reused")
    summary = last_json_object(output)
    marker = {"key": key, "stage": stage_id, "command": printable, "submission_id": submission_id,
              "wall_s": wall_s, "summary": summary, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    storage.write_text(demo.marker_uri(stage_id), json.dumps(marker, indent=2, default=str))
    print(f"\n  {stage_id} finished in {fmt_s(wall_s)}", flush=True)
    return demo.record(stage_id, status="ran", wall_s=wall_s, key=key, command=printable, summary=summary,
                       submission_id=submission_id)


def stage_args(stage: str, demo: Demo, **names) -> tuple[str, list[str]]:
    config = STAGE_CONFIG[stage].format(target=demo.profile.target, **names)
    return config, STAGE_BUDGET[stage][demo.profile.name]


def generate(demo: Demo) -> dict:
    from dspark.io import storage

    config, budget = stage_args("generate", demo)
    key = stage_key("jobs.generate", config, budget, [demo.profile.target])
    rollouts = f"{demo.out}/rollouts/{key}"
    wiring = fill(STAGE_WIRING["generate"], {"rollouts": rollouts, "experiment": demo.experiment,
                                             "run_name": f"generate-demo-{demo.profile.name}-{key[:8]}"})
    done = run_job_stage(demo, "generate", "generate rollouts (Ray Data, target answers the prompts)",
                         "jobs.generate", config, budget, wiring, key,
                         lambda m: bool(storage.list_files(rollouts)))
    done["outputs"] = {"rollouts": rollouts}
    return done


def train(demo: Demo, algo: str, rollouts_key: str, rollouts: str) -> dict:
    config, budget = stage_args("train", demo, algo=algo)
    key = stage_key("jobs.train", config, budget, [rollouts_key])
    names = {"run_name": f"demo-{demo.profile.name}-{algo}-{key[:8]}", "rollouts": rollouts,
             "checkpoints": f"{demo.out}/checkpoints", "experiment": demo.experiment,
             "alias": f"demo-{demo.profile.name}"}
    wiring = fill(STAGE_WIRING["train"], names)
    done = run_job_stage(demo, f"train-{algo}", f"train {algo} (Ray Train + DeepSpeed ZeRO, online target features)",
                         "jobs.train", config, budget, wiring, key, lambda m: registered_version(m) is not None)
    model = registered_version(done)
    if model is None:
        raise DemoError(f"train-{algo} finished without registering a drafter (its last log line is not the "
                        f"summary JSON); see {demo.local_dir / 'logs' / f'train-{algo}.log'}")
    done["outputs"] = {"drafter": model, "checkpoints": f"{names['checkpoints']}/{names['run_name']}"}
    return done


def registered_version(stage: dict) -> str | None:
    """`models:/<name>/<version>` of the drafter a train job registered (from its summary line), if
    that version is still in the model registry."""
    reg = (stage.get("summary") or {}).get("registered_model") or {}
    if not reg.get("name") or not reg.get("version"):
        return None
    try:
        from mlflow import MlflowClient

        MlflowClient().get_model_version(reg["name"], str(reg["version"]))
    except Exception:  # noqa: BLE001 — registry wiped or unreachable: the stage must run again
        return None
    return f"models:/{reg['name']}/{reg['version']}"


def calibrate(demo: Demo, drafter: str, upstream_key: str, rollouts: str) -> dict:
    from dspark.io import storage

    config, budget = stage_args("calibrate", demo)
    key = stage_key("jobs.calibrate", config, budget, [upstream_key])
    output = f"{demo.out}/calibration/{key}"
    calibrated = f"{output}/drafter"  # jobs.calibrate writes the new drafter there (source untouched)
    wiring = fill(STAGE_WIRING["calibrate"], {"drafter": drafter, "rollouts": rollouts, "calibrated": output,
                                              "experiment": demo.experiment,
                                              "run_name": f"calibrate-demo-{demo.profile.name}-{key[:8]}"})
    done = run_job_stage(demo, "calibrate", "calibrate confidences (sequential temperature scaling, held-out rollouts)",
                         "jobs.calibrate", config, budget, wiring, key,
                         lambda m: storage.exists(f"{calibrated}/config.json"))
    done["outputs"] = {"drafter": calibrated, "report": f"{output}/report.md"}
    return done


def evaluate(demo: Demo, drafters: dict[str, str], upstream_keys: list[str]) -> dict:
    from dspark.io import storage

    config, budget = stage_args("evaluate", demo)
    key = stage_key("jobs.evaluate", config, budget, upstream_keys)
    eval_dir = f"{demo.out}/eval/{key}"
    drafter_list = json.dumps([{"name": name, "ref": ref} for name, ref in drafters.items()], separators=(",", ":"))
    wiring = fill(STAGE_WIRING["evaluate"], {"drafters": drafter_list, "eval_dir": eval_dir,
                                             "experiment": demo.experiment,
                                             "run_name": f"evaluate-demo-{demo.profile.name}-{key[:8]}"})
    done = run_job_stage(demo, "evaluate", "evaluate: speculative vs target-only decoding on the benchmarks",
                         "jobs.evaluate", config, budget, wiring, key,
                         lambda m: storage.exists(f"{eval_dir}/results.json"))
    done["outputs"] = {"results": f"{eval_dir}/results.json"}
    done["results"] = json.loads(storage.read_text(f"{eval_dir}/results.json"))
    return done


def endpoint_url() -> str:
    return f"http://{SERVE_HOST}:{SERVE_PORT}"


def endpoint_healthy(timeout: float = 3.0) -> bool:
    try:
        with urllib.request.urlopen(endpoint_url() + "/healthz", timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def serve(demo: Demo, drafter: str, upstream_key: str) -> dict:
    config, budget = stage_args("serve", demo)
    key = stage_key("jobs.serve", config, budget, [upstream_key])
    deployed_file = demo.state_dir / "demo" / "serving.json"  # what the demo last deployed on this head
    wiring = fill(STAGE_WIRING["serve"], {"drafter": drafter, "serve_host": SERVE_HOST, "serve_port": str(SERVE_PORT)})

    def still_serving(_marker) -> bool:
        deployed = json.loads(deployed_file.read_text()) if deployed_file.exists() else {}
        return deployed.get("key") == key and endpoint_healthy()

    done = run_job_stage(demo, "serve", "deploy the Ray Serve endpoint (draft-plus-verify engine, OpenAI API)",
                         "jobs.serve", config, budget, wiring, key, still_serving)
    wait_endpoint(timeout_s=300)
    deployed_file.write_text(json.dumps({"key": key, "profile": demo.profile.name, "drafter": drafter}))
    done["outputs"] = {"endpoint": endpoint_url() + "/v1"}
    return done


def wait_endpoint(timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not endpoint_healthy():
        if time.monotonic() > deadline:
            raise DemoError(f"the Serve endpoint at {endpoint_url()}/healthz did not become healthy within "
                            f"{timeout_s:.0f} s; see `serve status` and the Ray dashboard "
                            f"({os.environ.get('RAY_ADDRESS', '')}), then rerun the demo")
        time.sleep(2)


# ----------------------------------------------------------------------------- 4. chat and summary
def chat(demo: Demo) -> list[dict]:
    from openai import OpenAI

    banner(f"chat through the endpoint with the openai client ({endpoint_url()}/v1)")
    start = time.monotonic()
    client = OpenAI(base_url=endpoint_url() + "/v1", api_key=os.environ.get("DSPARK_API_KEY", "not-needed"),
                    max_retries=2, timeout=600)
    model = client.models.list().data[0].id
    answers = []
    for prompt in CHAT_PROMPTS:
        print(f"\n>>> {prompt}", flush=True)
        resp = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                              max_tokens=demo.profile.chat_max_tokens, temperature=0.0)
        text = resp.choices[0].message.content or ""
        spec = (resp.model_extra or {}).get("spec_decode") or {}
        print(f"<<< {text.strip()}", flush=True)
        print(f"    [{resp.usage.completion_tokens} tokens; spec_decode: {json.dumps(spec)}]", flush=True)
        answers.append({"prompt": prompt, "answer": text, "completion_tokens": resp.usage.completion_tokens,
                        "spec_decode": spec})
    demo.record("chat", status="ran", wall_s=time.monotonic() - start, model=model)
    return answers


def eval_table(results: dict) -> tuple[dict, dict]:
    """(tau[drafter][benchmark], speedup[drafter][benchmark]) from jobs.evaluate's results.json, with
    the macro average over benchmarks as column "mean"."""
    taus: dict[str, dict] = {}
    speedups: dict[str, dict] = {}
    for name, block in (results.get("drafters") or {}).items():
        for bench, metrics in (block.get("per_benchmark") or {}).items():
            taus.setdefault(name, {})[bench] = metrics.get("tau")
            speedups.setdefault(name, {})[bench] = metrics.get("speedup")
        overall = block.get("overall") or {}
        taus.setdefault(name, {})["mean"] = overall.get("tau")
        speedups.setdefault(name, {})["mean"] = overall.get("speedup")
    return taus, speedups


def ratio_table(results: dict) -> dict[str, dict]:
    """tau ratios between drafters (e.g. dspark/dflash) per benchmark, from results.json."""
    table: dict[str, dict] = {}
    for ratio, block in (results.get("ratios") or {}).items():
        row = {bench: values.get("tau") for bench, values in (block.get("per_benchmark") or {}).items()}
        row["mean"] = (block.get("overall") or {}).get("tau")
        table[ratio] = row
    return table


def print_table(title: str, table: dict[str, dict]) -> None:
    names = {b for row in table.values() for b in row}
    benches = sorted(names - {"mean"}) + (["mean"] if "mean" in names else [])
    if not benches:
        return
    print(f"\n{title}")
    print(f"  {'drafter':14s}" + "".join(f"{b:>12s}" for b in benches))
    for name, row in table.items():
        cells = "".join(f"{row[b]:>12.2f}" if isinstance(row.get(b), (int, float)) else f"{'-':>12s}"
                        for b in benches)
        print(f"  {name:14s}{cells}")


def build_summary(demo: Demo, trained: dict, evaluation: dict, chats: list[dict]) -> dict:
    taus, speedups = eval_table(evaluation.get("results", {}))
    ratios = ratio_table(evaluation.get("results", {}))
    mlflow_uri = demo.env.get("MLFLOW_TRACKING_URI", "")
    return {
        "profile": demo.profile.name,
        "target": demo.profile.target,
        "tau": taus,
        "speedup": speedups,
        "tau_ratios": ratios,
        "rollouts": demo.stages["generate"]["outputs"]["rollouts"],
        "checkpoints": {algo: stage["outputs"]["checkpoints"] for algo, stage in trained.items()},
        "drafters": {algo: stage["outputs"]["drafter"] for algo, stage in trained.items()},
        "calibrated_drafter": demo.stages["calibrate"]["outputs"]["drafter"],
        "results": evaluation["outputs"]["results"],
        "mlflow_ui": mlflow_uri,
        "mlflow_experiment": demo.experiment,
        "ray_dashboard": demo.env.get("RAY_ADDRESS", ""),
        "endpoint": endpoint_url() + "/v1",
        "chat": chats,
        "stop": "dspark stack down   (stops the endpoint, Ray, MLflow and S3; data stays in .dspark/)",
        "stages": {sid: {k: v for k, v in info.items() if k in ("status", "wall_s", "command", "key")}
                   for sid, info in demo.stages.items()},
        "total_wall_s": time.monotonic() - demo.started,
    }


def print_summary(summary: dict, path: Path) -> None:
    banner(f"done — profile {summary['profile']} on target {summary['target']} in {fmt_s(summary['total_wall_s'])}")
    print_table("tau (accepted drafts + 1 per verify round) per benchmark:", summary["tau"])
    print_table("speedup over target-only decoding (same prompts, same machine):", summary["speedup"])
    if len(summary["tau"]) > 1:
        print_table("comparison: tau ratios between drafters (same data, same budget):", summary["tau_ratios"])
    print(f"\nrollouts:        {summary['rollouts']}")
    for algo, uri in summary["checkpoints"].items():
        print(f"checkpoints:     {uri}   (drafter {summary['drafters'][algo]})")
    print(f"calibrated:      {summary['calibrated_drafter']}")
    print(f"eval results:    {summary['results']}")
    print(f"MLflow UI:       {summary['mlflow_ui']}   (experiment {summary['mlflow_experiment']})")
    print(f"Ray dashboard:   {summary['ray_dashboard']}")
    print(f"endpoint:        {summary['endpoint']}   (OpenAI-compatible; try the openai client)")
    print(f"stop everything: {summary['stop']}")
    print("\nwall time per stage:")
    for sid, info in summary["stages"].items():
        print(f"  {sid:18s} {fmt_s(info.get('wall_s', 0)):>9s}  {info.get('status', '')}")
    print(f"\nsummary written to {path}", flush=True)


def write_summary(demo: Demo, summary: dict) -> Path:
    path = demo.state_dir / "demo" / "summary.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    (demo.local_dir / "summary.json").parent.mkdir(parents=True, exist_ok=True)
    (demo.local_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return path


# ----------------------------------------------------------------------------- driver
STEPS = ("generate", "train", "calibrate", "evaluate", "serve", "chat")


class StopHere(Exception):
    """Raised after the step named by --until."""


def run(profile: Profile, until: str = "chat") -> dict:
    from dspark.devstack import stack

    def done(step: str) -> None:
        if step == until:
            raise StopHere

    cfg = stack.StackConfig.from_env()
    demo = Demo(profile=profile, state_dir=cfg.state_dir)
    try:
        report = preflight(demo, cfg)
        stack_up(demo, cfg, was_healthy=all(info["healthy"] for info in report.values()))
        stop_leftover_jobs(demo)
        prepare_target(demo)
        gen = generate(demo)
        done("generate")
        trained = {algo: train(demo, algo, gen["key"], gen["outputs"]["rollouts"]) for algo in profile.algos}
        done("train")
        served = profile.algos[0]
        cal = calibrate(demo, trained[served]["outputs"]["drafter"], trained[served]["key"], gen["outputs"]["rollouts"])
        done("calibrate")
        drafters = {served: cal["outputs"]["drafter"]}  # the calibrated one, then the baselines as trained
        drafters |= {a: trained[a]["outputs"]["drafter"] for a in profile.algos[1:]}
        evaluation = evaluate(demo, drafters, [cal["key"], *(trained[a]["key"] for a in profile.algos[1:])])
        done("evaluate")
        serve(demo, cal["outputs"]["drafter"], cal["key"])
        done("serve")
        chats = chat(demo)
    except StopHere:
        banner(f"stopped after {until!r} (--until); wall time per stage:")
        for sid, info in demo.stages.items():
            print(f"  {sid:18s} {fmt_s(info.get('wall_s', 0)):>9s}  {info.get('status', '')}")
        return {"stages": demo.stages}
    summary = build_summary(demo, trained, evaluation, chats)
    path = write_summary(demo, summary)
    print_summary(summary, path)
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Run the whole dspark lifecycle on the local stack as Ray jobs.")
    ap.add_argument("--profile", choices=sorted(PROFILES), default="default",
                    help="smoke: tiny target, minutes (CI); default: smollm2-135m, ~20 min; full: + DFlash, Eagle3")
    ap.add_argument("--until", choices=STEPS, default="chat", help="stop after this step (default: run everything)")
    args = ap.parse_args(argv)
    os.chdir(REPO)  # `--working-dir .` and the config paths are relative to the repo root
    try:
        run(PROFILES[args.profile], args.until)
    except DemoError as err:
        print(f"\nerror: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted: the running stage's Ray job was stopped. Rerun the same command to continue; "
              "finished stages are reused.", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
