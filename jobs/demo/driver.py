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

Profiles: `smoke` (tiny target, a few minutes; CI), `default` (smollm2-135m, ~25 min on 2 cores),
`full` (also trains DFlash and Eagle3 with the same budget and prints the comparison table).

Profiles live in configs/demo/<name>.yaml. The stage runner (markers, job submission) is
jobs/demo/runner.py, the five stages jobs/demo/stages.py. Rerunning reuses finished stages.
Outputs live under s3://dspark/demo/<profile>/ (rollouts/<key>, checkpoints/, eval/<key>, ...).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from dspark.eval import report
from dspark.io.tracking.lineage import write_runtime_env
from dspark.settings import settings
from jobs.demo.runner import (JOB_PREFIX, PROFILES, REPO, RUNTIME_ENV, SERVE_PORT, Demo, DemoError, banner,
                              endpoint_url, fmt_s, machine_profile)
from jobs.demo.stages import calibrate_stage, evaluate_stage, generate_stage, serve_stage, train_stage

CHAT_PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Write a Python function is_prime(n) that returns True when n is a prime number.",
    "Give me three tips for staying focused while working from home.",
]
STEPS = ("generate", "train", "calibrate", "evaluate", "serve", "chat")


def check_disk(demo: Demo) -> None:
    from dspark.models.builtin import cache_root

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
           f"{', '.join(demo.profile.algos)}, budget {demo.profile.description}")
    if not (REPO / RUNTIME_ENV).exists():
        raise DemoError(f"{RUNTIME_ENV} is missing; run the demo from a complete checkout of the repository")
    if shutil.which("ray", path=str(Path(sys.executable).parent)) is None:
        raise DemoError(f"the `ray` CLI is not next to {sys.executable}; install the project "
                        f"(`make venv`, or `pip install -e .` in your venv) and rerun")
    check_disk(demo)
    write_runtime_env(REPO / RUNTIME_ENV, demo.runtime_env_file)
    report = check_stack_state(cfg)
    for service, info in report.items():
        state = "healthy" if info["healthy"] else ("stale pid file" if info["stale_pid_file"] else "not running")
        print(f"  {service:7s} {state:15s} {info['url']}")
    print("  checks passed", flush=True)
    return report


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
    from dspark.models.builtin import cache_root, prepare

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


def chat(demo: Demo) -> list[dict]:
    from openai import OpenAI

    banner(f"chat through the endpoint with the openai client ({endpoint_url()}/v1)")
    start = time.monotonic()
    client = OpenAI(base_url=endpoint_url() + "/v1", api_key=settings().api_key or "not-needed",
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


def build_summary(demo: Demo, trained: dict, evaluation: dict, chats: list[dict]) -> dict:
    taus, speedups = report.eval_tables(evaluation.get("results", {}))
    ratios = report.ratio_table(evaluation.get("results", {}))
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
        "next_step": next_step_text(demo.profile.target),
    }


def next_step_text(target: str) -> str:
    """Where the committed learning curve says to go next (jobs.demo.next_steps.demo_next_steps)."""
    from jobs.demo.next_steps import demo_next_steps

    return demo_next_steps(REPO, target)


def print_section(text: str) -> None:
    if text:
        print(f"\n{text}")


def print_summary(summary: dict, path: Path) -> None:
    banner(f"done — profile {summary['profile']} on target {summary['target']} in {fmt_s(summary['total_wall_s'])}")
    print_section(report.text_table("tau (accepted drafts + 1 per verify round) per benchmark:", summary["tau"]))
    print_section(report.text_table("speedup over target-only decoding (same prompts, same machine):", summary["speedup"]))
    if len(summary["tau"]) > 1:
        print_section(report.text_table("comparison: tau ratios between drafters (same data, same budget):", summary["tau_ratios"]))
    print(f"\nrollouts:        {summary['rollouts']}")
    for algo, uri in summary["checkpoints"].items():
        print(f"checkpoints:     {uri}   (drafter {summary['drafters'][algo]})")
    print(f"calibrated:      {summary['calibrated_drafter']}")
    print(f"eval results:    {summary['results']}")
    print(f"MLflow UI:       {summary['mlflow_ui']}   (experiment {summary['mlflow_experiment']})")
    print(f"Ray dashboard:   {summary['ray_dashboard']}")
    print(f"endpoint:        {summary['endpoint']}   (OpenAI-compatible; try the openai client)")
    print(f"stop everything: {summary['stop']}")
    print(f"\n{summary['next_step']}")
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


class StopHere(Exception):
    """Raised after the step named by --until."""


def run(profile, until: str = "chat") -> dict:
    from dspark.devstack import stack

    def done(step: str) -> None:
        if step == until:
            raise StopHere

    cfg = stack.StackConfig.from_env()
    profile = machine_profile(profile)
    demo = Demo(profile=profile, state_dir=cfg.state_dir)
    try:
        report = preflight(demo, cfg)
        stack_up(demo, cfg, was_healthy=all(info["healthy"] for info in report.values()))
        stop_leftover_jobs(demo)
        prepare_target(demo)
        gen = generate_stage(demo)
        done("generate")
        trained = {algo: train_stage(demo, algo, gen["key"], gen["outputs"]["rollouts"]) for algo in profile.algos}
        done("train")
        served = profile.algos[0]
        cal = calibrate_stage(demo, trained[served]["outputs"]["drafter"], trained[served]["key"], gen["outputs"]["rollouts"])
        done("calibrate")
        drafters = {served: cal["outputs"]["drafter"]}  # the calibrated one, then the baselines as trained
        drafters |= {a: trained[a]["outputs"]["drafter"] for a in profile.algos[1:]}
        evaluation = evaluate_stage(demo, drafters, [cal["key"], *(trained[a]["key"] for a in profile.algos[1:])])
        done("evaluate")
        serve_stage(demo, cal["outputs"]["drafter"], cal["key"])
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
    ap = argparse.ArgumentParser(prog="python -m jobs.demo",
                                 description="Run the whole dspark lifecycle on the local stack as Ray jobs.")
    ap.add_argument("--profile", choices=sorted(PROFILES), default="default",
                    help="smoke: tiny target, minutes (CI); default: smollm2-135m, ~25 min; full: + DFlash, Eagle3")
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
