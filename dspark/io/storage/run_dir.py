"""A training run's directory on storage (local or s3://): where Ray Train's checkpoints go, and beside
them what a relaunch resumes from; and reading a finished run's checkpoint (its URI, one folder of it)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from dspark.io import storage


@dataclass(frozen=True)
class RunDir:
    """`<checkpoint.storage_path>/<run_name>/` (local or s3://): Ray Train's checkpoints, and beside them
    the run record (`dspark_run.json`: MLflow run id, launches, the drafter config, completed steps),
    the resolved config and the DeepSpeed JSON. The record is what a relaunch resumes from."""

    uri: str
    RECORD = "dspark_run.json"

    @classmethod
    def of(cls, storage_path: str, run_name: str) -> "RunDir":
        """The run `run_name` under the job's `checkpoint.storage_path`."""
        return cls(storage.join(storage_path, run_name))

    def path(self, name: str) -> str:
        return storage.join(self.uri, name)

    def read_record(self) -> dict | None:
        uri = self.path(self.RECORD)
        return json.loads(storage.read_text(uri)) if storage.exists(uri) else None

    def write_record(self, record: dict) -> None:
        self.write_text(self.RECORD, json.dumps(record, indent=2))

    def write_text(self, name: str, text: str) -> None:
        storage.write_text(self.path(name), text)


def checkpoint_uri(storage_path: str, checkpoint) -> str | None:
    """The URI of a Ray Train checkpoint (s3:// when the run stores checkpoints there); None without one."""
    if checkpoint is None:
        return None
    return f"s3://{checkpoint.path}" if storage.is_s3(storage_path) else checkpoint.path


def copy_checkpoint_subdir(checkpoint, subdir: str, local_dir: str) -> None:
    """Copy one folder of a (possibly remote) Ray checkpoint without downloading its optimizer state."""
    import pyarrow.fs as pafs

    if checkpoint is None:
        raise RuntimeError("training produced no checkpoint; check the worker logs above")
    os.makedirs(local_dir, exist_ok=True)
    pafs.copy_files(f"{checkpoint.path}/{subdir}", local_dir, source_filesystem=checkpoint.filesystem,
                    destination_filesystem=pafs.LocalFileSystem())
