"""Evaluate a retrained drafter against the serving one and move the serving alias only if it wins:

    python -m jobs.promote --config configs/flywheel/tiny.yaml --set candidate=models:/<name>/<version>
    python -m jobs.promote --config configs/flywheel/tiny.yaml              # no candidate: baseline only

With a candidate: jobs.evaluate decodes the held-out captured traffic (jobs.retrain_data's
`heldout/<domain>.jsonl`) and the benchmark set with both drafters on the same prompts and seeds;
dspark.flywheel.promotion decides (τ better beyond the bootstrap interval on every drifted domain —
default: the serving version's `dspark.drift` tag — and no loss beyond `tolerance` elsewhere). The
decision, per-domain Δτ and intervals go to an MLflow run and to tags on the candidate version; when
it wins, the alias moves to it and its per-domain τ becomes the baseline the drift job compares with.
With `rollout.serve_config`, a promotion also redeploys the Serve app with the new version pinned:
Ray Serve replaces the replicas one by one (a rolling update; requests in flight finish on the old
replica, new ones queue for the new one), and the job waits until GET /v1/models names it.
Without a candidate: evaluates the serving version and records its baseline (first deployment).
"""
from __future__ import annotations

import json
import logging
import sys
import time

from pydantic import Field

from dspark.eval import evaluate as ev
from dspark.config import ModelAlias, RayConfig, StrictModel, TrackingConfig
from jobs.common import job_main, the_result, tracked_run
from pipelines.eval_decode import WorkersConfig

log = logging.getLogger("dspark.promote")


class EvalSection(StrictModel):
    target: str = Field("tiny", description="the served target")
    benchmark_dir: str | None = Field("data/eval", description="base of relative benchmark paths")
    benchmarks: list[ev.BenchmarkSpec] = Field(default_factory=list, description="benchmark files besides the held-out traffic")
    heldout: str | None = Field(None, description="directory of <domain>.jsonl held-out traffic (jobs.retrain_data's <output>/heldout)")
    max_prompts_per_benchmark: int | None = Field(None, description="the first N prompts of each file")
    decode: ev.DecodeSettings = Field(ev.DecodeSettings(max_new_tokens=64), description="sampling and decoding")
    seed: int = Field(0, description="same seeds for both drafters: paired comparison")
    output: str = Field("results/promote", description="evaluation outputs (local dir or s3:// prefix)")
    workers: WorkersConfig = Field(WorkersConfig(num_workers=0), description="decoding actors (0: in this process)")


class RolloutSection(StrictModel):
    serve_config: str | None = Field(None, description="the deployed app's serve config (path); None: only move the alias")
    overrides: list[str] = Field(default_factory=list, description="--set overrides used when it was deployed")
    timeout_s: float = Field(600.0, description="wait this long for the endpoint to serve the new version")


class PromoteConfig(StrictModel):
    model: str = Field(description="registered model name of the drafter")
    serving_alias: ModelAlias = Field("serving", description="the alias the endpoint serves (model.drafter: models:/<model>@<alias>)")
    candidate: str | None = Field(None, description="models:/<model>/<version> (or @alias) to judge; None: record the serving version's baseline")
    drifted_domains: list[str] | None = Field(None, description="None: from the serving version's dspark.drift tag")
    tolerance: float = Field(0.05, ge=0, description="largest mean τ loss allowed on a domain that did not drift")
    confidence: float = Field(0.95, gt=0, lt=1, description="bootstrap interval level")
    bootstrap_samples: int = Field(2000, ge=100, description="bootstrap resamples")
    eval: EvalSection = Field(default_factory=EvalSection, description="the paired evaluation")
    rollout: RolloutSection = Field(default_factory=RolloutSection, description="redeploy Serve after a promotion")
    ray: RayConfig = Field(default_factory=RayConfig, description="Ray cluster (evaluation workers, Serve rollout)")
    tracking: TrackingConfig = Field(TrackingConfig(experiment="dspark-flywheel"), description="MLflow")


def benchmarks(cfg: PromoteConfig) -> list[ev.BenchmarkSpec]:
    from dspark.io import storage

    specs = list(cfg.eval.benchmarks)
    if cfg.eval.heldout:
        for uri in storage.list_files(cfg.eval.heldout):
            if uri.endswith(".jsonl"):
                domain = uri.rsplit("/", 1)[-1].removesuffix(".jsonl")
                specs.append(ev.BenchmarkSpec(path=uri, name=f"traffic-{domain}", domain=domain))
    if not specs:
        raise ValueError("nothing to evaluate on: give eval.heldout (jobs.retrain_data output) and/or eval.benchmarks")
    return specs


def evaluate_candidates(cfg: PromoteConfig, drafters: dict[str, str]) -> tuple[dict, list[dict]]:
    """jobs.evaluate on the given {name: pinned ref}; (results, samples.jsonl rows)."""
    from dspark.io import storage
    from jobs import evaluate as evaluate_job

    e = cfg.eval
    eval_cfg = evaluate_job.EvalConfig(
        target=e.target, drafters=[{"ref": ref, "name": name} for name, ref in drafters.items()],
        benchmark_dir=e.benchmark_dir, benchmarks=benchmarks(cfg), max_prompts_per_benchmark=e.max_prompts_per_benchmark,
        seed=e.seed, decode=e.decode, baseline=False, output=e.output, workers=e.workers, ray=cfg.ray,
        tracking=cfg.tracking.model_copy(update={"run_name": f"promote-eval-{cfg.model}"}))
    results = evaluate_job.run(eval_cfg)
    samples = [json.loads(line) for line in storage.read_text(storage.join(e.output, "samples.jsonl")).splitlines()
               if line.strip()]
    return results, samples


