"""The demo's five stages, each one Ray job (`jobs.demo.runner.run_job_stage`): generate rollouts ->
train drafter(s) -> calibrate -> evaluate vs target-only -> deploy the Serve endpoint. Each stage
wires its inputs and outputs under s3://dspark/demo/<profile>/ and returns the runner's record with
an `outputs` dict.
"""
from __future__ import annotations

import json
import os

from dspark.io.http import wait_healthy
from jobs.demo.runner import (SERVE_HOST, SERVE_PORT, STAGE_CONFIG, STAGE_WIRING, Demo, DemoError, endpoint_healthy,
                              endpoint_url, fill, run_job_stage, stage_key)


def stage_args(stage: str, demo: Demo, **names) -> tuple[str, list[str]]:
    config = STAGE_CONFIG[stage].format(target=demo.profile.target, **names)
    return config, demo.profile.budget(stage)


def generate_stage(demo: Demo) -> dict:
    from dspark.io import storage

    config, budget = stage_args("generate", demo)
    key = stage_key("jobs.generate", config, budget, [demo.profile.target])
    rollouts = f"{demo.out}/rollouts/{key}"
    wiring = fill(STAGE_WIRING["generate"], {"rollouts": rollouts, "experiment": demo.experiment,
                                             "run_name": f"generate-demo-{demo.profile.name}-{key[:8]}"})
    done = run_job_stage(demo, "generate", "generate rollouts (Ray Data, target answers the prompts)",
                         "jobs.generate", config, budget, wiring, key,
                         lambda m: bool(storage.list_files(rollouts)))
    done["outputs"] = {"rollouts": rollouts}
    return done


def train_stage(demo: Demo, algo: str, rollouts_key: str, rollouts: str) -> dict:
    config, budget = stage_args("train", demo, algo=algo)
    key = stage_key("jobs.train", config, budget, [rollouts_key])
    names = {"run_name": f"demo-{demo.profile.name}-{algo}-{key[:8]}", "rollouts": rollouts,
             "checkpoints": f"{demo.out}/checkpoints", "experiment": demo.experiment,
             "alias": f"demo-{demo.profile.name}"}
    wiring = fill(STAGE_WIRING["train"], names)
    done = run_job_stage(demo, f"train-{algo}", f"train {algo} (Ray Train + DeepSpeed ZeRO, online target features)",
                         "jobs.train", config, budget, wiring, key, lambda m: registered_version(m) is not None)
    model = registered_version(done)
    if model is None:
        raise DemoError(f"train-{algo} finished without registering a drafter (its last log line is not the "
                        f"summary JSON); see {demo.local_dir / 'logs' / f'train-{algo}.log'}")
    done["outputs"] = {"drafter": model, "checkpoints": f"{names['checkpoints']}/{names['run_name']}"}
    return done


def registered_version(stage: dict) -> str | None:
    """`models:/<name>/<version>` of the drafter a train job registered (from its summary line), if
    that version is still in the model registry."""
    reg = (stage.get("summary") or {}).get("registered_model") or {}
    if not reg.get("name") or not reg.get("version"):
        return None
    from dspark.io.tracking import registry

    if not registry.model_version_exists(reg["name"], reg["version"]):
        return None  # registry wiped or unreachable: the stage must run again
    return f"models:/{reg['name']}/{reg['version']}"


def calibrate_stage(demo: Demo, drafter: str, upstream_key: str, rollouts: str) -> dict:
    from dspark.io import storage

    config, budget = stage_args("calibrate", demo)
    key = stage_key("jobs.calibrate", config, budget, [upstream_key])
    output = f"{demo.out}/calibration/{key}"
    calibrated = f"{output}/drafter"  # jobs.calibrate writes the new drafter there (source untouched)
    wiring = fill(STAGE_WIRING["calibrate"], {"drafter": drafter, "rollouts": rollouts, "calibrated": output,
                                              "experiment": demo.experiment,
                                              "run_name": f"calibrate-demo-{demo.profile.name}-{key[:8]}"})
    done = run_job_stage(demo, "calibrate", "calibrate confidences (sequential temperature scaling, held-out rollouts)",
                         "jobs.calibrate", config, budget, wiring, key,
                         lambda m: storage.exists(f"{calibrated}/config.json"))
    done["outputs"] = {"drafter": calibrated, "report": f"{output}/report.md"}
    return done


def evaluate_stage(demo: Demo, drafters: dict[str, str], upstream_keys: list[str]) -> dict:
    from dspark.io import storage

    config, budget = stage_args("evaluate", demo)
    key = stage_key("jobs.evaluate", config, budget, upstream_keys)
    eval_dir = f"{demo.out}/eval/{key}"
    drafter_list = json.dumps([{"name": name, "ref": ref} for name, ref in drafters.items()], separators=(",", ":"))
    wiring = fill(STAGE_WIRING["evaluate"], {"drafters": drafter_list, "eval_dir": eval_dir,
                                             "experiment": demo.experiment,
                                             "run_name": f"evaluate-demo-{demo.profile.name}-{key[:8]}"})
    done = run_job_stage(demo, "evaluate", "evaluate: speculative vs target-only decoding on the benchmarks",
                         "jobs.evaluate", config, budget, wiring, key,
                         lambda m: storage.exists(f"{eval_dir}/results.json"))
    done["outputs"] = {"results": f"{eval_dir}/results.json"}
    done["results"] = json.loads(storage.read_text(f"{eval_dir}/results.json"))
    return done


def serve_stage(demo: Demo, drafter: str, upstream_key: str) -> dict:
    config, budget = stage_args("serve", demo)
    key = stage_key("jobs.serve", config, budget, [upstream_key])
    deployed_file = demo.state_dir / "demo" / "serving.json"  # what the demo last deployed on this head
    wiring = fill(STAGE_WIRING["serve"], {"drafter": drafter, "serve_host": SERVE_HOST, "serve_port": str(SERVE_PORT)})

    def still_serving(_marker) -> bool:
        deployed = json.loads(deployed_file.read_text()) if deployed_file.exists() else {}
        return deployed.get("key") == key and endpoint_healthy()

    done = run_job_stage(demo, "serve", "deploy the Ray Serve endpoint (draft-plus-verify engine, OpenAI API)",
                         "jobs.serve", config, budget, wiring, key, still_serving)
    wait_endpoint(timeout_s=300)
    deployed_file.write_text(json.dumps({"key": key, "profile": demo.profile.name, "drafter": drafter}))
    done["outputs"] = {"endpoint": endpoint_url() + "/v1"}
    return done


def wait_endpoint(timeout_s: float) -> None:
    try:
        wait_healthy(endpoint_url() + "/healthz", timeout_s, interval_s=2.0)
    except TimeoutError as err:
        raise DemoError(f"the Serve endpoint did not become healthy: {err}; see `serve status` and the Ray "
                        f"dashboard ({os.environ.get('RAY_ADDRESS', '')}), then rerun the demo") from None
