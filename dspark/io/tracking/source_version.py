"""The source commit a run records (MLflow shows it as the run's source version)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

GIT_COMMIT_ENV = "DSPARK_GIT_COMMIT"
GIT_COMMIT_TAG = "mlflow.source.git.commit"  # the tag MLflow's UI shows as the run's source version


def git_commit() -> str | None:
    """The source commit: $DSPARK_GIT_COMMIT (set by launchers at submission: a Ray job's uploaded
    working_dir and the image have no .git), else `git rev-parse HEAD` of this checkout (+ "-dirty"
    when it has uncommitted changes), else None."""
    commit = os.environ.get(GIT_COMMIT_ENV, "").strip()
    if commit:
        return commit
    root = Path(__file__).resolve().parents[3]  # the checkout (dspark/io/tracking/source_version.py)
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if sha.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def submission_env() -> dict[str, str]:
    """Env vars a launcher adds to a job's runtime env so the job can record its provenance."""
    commit = git_commit()
    return {GIT_COMMIT_ENV: commit} if commit else {}
