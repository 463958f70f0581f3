"""jobs/demo/flywheel.py without the stack: its traffic, its split control and the serve config it deploys."""
from __future__ import annotations

from dspark.config import load_config
from dspark.flywheel.capture import row_id_in, split_of
from jobs.demo.flywheel import REPO, FlywheelDemoConfig, json_prompts, math_prompts, serve_config


def test_traffic_is_deterministic_and_the_request_ids_fix_the_split():
    assert json_prompts(5, 0) == json_prompts(5, 0) and len(set(json_prompts(20, 0))) > 15
    assert all('"name", "age", "job" and "city"' in p for p in json_prompts(3, 0))
    assert len(math_prompts(4)) == 4 and all(isinstance(p, str) and p for p in math_prompts(4))
    for split in ("train", "holdout"):
        rid = row_id_in(split, "json7", 0.25)
        assert rid.startswith("json7-") and split_of(rid, 0.25) == split


def test_the_deployed_config_captures_both_domains_with_the_demo_holdout():
    cfg = load_config(FlywheelDemoConfig, REPO / "configs" / "flywheel" / "smollm2-demo.yaml")
    serve = serve_config(cfg)
    capture = serve.flywheel.capture
    assert capture.enabled and set(capture.domains) == {"math", "json"} and capture.holdout_fraction == cfg.holdout
    assert serve.model.drafter == "models:/smollm2-135m-flywheel@serving" and serve.engine.scheduler.mode == "fixed"
