"""A training run's directory on storage (local or s3://): where Ray Train's checkpoints go, and beside
them what a relaunch resumes from."""
from __future__ import annotations

import json
from dataclasses import dataclass

from dspark.io import storage
from dspark.training.config import TrainJobConfig


@dataclass(frozen=True)
class RunDir:
    """`<checkpoint.storage_path>/<run_name>/` (local or s3://): Ray Train's checkpoints, and beside them
    the run record (`dspark_run.json`: MLflow run id, launches, the drafter config, completed steps),
    the resolved config and the DeepSpeed JSON. The record is what a relaunch resumes from."""

    uri: str
    RECORD = "dspark_run.json"

    @classmethod
    def of(cls, cfg: TrainJobConfig) -> "RunDir":
        return cls(storage.join(cfg.checkpoint.storage_path, cfg.run_name))

    def path(self, name: str) -> str:
        return storage.join(self.uri, name)

    def read_record(self) -> dict | None:
        uri = self.path(self.RECORD)
        return json.loads(storage.read_text(uri)) if storage.exists(uri) else None

    def write_record(self, record: dict) -> None:
        self.write_text(self.RECORD, json.dumps(record, indent=2))

    def write_text(self, name: str, text: str) -> None:
        storage.write_text(self.path(name), text)

