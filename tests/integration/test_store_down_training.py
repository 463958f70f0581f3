"""The object store going away under a training run (slow tier, the real local stack): SeaweedFS is stopped
for 20 s while `jobs.train` steps and writes checkpoints to it, then started again. The run waits for the store
(its checkpoint upload or data read blocks and retries: measured here, no step was taken while it was down)
rather than failing, finishes without a restart, its last checkpoint is whole, and the drafter registered after
the outage loads."""
from __future__ import annotations

import json
import os
import time

import pytest

from tests.integration.test_tracking_down import wait_for_loss_step
from tests.integration.test_train import finish_train_job, stack_job, start_train_job, tiny_rollouts  # noqa: F401

pytestmark = [pytest.mark.integration, pytest.mark.slow]
STEPS = 400


@pytest.mark.timeout(900)
def test_store_down_under_training_checkpoints_stay_whole_and_the_run_finishes(local_stack, tiny_rollouts, tmp_path):
    from mlflow import MlflowClient

    from dspark.devstack import stack
    from dspark.io import storage
    from dspark.io.drafter_source import load_drafter_ref
    from dspark.models.target import load_target

    cfg = stack_job(tiny_rollouts, tmp_path, **{"run_name": "test-store-down", "fault": None,
                                                "optim.max_steps": STEPS, "checkpoint.every_steps": 50,
                                                "tracking.registered_model": "test-store-down"})
    job = start_train_job(cfg, local_stack, tmp_path)
    try:
        client = MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])
        run_id = wait_for_loss_step(client, "test-train", "test-store-down", at_least=3)
        stack_cfg = stack.StackConfig.from_env()
        stack.stop_record(stack_cfg, stack.read_record(stack_cfg, "s3"))  # the object store goes away
        down_wall = time.time()
        time.sleep(20)
        up_wall = time.time()
        stack.up(stack_cfg, say=lambda msg: None, services=("s3", "mlflow"))
    except BaseException:
        job.kill()
        raise
    summary = finish_train_job(job, 800)[0]
    state = json.loads(storage.read_text(storage.join(summary["checkpoint"], "train_state.json")))
    steps = {m.step: m.timestamp for m in client.get_metric_history(run_id, "loss")}
    last_before = max((s for s, t in steps.items() if t < down_wall * 1000), default=0)
    during = sorted(s for s, t in steps.items() if down_wall * 1000 + 1000 < t < up_wall * 1000)
    print(json.dumps({"final_step": summary["metrics"]["step"], "restarts": state.get("restarts"),
                      "last_step_before_the_outage": last_before, "steps_while_down": len(during)}))
    assert last_before < STEPS, "the outage came while the run was still training"
    assert summary["metrics"]["step"] == STEPS
    assert client.get_run(run_id).info.status == "FINISHED"
    drafter = load_drafter_ref("models:/test-store-down@trained", load_target("tiny"))
    assert drafter.config.algo == "dspark"
