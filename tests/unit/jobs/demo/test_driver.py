"""The demo driver (jobs/demo/driver.py, `python -m jobs.demo`): its checks and stage table (fast), and the
smoke profile end to end on the `tiny` target (slow, integration: starts the local stack and submits every
stage as a Ray job).
"""

from __future__ import annotations



import json


import socket





import pytest

from jobs.demo import driver, runner
from tests.job_modules import job_config_model
from tests.paths import REPO



ROOT = REPO



@pytest.mark.parametrize("profile", sorted(runner.PROFILES))
def test_every_stage_config_of_every_profile_exists(profile):
    prof = runner.PROFILES[profile]
    configs = [runner.STAGE_CONFIG[s].format(target=prof.target) for s in ("generate", "calibrate", "evaluate", "serve")]
    configs += [runner.STAGE_CONFIG["train"].format(target=prof.target, algo=a) for a in prof.algos]
    missing = [c for c in configs if not (ROOT / c).exists()]
    assert not missing, f"profile {profile}: stage configs missing: {missing}"
    assert set(runner.STAGE_CONFIG) == set(runner.STAGE_WIRING) == set(runner.STAGES)
    assert set(prof.overrides) <= set(runner.STAGES)



def test_a_cpu_without_native_bf16_gets_the_smaller_budget_and_is_told(monkeypatch, capsys):
    """The default profile's bf16 budget would overrun its time several-fold where bf16 is emulated: there
    its no_native_bf16 budget is applied after the profile's own overrides (a later --set wins), said
    before anything runs; with native bf16 (or a profile without such a budget) nothing changes."""
    import dspark.models.precision as precision

    default = runner.PROFILES["default"]
    assert default.no_native_bf16 is not None and runner.PROFILES["smoke"].no_native_bf16 is None
    monkeypatch.setattr(precision, "bf16_is_native", lambda device: True)
    assert runner.machine_profile(default) is default and capsys.readouterr().out == ""
    monkeypatch.setattr(precision, "bf16_is_native", lambda device: False)
    slow = runner.machine_profile(default)
    assert "no native bf16" in capsys.readouterr().out
    assert slow.description == default.no_native_bf16.description and slow.no_native_bf16 is None
    for stage, extra in default.no_native_bf16.overrides.items():
        assert slow.budget(stage) == default.budget(stage) + extra  # applied last: its keys win
    assert runner.machine_profile(runner.PROFILES["smoke"]) is runner.PROFILES["smoke"]


@pytest.mark.parametrize("native_bf16", [True, False])
@pytest.mark.parametrize("profile", sorted(runner.PROFILES))
def test_stage_overrides_validate_against_each_job_config(profile, native_bf16):
    """Budget + wiring overrides (placeholders filled with dummy values) are accepted by each job's
    config model, so the demo cannot die on an unknown key after minutes of earlier stages; also the
    budget a CPU without native bf16 gets."""
    from dspark.config import load_config

    prof = runner.PROFILES[profile].for_this_machine(native_bf16)
    dummy = {"rollouts": "s3://dspark/x/rollouts", "experiment": "e", "run_name": "r", "checkpoints": "s3://dspark/c",
             "drafter": "models:/m/1", "calibrated": "s3://dspark/x/cal", "eval_dir": "s3://dspark/e",
             "drafters": json.dumps([{"name": "dspark", "ref": "models:/m/1"}]), "serve_host": "127.0.0.1",
             "serve_port": "8000", "alias": "demo-x"}
    for stage in runner.STAGE_CONFIG:
        for algo in (prof.algos if stage == "train" else (None,)):
            config = runner.STAGE_CONFIG[stage].format(target=prof.target, algo=algo)
            model = job_config_model(stage)
            overrides = prof.budget(stage) + runner.fill(runner.STAGE_WIRING[stage], dummy)
            load_config(model, ROOT / config, overrides)




def test_job_command_is_the_cluster_command():
    d = runner.Demo(profile=runner.PROFILES["smoke"], state_dir=ROOT / ".dspark",
                  env={"RAY_ADDRESS": "http://127.0.0.1:8265"})
    cmd = runner.job_command(d, "demo-smoke-train-abc", "jobs.train", "configs/train/tiny-dspark.yaml",
                           ["optim.max_steps=3", "run_name=x"])
    assert cmd[:3] == ["ray", "job", "submit"]
    sep = cmd.index("--")
    assert cmd[sep + 1:sep + 6] == ["python", "-m", "jobs.train", "--config", "configs/train/tiny-dspark.yaml"]
    assert cmd[sep + 6:] == ["--set", "optim.max_steps=3", "--set", "run_name=x"]
    head = cmd[:sep]
    assert head[head.index("--runtime-env") + 1] == str(d.runtime_env_file)
    assert head[head.index("--working-dir") + 1] == "."
    assert head[head.index("--address") + 1] == "http://127.0.0.1:8265"