def domain_tau(results: dict, name: str) -> dict[str, float]:
    return {d: s["tau"] for d, s in results["drafters"][name]["per_domain"].items() if s.get("tau") is not None}


def run(cfg: PromoteConfig) -> dict:
    from dspark.flywheel import promotion
    from dspark.io import tracking
    from dspark.io.tracking import registry
    from dspark.io.drafter_source import resolve_ref

    serving_version = registry.version_of(cfg.model, cfg.serving_alias)
    serving = f"models:/{cfg.model}/{serving_version}"
    if cfg.candidate is None:  # baseline of the serving version
        results, _ = evaluate_candidates(cfg, {"serving": serving})
        taus = domain_tau(results, "serving")
        registry.record_baseline(cfg.model, serving_version, taus, source=f"jobs.promote eval {cfg.eval.output}")
        log.info("baseline of %s: %s", serving, taus)
        return {"model": cfg.model, "version": serving_version, "baseline": taus}
    candidate = resolve_ref(cfg.candidate)
    if candidate.model_name != cfg.model:
        raise ValueError(f"candidate {cfg.candidate!r} is not a version of {cfg.model!r}")
    drifted = cfg.drifted_domains
    if drifted is None:
        drifted = [d for d in registry.version_tags(cfg.model, serving_version).get("dspark.drift", "").split(",") if d]
    results, samples = evaluate_candidates(cfg, {"serving": serving, "candidate": candidate.uri})
    domain_of = {b: info["domain"] for b, info in results["benchmarks"].items()}
    deltas = promotion.paired_deltas(samples, domain_of, "serving", "candidate")
    decision = promotion.decide(deltas, drifted, cfg.tolerance, cfg.confidence, cfg.bootstrap_samples, cfg.eval.seed)
    summary = {"model": cfg.model, "serving_version": serving_version, "candidate_version": candidate.model_version,
               "drifted_domains": drifted, "decision": decision.to_dict(),
               "tau": {"serving": domain_tau(results, "serving"), "candidate": domain_tau(results, "candidate")}}
    verdict = "promoted" if decision.promote else "rejected"
    with tracked_run(cfg.tracking, cfg, f"promote-{cfg.model}-v{candidate.model_version}",
                     tags={"dspark.stage": "promote", "dspark.decision": verdict}) as run_id:
        if run_id:
            metrics = {f"{d.domain}.{k}": getattr(d, k) for d in decision.domains
                       for k in ("mean_delta", "ci_low", "ci_high") if getattr(d, k) is not None}
            tracking.log_metrics({**metrics, "promoted": float(decision.promote)})
            tracking.log_dict(summary, "decision.json")
    note = f"{verdict} over v{serving_version}: " + "; ".join(decision.reasons)
    registry.set_model_version_tags(cfg.model, candidate.model_version, {"dspark.promotion": note[:4900],
                                                             "dspark.promotion.run": run_id or ""})
    log.info("candidate v%s %s", candidate.model_version, note)
    if decision.promote:
        registry.record_baseline(cfg.model, candidate.model_version, summary["tau"]["candidate"],
                                 source=f"jobs.promote eval {cfg.eval.output}")
        registry.promote(cfg.model, candidate.model_version, cfg.serving_alias, f"jobs.promote run {run_id or '-'}: {note}"[:4900])
        if cfg.rollout.serve_config:
            summary["rollout"] = roll_out(cfg, f"models:/{cfg.model}/{candidate.model_version}")
    return {**summary, "mlflow_run_id": run_id}


def roll_out(cfg: PromoteConfig, pinned: str) -> dict:
    """Redeploy the Serve app with the new version pinned (Serve's rolling replica update); wait until
    GET /v1/models names it."""
    from dspark.config import load_config
    from jobs.serve import ServeJobConfig, deploy
    from pipelines.ray_cluster import init_ray

    serve_cfg = load_config(ServeJobConfig, cfg.rollout.serve_config, cfg.rollout.overrides)
    serve_cfg.model.drafter = pinned
    init_ray(cfg.ray)
    t0 = time.time()
    url, _ = deploy(serve_cfg)
    wait_serving(url, pinned, cfg.rollout.timeout_s, serve_cfg.api.api_key_env)
    return {"url": url, "drafter": pinned, "seconds": round(time.time() - t0, 1)}


def wait_serving(url: str, drafter: str, timeout_s: float, key_env: str) -> None:
    """Poll GET /v1/models until every model card names `drafter` (TimeoutError after `timeout_s`)."""
    import os

    from dspark.io.http import wait_healthy

    key = os.environ.get(key_env)
    headers = {"authorization": f"Bearer {key}"} if key else {}
    wait_healthy(f"{url}/v1/models", timeout_s, headers=headers, hint=f"the endpoint did not serve {drafter}",
                 ready=lambda resp: _serves(resp, drafter))


def _serves(resp, drafter: str) -> bool:
    try:
        cards = resp.json()["data"]
    except (KeyError, TypeError, ValueError):
        return False
    return bool(cards) and all(c.get("drafter") == drafter for c in cards)


def main(argv: list[str] | None = None) -> int:
    return job_main(PromoteConfig, run, argv, "Judge a retrained drafter against the serving one; promote it if it wins.",
                    summary=the_result, log_info=True)


if __name__ == "__main__":
    sys.exit(main())
