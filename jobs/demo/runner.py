"""The demo's stage runner: profiles (configs/demo/<name>.yaml), the run context, and one stage =
one `ray job submit` of `python -m jobs.<stage>`, skipped when its marker says it already finished.

Rerunning reuses finished stages: each stage's key hashes its module, config file, overrides and
the keys of the stages it consumes; a stage whose marker (s3://dspark/demo/<profile>/stages/<id>.json)
holds the same key and whose output still exists is skipped.
"""
from __future__ import annotations

import hashlib
import json
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import Field

from dspark.config import StrictModel, load_config
from dspark.devstack.processes import last_json_object
from dspark.io.http import http_ok

REPO = Path(__file__).resolve().parents[2]
PROFILE_DIR = REPO / "configs" / "demo"
RUNTIME_ENV = "infra/runtime_env.yaml"
BUCKET_ROOT = "s3://dspark/demo"
SERVE_HOST, SERVE_PORT = "127.0.0.1", 8000
JOB_PREFIX = "demo-"
STAGES = ("generate", "train", "calibrate", "evaluate", "serve")

# Config file of each stage ({target}, {algo} filled in).
STAGE_CONFIG = {
    "generate": "configs/generate/{target}.yaml",
    "train": "configs/train/{target}-{algo}.yaml",
    "calibrate": "configs/calibrate/{target}.yaml",
    "evaluate": "configs/evaluate/{target}.yaml",
    "serve": "configs/serve/{target}.yaml",
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


class SlowCpuBudget(StrictModel):
    """A profile's budget on a CPU that computes bf16 only by emulation (AVX2, no avx512_bf16/AMX): every
    `auto` dtype resolves to float32 there, and the target's rollouts and frozen training forward run
    several times slower than on a CPU with native bf16, so the same budget would overrun its time."""

    description: str = Field(description="expected wall time on such a CPU, printed before the run")
    overrides: dict[str, list[str]] = Field(default_factory=dict, description=(
        "per-stage overrides applied after the profile's own (a later `--set` of the same key wins)"))


class Profile(StrictModel):
    """One demo profile (configs/demo/<name>.yaml)."""

    name: str = Field("", description="profile name (the file's stem; filled in when loaded)")
    description: str = Field(description="expected wall time, printed before the run")
    target: str = Field(description="target model spec (load_target), also the {target} of the stage configs")
    algos: list[str] = Field(min_length=1, description="drafters trained; the first is calibrated and served")
    min_free_gb: float = Field(gt=0, description="free disk needed in the state dir and in the model cache")
    chat_max_tokens: int = Field(ge=1, description="max_tokens of each chat request at the end")
    overrides: dict[str, list[str]] = Field(default_factory=dict, description=(
        "budget overrides per stage (`key.path=value`); part of each stage's key: changing them reruns it"))

    no_native_bf16: SlowCpuBudget | None = Field(None, description=(
        "the budget used instead where the machine's CPU has no native bf16 (see SlowCpuBudget); "
        "none: the same budget everywhere"))

    def budget(self, stage: str) -> list[str]:
        return list(self.overrides.get(stage, []))

    def for_this_machine(self, native_bf16: bool) -> "Profile":
        """The profile as this machine runs it: with `no_native_bf16`'s budget where bf16 is emulated."""
        slow = self.no_native_bf16
        if native_bf16 or slow is None:
            return self
        stages = set(self.overrides) | set(slow.overrides)
        merged = {s: self.budget(s) + list(slow.overrides.get(s, [])) for s in stages}
        return self.model_copy(update={"description": slow.description, "overrides": merged, "no_native_bf16": None})


def machine_profile(profile):
    """The profile's budget for this machine's CPU (the demo's stages run on it): the smaller one where
    bf16 is only emulated, said so before anything runs."""
    from dspark.models.precision import bf16_is_native

    native = bf16_is_native("cpu")
    chosen = profile.for_this_machine(native)
    if chosen is not profile:
        print(f"this CPU has no native bf16 (no avx512_bf16/AMX): the target runs in float32, so the "
              f"{profile.name} profile uses its smaller budget for such CPUs ({chosen.description})", flush=True)
    return chosen


def load_profiles(directory: Path = PROFILE_DIR) -> dict[str, Profile]:
    profiles = {}
    for path in sorted(directory.glob("*.yaml")):
        profile = load_config(Profile, path, [])
        profiles[path.stem] = profile.model_copy(update={"name": path.stem})
        slow_cpu = profile.no_native_bf16.overrides if profile.no_native_bf16 else {}
        unknown = (set(profile.overrides) | set(slow_cpu)) - set(STAGES)
        if unknown:
            raise ValueError(f"{path}: overrides for unknown stages {sorted(unknown)}; stages are {list(STAGES)}")
    return profiles


PROFILES = load_profiles()


class DemoError(RuntimeError):
    """A demo step failed; the message says what happened and how to recover."""


def banner(text: str) -> None:
    print(f"\n{'=' * 100}\n== {text}\n{'=' * 100}", flush=True)


def sha(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def fill(templates: list[str], values: dict[str, str]) -> list[str]:
    return [t.format(**values) for t in templates]


def fmt_s(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{seconds:.1f}s"


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


def endpoint_url() -> str:
    return f"http://{SERVE_HOST}:{SERVE_PORT}"


def endpoint_healthy(timeout: float = 3.0) -> bool:
    return http_ok(endpoint_url() + "/healthz", timeout=timeout)


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
        raise DemoError(f"stage config {config} does not exist; this checkout is incomplete (git pull) or a "
                        f"profile in configs/demo/ names a config that was renamed")
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
    summary = last_json_object(output.splitlines())[0]
    marker = {"key": key, "stage": stage_id, "command": printable, "submission_id": submission_id,
              "wall_s": wall_s, "summary": summary, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    storage.write_text(demo.marker_uri(stage_id), json.dumps(marker, indent=2, default=str))
    print(f"\n  {stage_id} finished in {fmt_s(wall_s)}", flush=True)
    return demo.record(stage_id, status="ran", wall_s=wall_s, key=key, command=printable, summary=summary,
                       submission_id=submission_id)
