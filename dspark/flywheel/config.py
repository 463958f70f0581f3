"""The serve config's `flywheel` section: where acceptance summaries and captured traffic go, and
the opt-in capture policy."""
from __future__ import annotations

from pydantic import Field, model_validator

from dspark.config import StrictModel


class CaptureConfig(StrictModel):
    enabled: bool = Field(False, description="store sampled requests and their answers (off by default: opt in)")
    sample_rate: float = Field(0.0, ge=0, le=1, description="share of eligible finished requests captured")
    max_per_s: float = Field(2.0, gt=0, description="at most this many captures per second per replica (token bucket, burst = 1 s)")
    domains: list[str] = Field(default_factory=list, description="allow-list: only requests of these domains are captured (empty: none)")
    holdout_fraction: float = Field(0.1, ge=0, lt=1, description="share of captured rows given split=holdout (by a hash of the row id)")
    queue_size: int = Field(1024, ge=1, description="bounded hand-off to the writer thread; a full queue drops (and counts) the capture, never blocks the request")
    shard_rows: int = Field(256, ge=1, description="rows per Parquet shard")
    flush_every_s: float = Field(30.0, gt=0, description="a partial shard is committed after this long")

    @model_validator(mode="after")
    def _opted_in(self) -> "CaptureConfig":
        if self.enabled and not self.domains:
            raise ValueError("capture.enabled needs capture.domains: list the domains whose prompts may be stored")
        return self


class FlywheelConfig(StrictModel):
    output: str | None = Field(None, description="local dir or s3:// prefix for acceptance summaries (acceptance/) and captures (capture/); None: metrics only")
    summary_every_s: float = Field(60.0, gt=0, description="seconds per acceptance window written to output/acceptance/")
    capture: CaptureConfig = Field(default_factory=CaptureConfig, description="opt-in traffic capture into the rollout store format")

    @model_validator(mode="after")
    def _has_output(self) -> "FlywheelConfig":
        if self.capture.enabled and not self.output:
            raise ValueError("capture.enabled needs flywheel.output (a local dir or s3:// prefix)")
        return self
