"""The Ray Serve deployment (FastAPI ingress) hosting one engine per replica, with per-replica metrics
exported through `ray.serve.metrics`; `deployment_for(cfg)` / `build_app(args)` give the bound
application for `jobs/serve.py` and for `serve deploy infra/serve/serve_config.yaml`."""
from __future__ import annotations

import functools
import logging
import os
from typing import Any

from dspark.config import config_to_dict
from dspark.decoding.engine import Engine, Request, StepReport
from dspark.serve.app import make_app
from dspark.serve.config import ServeConfig, build_engine
from dspark.serve.service import OpenAIService

log = logging.getLogger("dspark.serve")


def replica_has_gpus(cfg: ServeConfig) -> bool:
    """Whether this process was given GPUs. Inside a Ray actor (a Serve replica) Ray's own assignment
    decides: it also sees num_gpus set outside the ServeConfig (a Serve YAML / RayService
    `deployments:` entry overrides ray_actor_options). Elsewhere: deployment.num_gpus > 0."""
    import ray

    if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
        return bool(ray.get_runtime_context().get_accelerator_ids().get("GPU"))
    return cfg.deployment.num_gpus > 0


# ---- metrics ------------------------------------------------------------------------------------------
class ServeMetrics:
    """Per-replica counters/gauges (Ray Serve adds deployment/replica/application tags; scraped by
    Ray's Prometheus endpoint)."""

    def __init__(self, engine: Engine):
        from ray.serve import metrics

        gamma = max(engine.gamma, 1)
        self.requests = metrics.Counter("dspark_requests", "Finished requests by outcome", tag_keys=("outcome",))
        self.tokens = metrics.Counter("dspark_generated_tokens", "Tokens generated")
        self.prompt_tokens = metrics.Counter("dspark_prompt_tokens", "Prompt tokens prefilled")
        self.rounds = metrics.Counter("dspark_verify_rounds", "Request-rounds verified (one per request per step)")
        self.verified = metrics.Counter("dspark_draft_tokens_verified", "Draft tokens sent to the target")
        self.accepted = metrics.Counter("dspark_draft_tokens_accepted", "Draft tokens accepted")
        self.budget = metrics.Histogram("dspark_verify_budget", "Drafts verified per request per round",
                                        boundaries=[i + 0.5 for i in range(gamma)])
        self.queue = metrics.Gauge("dspark_queue_length", "Requests waiting for a slot")
        self.active = metrics.Gauge("dspark_active_requests", "Requests in the running batch")
        self.batch_tokens = metrics.Gauge("dspark_batch_tokens", "Tokens in the last verify forward (B)")
        self.engine = engine
        engine.step_listeners.append(self.on_step)

    def on_step(self, report: StepReport) -> None:
        if report.emitted:
            self.tokens.inc(report.emitted)
        if report.prefill_tokens:
            self.prompt_tokens.inc(report.prefill_tokens)
        if report.rows:
            self.rounds.inc(report.rows)
            self.batch_tokens.set(report.batch_tokens)
        if report.verified:
            self.verified.inc(report.verified)
        if report.accepted:
            self.accepted.inc(report.accepted)
        for n in report.verify_lens:
            self.budget.observe(n)
        self.queue.set(len(self.engine.waiting))
        self.active.set(len(self.engine.active))

    def request_done(self, req: Request) -> None:
        self.requests.inc(tags={"outcome": req.finish_reason or "unknown"})

    def watch_flywheel(self, flywheel) -> None:
        """Per-domain spec-decode counters (vLLM's `spec_decode` names, prefixed dspark_, plus a domain
        label; README "Keeping a drafter fresh" lists them), fed by the Flywheel per finished request."""
        from ray.serve import metrics

        by_domain = ("domain",)
        self.sd_requests = metrics.Counter("dspark_spec_decode_requests", "Finished requests by domain",
                                           tag_keys=by_domain)
        self.sd_drafts = metrics.Counter("dspark_spec_decode_num_drafts",
                                         "Request-rounds that verified at least one draft", tag_keys=by_domain)
        self.sd_draft_tokens = metrics.Counter("dspark_spec_decode_num_draft_tokens",
                                               "Draft tokens verified (the verify budget spent)", tag_keys=by_domain)
        self.sd_proposed = metrics.Counter("dspark_spec_decode_num_proposed_tokens", "Draft tokens proposed",
                                           tag_keys=by_domain)
        self.sd_accepted = metrics.Counter("dspark_spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                           tag_keys=by_domain)
        self.sd_rounds = metrics.Counter("dspark_spec_decode_num_rounds", "Verify rounds", tag_keys=by_domain)
        self.sd_per_pos = metrics.Counter("dspark_spec_decode_num_accepted_tokens_per_pos",
                                          "Drafts accepted at each position", tag_keys=("domain", "position"))
        self.sd_verified_per_pos = metrics.Counter("dspark_spec_decode_num_verified_tokens_per_pos",
                                                   "Drafts verified at each position", tag_keys=("domain", "position"))
        flywheel.listeners.append(self.on_request)

    def on_request(self, domain: str, stats) -> None:
        tags = {"domain": domain}
        self.sd_requests.inc(tags=tags)
        for counter, value in ((self.sd_drafts, stats.drafting_rounds),
                               (self.sd_draft_tokens, stats.verified), (self.sd_proposed, stats.proposed),
                               (self.sd_accepted, stats.accepted), (self.sd_rounds, stats.rounds)):
            if value:
                counter.inc(value, tags=tags)
        for counter, values in ((self.sd_per_pos, stats.accepted_per_pos),
                                (self.sd_verified_per_pos, stats.verified_per_pos)):
            for k, value in enumerate(values):
                if value:
                    counter.inc(value, tags={"domain": domain, "position": str(k)})

    def rejected(self) -> None:
        self.requests.inc(tags={"outcome": "rejected"})


# ---- Ray Serve ----------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _deployment_class():
    from ray import serve

    @serve.deployment
    @serve.ingress()  # the documented late-bound form (Ray 2.60 serve.ingress: "Pass nothing to defer the app to
    class DSparkServer:  # replica init time"; __serve_build_asgi_app__ returns it): the app needs this replica's engine
        """One engine per replica, its loop in a background thread; FastAPI routes from make_app."""

        def __init__(self, config: dict):
            import torch

            logging.basicConfig(level=logging.INFO)
            from dspark.flywheel.observer import build_flywheel

            self.cfg = ServeConfig.model_validate(config)
            threads = self.cfg.deployment.torch_threads or max(1, round(self.cfg.deployment.num_cpus))
            torch.set_num_threads(threads)
            # model.drafter arrives pinned to one version (deployment_for resolved the alias once for all replicas)
            self.engine = build_engine(self.cfg, has_gpus=replica_has_gpus(self.cfg))
            metrics = ServeMetrics(self.engine)
            self.flywheel = build_flywheel(self.cfg, self.engine)
            metrics.watch_flywheel(self.flywheel)
            self.service = OpenAIService(self.engine, self.cfg, metrics, self.flywheel)
            self.engine.start()
            log.info("dspark replica ready: model %s on %s, mode %s, %d torch threads", self.service.model_name,
                     self.engine.target.device, self.engine.mode, threads)

        def __serve_build_asgi_app__(self):
            return make_app(self.service)

        def check_health(self) -> None:
            status, body = self.service.health()
            if status != 200:
                raise RuntimeError(f"engine unhealthy: {body.get('health_error') or 'loop stopped'}")

        def __del__(self):
            engine = getattr(self, "engine", None)
            if engine is not None:
                engine.stop(timeout=2.0)
            flywheel = getattr(self, "flywheel", None)
            if flywheel is not None:
                flywheel.close(timeout_s=10.0)  # commit the queued captures and the last window

    return DSparkServer


def deployment_for(cfg: ServeConfig, forward_api_key: bool = True):
    """The bound Serve application for `cfg` (pass to serve.run). With `forward_api_key` (jobs.serve
    on one machine), the API key env var, when set in the deploying process, is forwarded to the
    replicas through runtime_env. `serve deploy`/RayService (build_app) never do that — the runtime
    env is shown by `serve status` and the dashboard: there the replicas' containers hold the key
    (a Kubernetes Secret through env/valueFrom, infra/kuberay/rayservice.yaml)."""
    cfg, d = pinned_config(cfg), cfg.deployment
    actor_options: dict[str, Any] = {"num_cpus": d.num_cpus}
    if d.num_gpus > 0:
        actor_options["num_gpus"] = d.num_gpus
    key = os.environ.get(cfg.api.api_key_env) if forward_api_key else None
    if key:
        actor_options["runtime_env"] = {"env_vars": {cfg.api.api_key_env: key}}
    scaling = ({"autoscaling_config": d.autoscaling.model_dump()} if d.autoscaling else {"num_replicas": d.num_replicas})
    return _deployment_class().options(
        name="DSparkServer", max_ongoing_requests=d.max_ongoing_requests, max_queued_requests=d.max_queued_requests,
        ray_actor_options=actor_options, health_check_period_s=d.health_check_period_s,
        health_check_timeout_s=d.health_check_timeout_s, graceful_shutdown_timeout_s=d.graceful_shutdown_timeout_s,
        **scaling,
    ).bind({k: v for k, v in config_to_dict(cfg).items() if k in ServeConfig.model_fields})


def pinned_config(cfg: ServeConfig) -> ServeConfig:
    """`cfg` with model.drafter's alias resolved ONCE, where the app is deployed: every replica, including
    ones an autoscaler adds later, serves that same version even if the alias moves meanwhile (a promotion
    redeploys with the new version pinned: jobs.promote's rolling update). Fails here, before any replica
    starts, when the alias does not resolve."""
    if cfg.engine.scheduler.mode == "off" or not cfg.model.drafter:
        return cfg
    from dspark.flywheel.observer import pin_drafter

    pinned, _ = pin_drafter(cfg.model.drafter)
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"drafter": pinned})})


def build_app(args: dict):
    """Application builder for `serve deploy infra/serve/serve_config.yaml` (import_path
    dspark.serve.deployment:build_app). args: {"config": a configs/serve/*.yaml path or an inline mapping,
    "set": ["engine.max_batch=16", ...]}. A `ray:` section (used by jobs/serve.py) is ignored here:
    `serve deploy` targets a running cluster."""
    from dspark.config import apply_overrides, read_yaml, validate_config
    from dspark.io import storage

    args = dict(args or {})
    overrides = args.pop("set", None) or []
    source = args.pop("config", None)
    if args:
        raise ValueError(f"unknown application args {sorted(args)}; use 'config' (path or mapping) and 'set'")
    data = dict(source) if isinstance(source, dict) else (read_yaml(source, storage.read_text) if source else {})
    data.pop("ray", None)
    data = apply_overrides(data, [overrides] if isinstance(overrides, str) else list(overrides))
    return deployment_for(validate_config(ServeConfig, data, source=str(source or "<args>")), forward_api_key=False)
