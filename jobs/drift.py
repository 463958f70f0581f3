"""Drift alarm: `python -m jobs.drift --set model=models:/<name>@serving --set flywheel_output=s3://...`.

Reads the serving replicas' per-domain acceptance windows (flywheel.output/acceptance/) of the last
`window_s` seconds for the version the alias points to, compares each domain's expected accepted
length with the τ baseline recorded on that version (jobs.flywheel baseline / promote), and for every
domain that dropped by more than `margin`: logs a WARNING naming the domain and the figures, sets the
tag `dspark.drift.<domain>` on the model version, and logs `drift.<domain>.*` metrics to an MLflow run.
Run it periodically (a cron / RayJob schedule): it is also the MLflow summariser of live acceptance.
Prints a JSON summary as its last line; exit 0 whether or not something drifted.
"""
from __future__ import annotations

import logging
import sys
import time

from pydantic import Field

from dspark.config import StrictModel, TrackingConfig
from dspark.flywheel import drift
from jobs.common import job_main, the_result, tracked_run

log = logging.getLogger("dspark.drift")


class DriftConfig(StrictModel):
    model: str = Field(description="the served drafter: models:/<name>@<alias> or models:/<name>/<version>")
    flywheel_output: str = Field(description="the serve config's flywheel.output (local dir or s3:// prefix)")
    window_s: float = Field(3600.0, gt=0, description="acceptance windows that ended within this many seconds")
    margin: float = Field(0.15, ge=0, description="flag a domain whose expected accepted length is this much below its baseline τ")
    min_draft_tokens: int = Field(200, ge=1, description="domains with fewer verified drafts in the window are not judged")
    tracking: TrackingConfig = Field(TrackingConfig(experiment="dspark-flywheel"), description="MLflow")


def run(cfg: DriftConfig, now: float | None = None) -> dict:
    from dspark.io import tracking
    from dspark.io.tracking import registry
    from dspark.io.drafter_source import resolve_ref

    ref = resolve_ref(cfg.model)
    if ref.kind != "model":
        raise ValueError(f"model {cfg.model!r}: give a registered model (models:/<name>@<alias>)")
    name, version = ref.model_name, ref.model_version
    live = drift.read_windows(cfg.flywheel_output, drift.window_start(cfg.window_s, now), version)
    baseline = registry.baseline(name, version)
    results = drift.compare(live, baseline, cfg.margin, cfg.min_draft_tokens)
    drifted = [r.domain for r in results if r.drifted]
    with tracked_run(cfg.tracking, cfg, f"drift-{name}-v{version}",
                     tags={"dspark.stage": "drift", "dspark.model": f"{name}/{version}"}) as run_id:
        metrics = {}
        for r in results:
            metrics.update({f"drift.{r.domain}.live_accept_len": r.live, f"drift.{r.domain}.baseline_tau": r.baseline,
                            f"drift.{r.domain}.drop": r.drop, f"drift.{r.domain}.draft_tokens": r.draft_tokens,
                            f"drift.{r.domain}.drifted": float(r.drifted)})
        if run_id:
            tracking.log_metrics({k: v for k, v in metrics.items() if v is not None})
            tracking.set_tags({"dspark.drifted_domains": ",".join(drifted) or "none"})
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now or time.time()))
    for r in results:
        if r.drifted:
            log.warning("drift on %s v%s, domain %r: expected accepted length %.3f over the last %.0f s "
                        "(%d draft tokens, %d requests) vs baseline τ %.3f: %s", name, version, r.domain, r.live,
                        cfg.window_s, r.draft_tokens, r.requests, r.baseline, r.reason)
            registry.set_model_version_tags(name, version, {f"dspark.drift.{r.domain}":
                                                 f"live {r.live:.3f} baseline {r.baseline:.3f} at {stamp}"})
        else:
            log.info("domain %r: %s", r.domain, r.reason)
    if drifted:
        registry.set_model_version_tags(name, version, {"dspark.drift": ",".join(drifted), "dspark.drift.checked_at": stamp})
    return {"model": f"{name}/{version}", "drifted": drifted, "domains": [r.to_dict() for r in results],
            "mlflow_run_id": run_id}


def main(argv: list[str] | None = None) -> int:
    return job_main(DriftConfig, run, argv, "Flag domains whose live acceptance dropped below the drafter's baseline.",
                    summary=the_result, log_info=True)


if __name__ == "__main__":
    sys.exit(main())
