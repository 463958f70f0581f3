"""The tracking server going away mid-training (slow tier, the real local stack): MLflow is stopped while
`jobs.train` steps and started again; training keeps stepping, the run ends FINISHED with its final step's
metrics, and the drafter registered after the outage loads."""
from __future__ import annotations

import os
import time

import pytest

from tests.integration.test_train import finish_train_job, stack_job, start_train_job, tiny_rollouts  # noqa: F401

pytestmark = [pytest.mark.integration, pytest.mark.slow]
STEPS = 400  # ~9 steps/s here: training outlasts the ~25 s outage


def wait_for_loss_step(client, experiment: str, run_name: str, at_least: int, timeout_s: float = 300):
    """The run's id once its `loss` history reaches step `at_least` (training is under way)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        exp = client.get_experiment_by_name(experiment)
        runs = client.search_runs([exp.experiment_id], f"tags.mlflow.runName = '{run_name}'") if exp else []
        if runs and any(m.step >= at_least for m in client.get_metric_history(runs[0].info.run_id, "loss")):
            return runs[0].info.run_id
        time.sleep(0.5)
    raise AssertionError(f"run {run_name} logged no loss at step >= {at_least} within {timeout_s} s")


@pytest.mark.timeout(900)
def test_tracking_down_training_keeps_stepping_and_the_run_finishes(local_stack, tiny_rollouts, tmp_path):
    from mlflow import MlflowClient

    from dspark.devstack import stack
    from dspark.io.drafter_source import load_drafter_ref
    from dspark.models.target import load_target

    cfg = stack_job(tiny_rollouts, tmp_path, **{"run_name": "test-tracking-down", "fault": None,
                                                "optim.max_steps": STEPS, "checkpoint.every_steps": STEPS,
                                                "tracking.registered_model": "test-tracking-down"})
    job = start_train_job(cfg, local_stack, tmp_path)
    try:
        client = MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])
        run_id = wait_for_loss_step(client, "test-train", "test-tracking-down", at_least=3)
        stack_cfg = stack.StackConfig.from_env()
        stack.stop_record(stack_cfg, stack.read_record(stack_cfg, "mlflow"))  # the tracking server goes away
        down_at, down_wall = time.monotonic(), time.time()
        time.sleep(20)
        assert job.poll() is None, "training is still running while MLflow is down"
        up_wall = time.time()
        stack.up(stack_cfg, say=lambda msg: None, services=("s3", "mlflow"))
        outage_s = time.monotonic() - down_at
    except BaseException:
        job.kill()
        raise
    finish_train_job(job, 600)  # asserts it succeeded (killed if it hangs)
    assert outage_s >= 20
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(run_id, "loss")
    steps = sorted(m.step for m in history)
    assert steps[-1] == STEPS, "the final step's metrics reached the server after it came back"
    assert len(steps) == len(set(steps)) and steps[0] == 1
    # training kept stepping while the server was down: steps taken then were buffered and written after
    def rate(lo_ms: float, hi_ms: float) -> float | None:  # steps per second between two wall times
        times = sorted(m.timestamp for m in history if lo_ms < m.timestamp < hi_ms)
        return (len(times) - 1) / ((times[-1] - times[0]) / 1000) if len(times) > 2 else None

    during = [m.step for m in history if down_wall * 1000 + 2000 < m.timestamp < up_wall * 1000]
    before, while_down = rate(0, down_wall * 1000), rate(down_wall * 1000 + 2000, up_wall * 1000)
    print(f"loss points: {len(steps)} of {STEPS}; {len(during)} steps during the {outage_s:.0f} s outage; "
          f"steps/s before {before:.2f}, during {while_down:.2f} ({while_down / before:.2f}x)")
    assert len(during) >= 10, (len(during), steps)
    assert while_down >= 0.5 * before, (while_down, before)  # no stall; a loose bound: timings are noisy
    version = client.get_model_version_by_alias("test-tracking-down", "trained")
    assert version.run_id == run_id
    drafter = load_drafter_ref("models:/test-tracking-down@trained", load_target("tiny"))
    assert drafter.config.algo == "dspark"  # the checkpoint registered after the outage loads whole
