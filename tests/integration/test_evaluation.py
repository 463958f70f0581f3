"""Evaluation core (dspark/eval/evaluate.py), drafter references (dspark/drafter_source.py) and the
evaluation job (jobs/evaluate.py) on the tiny target."""

from __future__ import annotations

import json




import pytest







from tests.unit.eval.test_evaluate import GAMMA, job_config, tiny, tiny_drafter, two_drafters, write_jsonl  # noqa: F401 (shared helpers and fixtures)



@pytest.mark.slow
@pytest.mark.integration
def test_evaluate_job_on_two_drafters_writes_results_and_logs_plots(tmp_path, two_drafters, monkeypatch, capsys):
    """Ray workers (2) and the in-process path (0) give the same τ; results.json holds both drafters,
    the ratios and the sweep; MLflow gets metrics, results.json and the PNG plots."""
    import mlflow
    import ray

    from jobs.evaluate import run

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("DSPARK_STATE_DIR", str(tmp_path / "state"))
    try:
        on_ray = run(job_config(tmp_path, two_drafters, num_workers=2))
    finally:
        ray.shutdown()
    report = capsys.readouterr().out
    in_process = run(job_config(tmp_path, two_drafters, num_workers=0))

    saved = json.loads((tmp_path / "out2" / "results.json").read_text())
    assert set(saved["drafters"]) == {"dspark", "dflash"} and set(saved["ratios"]) == {"dspark/dflash"}
    assert set(saved["drafters"]["dspark"]["per_benchmark"]) == {"gsm8k", "mt-bench"}
    assert any("humaneval.jsonl:1" in w for w in saved["warnings"])  # the broken file is reported, not fatal
    assert saved["ratios"]["dspark/dflash"]["per_benchmark"]["gsm8k"]["tau"] is not None
    assert set(saved["threshold_sweep"]["dspark"]) == {"math", "chat"}
    for name in ("dspark", "dflash"):
        for bench, s in on_ray["drafters"][name]["per_benchmark"].items():
            assert 1 <= s["tau"] <= GAMMA + 1 and s["speedup"] > 0
            assert s["tau"] == in_process["drafters"][name]["per_benchmark"][bench]["tau"]
            assert s["rounds"] == in_process["drafters"][name]["per_benchmark"][bench]["rounds"]
    assert "| dspark/dflash |" in report and "τ (accepted + bonus" in report

    client = mlflow.MlflowClient()
    run_info = client.get_run(on_ray["mlflow_run_id"])
    gsm8k = on_ray["drafters"]["dspark"]["per_benchmark"]["gsm8k"]
    assert run_info.data.metrics["dspark.gsm8k.tau"] == pytest.approx(gsm8k["tau"])
    assert "dspark/dflash.math.tau" in run_info.data.metrics
    artifacts = {a.path for a in client.list_artifacts(run_info.info.run_id)}
    plots = {a.path for a in client.list_artifacts(run_info.info.run_id, "plots")}
    assert {"results.json", "report.md", "config.yaml"} <= artifacts
    assert {"plots/tau_by_benchmark.png", "plots/cond_accept_by_position.png", "plots/threshold_sweep.png"} <= plots
    series = client.get_metric_history(run_info.info.run_id, "dspark.pooled.cond_accept_by_position")
    pooled = on_ray["drafters"]["dspark"]["pooled_positions"]["cond_accept"]
    by_step = {m.step: m.value for m in series}  # x = draft position; positions never reached are skipped
    assert by_step and by_step == pytest.approx({int(k): v for k, v in pooled.items() if v is not None})
    inputs = {d.dataset.name: {t.key: t.value for t in d.tags} for d in run_info.inputs.dataset_inputs}
    assert set(inputs) == {"gsm8k", "mt-bench"} and inputs["gsm8k"]["mlflow.data.context"] == "evaluation"
