"""Shared pytest fixtures.

`local_stack` (session scope, integration): a real SeaweedFS S3 + MLflow + Ray stack on test ports
in a temporary state dir, its client env applied to os.environ for the session (restored after).
Run tests that use it under `flock /tmp/dspark-heavy.lock`.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

# Inductor builds in tests (here and in the processes tests spawn) take the CPU's vector ISAs from its flags
# (/proc/cpuinfo) without the probe that compiles a test library per ISA and loads it in a fresh interpreter:
# measured ~8 s per process that compiles, on a 2-core Xeon. The product keeps the probe.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")
import torch  # noqa: E402  (after the environment it reads)

# Tiny-model tests are overhead-bound: one intra-op thread is much faster on 2 shared cores
# (measured ~50x on micro-model forwards when other processes load the machine).
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Tests marked heavy (each over ~4.5 s) first, each group in its modules' order: with `--dist load
    --maxschedchunk 1` (`make test`'s unit run) each worker takes the next test when it is free, so the long ones
    start at once and the run ends on short ones, not on a worker still busy with a 50 s test."""
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)

# Test ports: every derived port (SeaweedFS internals, Ray client/agent) differs from a default
# stack's and from the ports tests/test_stack.py uses for its own stack.
LOCAL_STACK_PORTS = {"DSPARK_S3_PORT": "8533", "DSPARK_MLFLOW_PORT": "5200",
                     "DSPARK_RAY_PORT": "6579", "DSPARK_DASHBOARD_PORT": "8465"}


@dataclass
class LocalStack:
    state_dir: Path
    env: dict[str, str]      # the full env.sh contents

    @property
    def ray_gcs_address(self) -> str:
        """For in-process `ray.init(address=...)`: RAY_ADDRESS holds the dashboard's HTTP address,
        which ray.init() rejects, so the fixture leaves RAY_ADDRESS out of os.environ."""
        return self.env["DSPARK_RAY_GCS_ADDRESS"]


@pytest.fixture(scope="session")
def local_stack():
    from dspark.devstack import stack

    state_dir = Path(tempfile.mkdtemp(prefix="dspark-stack-"))
    with pytest.MonkeyPatch.context() as patch:
        for key, value in LOCAL_STACK_PORTS.items():
            patch.setenv(key, value)
        patch.setenv("DSPARK_STATE_DIR", str(state_dir))
        cfg = stack.StackConfig.from_env()
        try:
            env = stack.up(cfg, say=lambda msg: None)
        except BaseException:
            shutil.rmtree(state_dir, ignore_errors=True)
            raise
        try:
            for key, value in env.items():
                if key != "RAY_ADDRESS":  # see LocalStack.ray_gcs_address
                    patch.setenv(key, value)
            patch.delenv("RAY_ADDRESS", raising=False)
            yield LocalStack(state_dir=state_dir, env=env)
        finally:
            stack.down(cfg, say=lambda msg: None)
            shutil.rmtree(state_dir, ignore_errors=True)
            if os.path.isdir(cfg.ray_temp_dir()):
                shutil.rmtree(cfg.ray_temp_dir(), ignore_errors=True)