def test_last_json_object_and_fill():
    text = "progress 10%\n{\"not\": json\n{\"rows_out\": 5}\n------\nJob 'x' succeeded\n"
    from dspark.devstack.processes import last_json_object

    assert last_json_object(text.splitlines()) == ({"rows_out": 5}, False)  # trailing non-JSON lines: skipped
    assert last_json_object(["no json here"]) == (None, False)
    assert runner.fill(["output={out}/r", "n={n}"], {"out": "s3://b", "n": "3"}) == ["output=s3://b/r", "n=3"]



def test_stage_key_follows_config_budget_and_upstream():
    config = runner.STAGE_CONFIG["generate"].format(target="tiny")
    if not (ROOT / config).exists():
        pytest.fail(f"{config} missing (see test_every_stage_config_of_every_profile_exists)")
    key = runner.stage_key("jobs.generate", config, ["a=1"], ["up"])
    assert key == runner.stage_key("jobs.generate", config, ["a=1"], ["up"])
    assert key != runner.stage_key("jobs.generate", config, ["a=2"], ["up"])
    assert key != runner.stage_key("jobs.generate", config, ["a=1"], ["other-upstream"])
    with pytest.raises(runner.DemoError, match="does not exist"):
        runner.stage_key("jobs.generate", "configs/generate/nope.yaml", [], [])



def test_busy_port_fails_early_with_recovery_hint(tmp_path, monkeypatch):
    from dspark.devstack import stack

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # only this port matters (a stack running on this machine must not change the outcome)
        monkeypatch.setattr(stack.StackConfig, "service_ports",
                            lambda self, service: {"server": port} if service == "mlflow" else {})
        cfg = stack.StackConfig(state_dir=tmp_path)
        with pytest.raises(runner.DemoError, match=rf"port {port} .*dspark stack down.*rerun"):
            driver.check_stack_state(cfg)



def test_short_disk_fails_early(tmp_path):
    prof = runner.PROFILES["smoke"]
    huge = prof.model_copy(update={"min_free_gb": 10**9})
    with pytest.raises(runner.DemoError, match="GiB free.*rerun"):
        driver.check_disk(runner.Demo(profile=huge, state_dir=tmp_path / ".dspark"))



def test_unhealthy_stack_is_reported_as_bad_state(tmp_path, monkeypatch):
    from dspark.devstack import stack

    cfg = stack.StackConfig(state_dir=tmp_path)
    fake = {s: {"pid": 1, "url": cfg.url(s), "running": True, "healthy": s != "mlflow", "stale_pid_file": False}
            for s in stack.SERVICES}
    monkeypatch.setattr(stack, "status", lambda _cfg=None: fake)
    with pytest.raises(runner.DemoError, match="bad state: mlflow.*dspark stack down"):
        driver.check_stack_state(cfg)



def test_main_prints_one_line_error_and_exit_code(monkeypatch, capsys):
    def fail(*_args):
        raise runner.DemoError("port 5000 is in use; run `dspark stack down`, then rerun the demo")

    monkeypatch.setattr(driver, "run", fail)
    assert driver.main(["--profile", "smoke"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: port 5000 is in use; run `dspark stack down`, then rerun the demo"]



def test_profiles_are_yaml_and_reject_unknown_keys_and_stages(tmp_path):
    assert {"smoke", "default", "full"} <= set(runner.PROFILES)
    assert runner.PROFILES["smoke"].target == "tiny" and runner.PROFILES["smoke"].name == "smoke"
    (tmp_path / "bad.yaml").write_text("description: x\ntarget: tiny\nalgos: [dspark]\nmin_free_gb: 1\n"
                                       "chat_max_tokens: 8\nbudget_typo: 3\n")
    with pytest.raises(Exception, match="budget_typo"):
        runner.load_profiles(tmp_path)
    (tmp_path / "bad.yaml").write_text("description: x\ntarget: tiny\nalgos: [dspark]\nmin_free_gb: 1\n"
                                       "chat_max_tokens: 8\noverrides: {trian: [a=1]}\n")
    with pytest.raises(ValueError, match="trian"):
        runner.load_profiles(tmp_path)
