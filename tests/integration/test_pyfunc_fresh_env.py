"""The registered drafter is a portable MLflow model (slow tier): in a fresh virtual environment holding only
the model's declared requirements (pinned packages; dspark itself travels in the model as `code_paths`),
`mlflow.pyfunc.load_model("models:/...")` loads it and `predict` drafts a block."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.unit.io.tracking.test_mlflow_drafter_model import store, trained_run  # noqa: F401 (fixture)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.timeout(1200)
def test_pyfunc_model_loads_in_a_fresh_env_with_only_its_requirements(store, tmp_path):  # noqa: F811
    import mlflow

    from dspark.io import tracking
    from dspark.io.tracking import registry
    from dspark.models.target import load_target

    _, ckpt, run_id = trained_run(load_target("tiny"), tmp_path, tau=2.0)
    version = registry.publish_drafter(run_id, "fresh-env-drafter", ckpt, ["trained"])
    tracking.end_run()
    uri = f"models:/fresh-env-drafter/{version}"
    requirements = mlflow.pyfunc.get_model_dependencies(uri)
    env = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
    py = str(env / "bin" / "python")
    install = subprocess.run([py, "-m", "pip", "install", "--quiet", "-r", requirements], capture_output=True,
                             text=True, timeout=1000)
    assert install.returncode == 0, install.stderr[-3000:]
    listed = subprocess.run([py, "-m", "pip", "list", "--format=json"], capture_output=True, text=True, check=True)
    assert "dspark" not in {p["name"].lower() for p in json.loads(listed.stdout)}, "dspark is not installed there"
    script = f"""
import json, mlflow
model = mlflow.pyfunc.load_model({uri!r})
(out,) = model.predict({{"prompt_ids": [[1, 2, 3, 4]]}})
import dspark
print(json.dumps({{"dspark": dspark.__file__, "drafts": len(out["draft_tokens"])}}))
"""
    done = subprocess.run([py, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={"MLFLOW_TRACKING_URI": mlflow.get_tracking_uri(), "HOME": str(tmp_path),
                               "DSPARK_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["drafts"] == 4 and str(env) not in result["dspark"]  # the model's own copy of the code
