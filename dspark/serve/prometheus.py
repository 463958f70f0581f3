"""Prometheus metrics at the HTTP port (GET /metrics), as vLLM serves them: one CollectorRegistry per
app (so several apps in one process never share or clash), HTTP request counters and latencies by
route and status (`HttpMetrics` ASGI middleware), and the engine's queue, health and token totals read
at scrape time (`EngineCollector`), and speculative-decoding counters under vLLM's names
(`SpecDecodeMetrics`). More collectors register on `PrometheusMetrics.registry`. With several Serve replicas, each scrape reaches one replica: scrape
the replicas (or Ray's own metrics export), not the load-balanced URL, for fleet totals."""
from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "dspark"


class EngineCollector:
    """Engine gauges and counters, read from `engine.stats()` at each scrape (nothing on the hot path)."""

    def __init__(self, engine, model_name: str):
        self.engine, self.labels = engine, {"model_name": model_name}

    def collect(self):
        stats = self.engine.stats()
        totals = stats["totals"]
        gauges = {"num_requests_running": ("requests in the running batch", stats["active"]),
                  "num_requests_waiting": ("requests queued for admission", stats["waiting"]),
                  "engine_healthy": ("1 while the engine serves, 0 once it reports unhealthy",
                                     int(bool(stats["healthy"] and stats["loop_alive"])))}
        for name, (doc, value) in gauges.items():
            yield _family(GaugeMetricFamily, name, doc, self.labels, value)
        counters = {"prompt_tokens": ("prompt tokens prefilled", totals["prompt_tokens"]),
                    "generation_tokens": ("tokens generated", totals["generated_tokens"]),
                    "requests_finished": ("requests the engine finished (stop or length)", totals["finished"]),
                    "requests_failed": ("requests the engine failed", totals["failed"]),
                    "requests_cancelled": ("requests cancelled (client gone, stop string, shutdown)",
                                           totals["cancelled"]),
                    "requests_rejected": ("requests refused with a full queue (HTTP 429)", totals["rejected"])}
        for name, (doc, value) in counters.items():
            yield _family(CounterMetricFamily, name, doc, self.labels, value)


def _family(cls, name: str, doc: str, labels: dict, value):
    family = cls(f"{PREFIX}_{name}", doc, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


class PrometheusMetrics:
    """The registry of one app and its HTTP metrics."""

    def __init__(self, engine=None, model_name: str = ""):
        self.registry = CollectorRegistry()
        self.requests = Counter(f"{PREFIX}_http_requests", "HTTP requests answered, by route, method and status",
                                ["route", "method", "status"], registry=self.registry)
        self.latency = Histogram(f"{PREFIX}_http_request_duration_seconds",
                                 "time to the end of the response (streams included), by route",
                                 ["route"], registry=self.registry,
                                 buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
        if engine is not None:
            self.registry.register(EngineCollector(engine, model_name))

        self.spec_decode = SpecDecodeMetrics(self.registry, model_name)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class SpecDecodeMetrics:
    """Speculative-decoding counters under the names vLLM serves them, so vLLM's dashboards read this endpoint
    as is: `vllm:spec_decode_num_drafts` (request-rounds that verified at least one draft),
    `vllm:spec_decode_num_draft_tokens` (drafts verified), `vllm:spec_decode_num_accepted_tokens` and
    `vllm:spec_decode_num_accepted_tokens_per_pos{position}`; acceptance rate = accepted / draft tokens, mean
    acceptance length = 1 + accepted / drafts. Rounds the load-aware scheduler verified no draft in are plain
    target steps and count in none. By domain (with the flywheel): `dspark_spec_decode_num_*{domain}`."""

    def __init__(self, registry: CollectorRegistry, model_name: str):
        self.model_name = model_name
        labels = ["model_name"]
        self.drafts = Counter("vllm:spec_decode_num_drafts", "request-rounds that verified a draft", labels,
                              registry=registry)
        self.draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "draft tokens verified", labels,
                                    registry=registry)
        self.accepted = Counter("vllm:spec_decode_num_accepted_tokens", "draft tokens accepted", labels,
                                registry=registry)
        self.per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "drafts accepted at each position",
                               labels + ["position"], registry=registry)
        by_domain = ["model_name", "domain"]
        self.domain_drafts = Counter(f"{PREFIX}_spec_decode_num_drafts", "request-rounds that verified a draft, "
                                     "by domain", by_domain, registry=registry)
        self.domain_draft_tokens = Counter(f"{PREFIX}_spec_decode_num_draft_tokens", "draft tokens verified, by "
                                           "domain", by_domain, registry=registry)
        self.domain_accepted = Counter(f"{PREFIX}_spec_decode_num_accepted_tokens", "draft tokens accepted, by "
                                       "domain", by_domain, registry=registry)

    def record(self, stats) -> None:
        """One finished request's RequestStats (dspark.decoding.request)."""
        name = self.model_name
        for counter, value in ((self.drafts, stats.drafting_rounds), (self.draft_tokens, stats.verified),
                               (self.accepted, stats.accepted)):
            if value:
                counter.labels(name).inc(value)
        for position, value in enumerate(stats.accepted_per_pos):
            if value:
                self.per_pos.labels(name, str(position)).inc(value)

    def record_domain(self, domain: str, stats) -> None:
        """A flywheel listener: the same request's counts under its domain."""
        for counter, value in ((self.domain_drafts, stats.drafting_rounds),
                               (self.domain_draft_tokens, stats.verified), (self.domain_accepted, stats.accepted)):
            if value:
                counter.labels(self.model_name, domain).inc(value)


class HttpMetrics:
    """ASGI middleware counting every HTTP response by route template (unknown paths: "other", so a
    scan cannot blow up the label set), method and status, and timing it to its last byte."""

    def __init__(self, app, metrics: PrometheusMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), {"code": 500}

        async def record_status(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, record_status)
        finally:
            route = getattr(scope.get("route"), "path", None) or "other"
            self.metrics.requests.labels(route, scope.get("method", ""), str(status["code"])).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - start)
