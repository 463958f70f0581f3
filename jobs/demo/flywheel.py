"""The drafter flywheel for real on smollm2-135m (README "Keeping a drafter fresh"), with a before/after
plot of acceptance on a shifted domain. One driver over the other jobs' APIs, against the local stack:

    .venv/bin/dspark stack up && source .dspark/env.sh
    python -m jobs.demo.flywheel --config configs/flywheel/smollm2-demo.yaml \
        [--set original_rollouts=/work/learn-runs/cpu/rollouts-train] [--set state_dir=...]

Steps (each skipped when its result is in <out>/state.json, so a stopped run resumes):
  register   the drafter -> registered model `<target>-flywheel`, alias `serving`
  traffic    Ray Serve with capture on (domains math + json), `--requests` chat requests per domain at
             `--concurrency` users, greedy; `json` is the shifted domain (structured extraction, which the
             drafter's math/code/chat rollouts never showed it); each request's X-Request-Id fixes its
             train/holdout side; the acceptance the endpoint measured per domain; Serve is shut down
             (drift detection against a recorded baseline is exercised by tests/integration/test_flywheel.py)
  retrain    jobs.retrain_data (captured train rows + original rollouts) -> jobs.train init_from the
             serving version (a separate process, as a user runs it)
  promote    jobs.promote: both versions decode the captured held-out prompts of each domain with the
             same seeds; the decision and τ per domain
  plot       <results>/flywheel_<target>.{json,png}: τ before/after per domain with the paired Δτ interval
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

from pydantic import Field

from dspark.config import StrictModel
from jobs.common import load_job_config

REPO = Path(__file__).resolve().parents[2]
EXPERIMENT = "dspark-flywheel-demo"
NAMES = ["Maria", "Kenji", "Amara", "Lukas", "Sofia", "Omar", "Priya", "Jonas", "Elena", "Tariq", "Chloe", "Mateo"]
JOBS = ["nurse", "carpenter", "teacher", "pilot", "chemist", "baker", "lawyer", "farmer", "architect", "plumber"]
CITIES = ["Lyon", "Osaka", "Lagos", "Graz", "Porto", "Cairo", "Pune", "Oslo", "Quito", "Perth", "Leeds", "Tunis"]


class FlywheelDemoConfig(StrictModel):
    target: Literal["smollm2-135m", "tiny"] = Field(
        "smollm2-135m", description="configs/serve/<target>.yaml and configs/train/<target>-dspark.yaml are the "
        "starting configs (tiny: a few minutes, to try the loop)")
    drafter: str = Field(description="local drafter dir to start from (registered as version 1, alias serving)")
    original_rollouts: str = Field(description="the drafter's training rollouts (rollout-store dir or s3://), mixed "
                                               "with the captured traffic")
    state_dir: str = Field(".dspark/flywheel-demo", description="state.json of the finished steps (a rerun resumes)")
    results: str = Field("benchmarks/results/flywheel", description="where flywheel_<target>.{json,png} go")
    requests: int = Field(48, ge=4, description="chat requests per domain")
    holdout: float = Field(0.25, gt=0, lt=1, description="share of each domain's requests held out for the evaluation")
    concurrency: int = Field(8, ge=1, description="users sending requests at once")
    max_tokens: int = Field(48, ge=1, description="completion tokens per request (and per evaluation prompt)")
    steps: int = Field(30, ge=1, description="retraining optimizer steps (jobs.train)")
    lr: float = Field(5e-4, gt=0, description="retraining peak learning rate")
    port: int = Field(8011, description="the endpoint's HTTP port on 127.0.0.1")


def model_of(args) -> str:
    """The registered model the demo creates (alias `serving`: what the endpoint serves; `candidate`)."""
    return f"{args.target}-flywheel"


def root_of(args) -> str:
    """Where captures, the retraining set, checkpoints and evaluations go."""
    return f"s3://dspark/flywheel-demo/{args.target}"


def log(msg: str) -> None:
    print(f"[flywheel_demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def json_prompts(n: int, seed: int) -> list[str]:
    """The shifted domain: extraction into a fixed JSON shape, one synthetic sentence each."""
    rng = random.Random(seed)
    return [f'Extract the name, age, job and city from this sentence. Answer with only a JSON object with the keys '
            f'"name", "age", "job" and "city".\nSentence: {rng.choice(NAMES)} is a {rng.randint(19, 71)}-year-old '
            f'{rng.choice(JOBS)} who lives in {rng.choice(CITIES)}.' for _ in range(n)]


def math_prompts(n: int) -> list[str]:
    """The drafter's own domain: the last n data/train math prompts (disjoint from data/eval; the
    learning-curve rollouts the committed drafter was trained on answered them too)."""
    rows = [json.loads(line) for line in (REPO / "data" / "train" / "math.jsonl").read_text().splitlines()]
    return [r["turns"][0] for r in rows[-n:]]


# ---------------------------------------------------------------- steps
def register(args, state: dict) -> dict:
    from dspark.io import tracking
    from dspark.io.tracking import registry

    run_id = tracking.start_run(EXPERIMENT, "first-drafter")
    tracking.log_artifact(args.drafter, "drafter")
    version = registry.register_model_version(run_id, model_of(args), "drafter", ["serving"])
    tracking.end_run()
    log(f"registered {args.drafter} as models:/{model_of(args)}/{version} @serving")
    return {"v1": version}


def serve_config(args):
    from dspark.config import load_config
    from jobs.serve import ServeJobConfig


    return load_config(ServeJobConfig, REPO / "configs" / "serve" / f"{args.target}.yaml", [
        f"model.drafter=models:/{model_of(args)}@serving", "engine.scheduler.mode=fixed", "engine.max_batch=16",
        "api.api_key_env=DSPARK_FLYWHEEL_KEY", f"flywheel.output={root_of(args)}/live", "flywheel.summary_every_s=5",
        "flywheel.capture={enabled: true, sample_rate: 1.0, max_per_s: 100, domains: [math, json], "
        f"holdout_fraction: {args.holdout}, shard_rows: 16, flush_every_s: 2}}",
        f"http.port={args.port}", "ready_timeout_s=900"], read_text=None)


def traffic(args, state: dict) -> dict:
    import httpx
    from ray import serve

    from jobs.serve import deploy
    from dspark.config import RayConfig
    from dspark.flywheel.capture import read_captures, row_id_in
    from pipelines.ray_cluster import init_ray

    os.environ.setdefault("DSPARK_FLYWHEEL_KEY", "sk-flywheel-smollm2")
    cfg = serve_config(args)
    init_ray(RayConfig())
    url, _ = deploy(cfg)
    n_hold = max(1, round(args.requests * args.holdout))
    sent = [(text, domain, row_id_in("holdout" if i < n_hold else "train", f"{domain}{i}", args.holdout))
            for domain, texts in (("math", math_prompts(args.requests)), ("json", json_prompts(args.requests, 0)))
            for i, text in enumerate(texts)]
    auth = {"authorization": f"Bearer {os.environ['DSPARK_FLYWHEEL_KEY']}"}
    client = httpx.Client(base_url=url, headers=auth, timeout=900)  # thread-safe: shared by the users

    def ask(item):
        text, domain, rid = item
        r = client.post("/v1/chat/completions", headers={"x-request-id": rid}, json={
            "messages": [{"role": "user", "content": text}], "max_tokens": args.max_tokens, "temperature": 0,
            "metadata": {"domain": domain}})
        r.raise_for_status()
        return domain, r.json()["spec_decode"]

    t0 = time.time()
    try:
        with ThreadPoolExecutor(args.concurrency) as pool:
            answers = list(pool.map(ask, sent))
        log(f"{len(sent)} requests answered in {time.time() - t0:.0f} s")
        deadline = time.time() + 300
        while read_captures(f"{root_of(args)}/live").num_rows < len(sent) and time.time() < deadline:
            time.sleep(2)
        served = client.get("/v1/stats").json().get("acceptance_by_domain", {})
    finally:
        client.close()
        serve.delete(cfg.deployment.name)
        serve.shutdown()
    log(f"served acceptance by domain: {json.dumps(served)}")
    return {"requests": len(sent), "traffic_s": time.time() - t0, "served_acceptance": served,
            "served_spec_decode_sample": answers[:2]}


def retrain(args, state: dict) -> dict:
    from jobs import retrain_data
    from dspark.io.tracking import registry

    data = retrain_data.run(retrain_data.RetrainDataConfig(
        flywheel_output=f"{root_of(args)}/live", original_rollouts=args.original_rollouts, capture_fraction=0.5,
        output=f"{root_of(args)}/retrain", tracking={"experiment": EXPERIMENT}))
    log(f"retraining set: {json.dumps({k: data[k] for k in ('captured_rows', 'original_rows', 'captured_by_domain')})}")
    overrides = [f"init_from=models:/{model_of(args)}@serving", f"data.rollouts={root_of(args)}/retrain",
                 f"optim.max_steps={args.steps}", f"optim.lr={args.lr}", "optim.warmup_ratio=0.05",
                 "drafter.anchors_per_seq=32", "run_name=flywheel-smollm2-retrain",
                 f"checkpoint.storage_path={root_of(args)}/checkpoints", f"checkpoint.every_steps={args.steps}",
                 f"tracking.experiment={EXPERIMENT}", f"tracking.registered_model={model_of(args)}", "tracking.alias=candidate"]
    cmd = [sys.executable, "-m", "jobs.train", "--config", f"configs/train/{args.target}-dspark.yaml"]
    for o in overrides:
        cmd += ["--set", o]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=REPO, text=True, stdout=subprocess.PIPE)
    if proc.returncode != 0:
        raise SystemExit(f"jobs.train failed ({proc.returncode})")
    summary = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    log(f"retrained in {time.time() - t0:.0f} s: {summary.get('registered_model')}")
    return {"retrain_data": {k: data[k] for k in ("captured_rows", "original_rows", "captured_by_domain")},
            "train_s": time.time() - t0, "v2": registry.version_of(model_of(args), "candidate"),
            "train_metrics": summary.get("metrics")}


def judge(args, state: dict) -> dict:
    from jobs import promote

    decode = {"greedy": True, "max_new_tokens": args.max_tokens}
    base = {"target": args.target, "benchmark_dir": None, "decode": decode, "workers": {"num_workers": 0},
            "heldout": f"{root_of(args)}/retrain/heldout"}
    result = promote.run(promote.PromoteConfig.model_validate({
        "model": model_of(args), "candidate": f"models:/{model_of(args)}/{state['v2']}", "tolerance": 0.1,
        "drifted_domains": ["json"], "tracking": {"experiment": EXPERIMENT},
        "eval": {**base, "output": f"{root_of(args)}/eval-v{state['v2']}"}}))
    log(f"decision: {json.dumps(result['decision'])}")
    return {"decision": result["decision"], "tau": result["tau"]}


def plot_rounds(args, state: dict) -> dict:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    domains = [d["domain"] for d in state["decision"]["domains"]]
    before = [state["tau"]["serving"][d] for d in domains]
    after = [state["tau"]["candidate"][d] for d in domains]
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = range(len(domains))
    ax.bar([x - 0.2 for x in xs], before, 0.4, label=f"serving v{state['v1']} (before)")
    ax.bar([x + 0.2 for x in xs], after, 0.4, label=f"retrained v{state['v2']} (after)")
    for x, d in zip(xs, state["decision"]["domains"]):
        ax.annotate(f"Δτ {d['mean_delta']:+.2f}\n[{d['ci_low']:+.2f}, {d['ci_high']:+.2f}]", (x, max(before[x], after[x])),
                    ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), [f"{d}{' (shifted)' if d == 'json' else ''}" for d in domains])
    ax.set_ylabel("τ on held-out traffic (greedy)")
    ax.set_title(f"{args.target} drafter before / after retraining on its own traffic", fontsize=9)
    ax.set_ylim(1.0, max(before + after) * 1.25)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"flywheel_{args.target}.png", dpi=120)
    report = {"benchmark": "flywheel_demo", "target": args.target, "drafter": args.drafter,
              "command": "python -m jobs.demo.flywheel " + " ".join(sys.argv[1:]), "config": args.model_dump(),
              **{k: state[k] for k in ("v1", "v2", "requests", "traffic_s", "served_acceptance", "retrain_data", "train_s",
                                       "train_metrics", "decision", "tau")}}
    (out / f"flywheel_{args.target}.json").write_text(json.dumps(report, indent=1))
    log(f"wrote {out / f'flywheel_{args.target}.json'} and .png")
    return {"plotted": True}


STEPS = [("register", register), ("traffic", traffic), ("retrain", retrain), ("promote", judge), ("plot", plot_rounds)]


def main(argv=None) -> None:
    args = load_job_config(FlywheelDemoConfig, argv, __doc__.splitlines()[0])
    Path(args.state_dir).mkdir(parents=True, exist_ok=True)
    state_file = Path(args.state_dir) / "state.json"
    state = json.loads(state_file.read_text()) if state_file.exists() else {}
    for name, step in STEPS:
        if name in state.get("done", []):
            log(f"{name}: done already")
            continue
        log(f"{name} ...")
        state.update(step(args, state))
        state["done"] = state.get("done", []) + [name]
        state_file.write_text(json.dumps(state, indent=1))


if __name__ == "__main__":
    main()
