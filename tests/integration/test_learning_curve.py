"""recipes/learning_curve/ end to end on the tiny target: every phase resumes from its output folder
(committed rollout chunks, feature-cache shards, trained points and estimates are not redone), the
points are nested prefixes, and the report holds the fields the planner and the README read."""
import json
import os

import pytest

from recipes import learning_curve as lc
from recipes.learning_curve.shared import committed_rows

pytestmark = [pytest.mark.integration]  # ~30 s: in `make test`


def run(phase, out, *extra):
    lc.main([phase, "--profile", "tiny", "--out", str(out), *extra])


def test_phases_resume_and_report(tmp_path):
    out = tmp_path / "lc"
    run("rollouts", out, "--limit-prompts", "6")
    commits = sorted((out / "rollouts-train" / "_commits").glob("*.json"))
    assert len(commits) == 2 * 2  # 6 prompts x 2 passes in chunks of 4 -> 4 chunks
    stamp = {p.name: p.stat().st_mtime_ns for p in commits}
    os.remove(commits[-1])  # a chunk lost to a kill: only it is regenerated on the rerun
    run("rollouts", out, "--limit-prompts", "6")
    again = sorted((out / "rollouts-train" / "_commits").glob("*.json"))
    assert [p.name for p in again] == [p.name for p in commits]
    assert all(p.stat().st_mtime_ns == stamp[p.name] for p in again[:-1])
    rows = committed_rows(out / "rollouts-train")
    assert {r["prompt_id"].rsplit("~", 1)[1] for r in rows} == {"p0", "p1"}  # two passes, ids suffixed

    run("train", out)
    points = sorted((out / "points").glob("*/dspark/train.json"))
    assert len(points) >= 2
    sizes = [json.loads(p.read_text())["rows"] for p in points]
    assert sizes == sorted(sizes) and sizes[-1] == len(rows)  # nested prefixes, the largest = every row
    stamp = {p: p.stat().st_mtime_ns for p in points}
    run("train", out)  # resume: nothing retrained
    assert all(p.stat().st_mtime_ns == stamp[p] for p in points)

    run("baselines", out)
    run("evaluate", out)
    run("epochs", out, "--epochs", "2")  # the largest point for 2 passes, then its estimate
    again = json.loads((out / "epochs" / "e02" / "dspark" / "train.json").read_text())
    assert again["epochs"] == 2 and again["rows"] == len(rows)
    run("decode", out)
    report = lc.cmd_report(lc.parse_args(["report", "--profile", "tiny", "--out", str(out),
                                                  "--results", str(tmp_path / "results")]), lc.PROFILES["tiny"])
    assert len(report["points"]) == len(points) and (tmp_path / "results" / report["plot"]).stat().st_size > 0
    for p in report["points"]:
        lo, hi = p["expected_tau_ci95"]
        assert 1.0 <= lo <= p["expected_tau"] <= hi
    assert set(report["baselines"]) == {"dspark", "dflash", "dflash_tv", "eagle3"}
    for algo, b in report["baselines"].items():
        assert b["tau"] >= 1.0 and b["speedup_batch1"] > 0 and len(b["tau_ci95"]) == 2
    (series,) = report["epochs_series"]
    largest = max(p.name for p in (out / "points").iterdir())
    better = series["expected_tau"] > report["points"][-1]["expected_tau"]  # the committed drafter: the best
    assert report["drafter"]["source"] == ("epochs/e02" if better else f"points/{largest}") + "/dspark/drafter"
    assert series["epochs"] == 2 and 1.0 <= series["expected_tau_ci95"][0] <= series["expected_tau"]
    assert series["decoded"]["tau"] >= 1.0 and series["decoded_thr"]["speedup_batch1"] > 0
    greedy = report["decode"]["by_temperature"]["t0"]
    assert {"target", "dspark", "dspark_g3", "dspark_thr"} <= set(greedy)
    assert all(greedy[m]["tau"] >= 1.0 for m in greedy if m != "target")

    # continuing a saved drafter with another peak learning rate: its own folder, the passes add up
    run("epochs", out, "--epochs", "1", "--init-from", "e02", "--lr", "5e-4")
    cont = out / "epochs" / "e01-lr0.0005-from-e02" / "dspark"
    trained = json.loads((cont / "train.json").read_text())
    assert trained["init_from"] == "epochs/e02" and trained["lr"] == 5e-4 and trained["epochs"] == 1
    from recipes.learning_curve.report import epoch_entry

    assert epoch_entry(cont)["total_epochs"] == 3 and (cont / "estimate.json").exists()

    # training throughput per (layers, anchors), then two capacities at the same wall-clock budget
    run("sweep", out, "--layers", "1", "2", "--anchors", "4", "16")
    sweep = json.loads((out / "sweep.json").read_text())
    assert [(s["num_layers"], s["anchors_per_seq"]) for s in sweep["settings"]] == [(1, 4), (1, 16), (2, 4), (2, 16)]
    assert sweep["mfu_peak_tflops"] > 0
    for s in sweep["settings"]:
        assert s["tokens_per_s"] > 0 and 0 < s["mfu"] < 1.5 and s["anchors_per_step"] > 0
    by = {(s["num_layers"], s["anchors_per_seq"]): s for s in sweep["settings"]}
    assert by[(1, 16)]["anchors_per_step"] > by[(1, 4)]["anchors_per_step"]  # denser anchors, more blocks
    assert by[(2, 4)]["trainable_params"] > by[(1, 4)]["trainable_params"]
    run("capacity", out, "--layers", "1", "2", "--anchors", "16", "--minutes", "0.05")
    cap = {p.parent.name: json.loads((p / "train.json").read_text())
           for p in sorted((out / "capacity").glob("*/dspark"))}
    assert set(cap) == {"L1-a16-m0.05", "L2-a16-m0.05"}
    for name, t in cap.items():
        assert t["budget_minutes"] == 0.05 and t["steps"] >= 1 and t["probe_step_s"] > 0
        assert t["num_layers"] == int(name[1]) and (out / "capacity" / name / "dspark" / "estimate.json").exists()
        # the budget holds whatever the probe guessed: no step starts past it (at most one step over)
        assert t["stopped_by"] in ("steps", "deadline") and t["wall_s"] <= 3.0 + 2 * t["wall_s"] / t["steps"]
    run("capacity", out, "--layers", "1", "--anchors", "16", "--minutes", "0.05", "--precision", "bf16")
    bf16 = json.loads((out / "capacity" / "L1-a16-m0.05-bf16" / "dspark" / "train.json").read_text())
    assert bf16["precision"] == "bf16" and "bf16" in bf16["mfu_basis"] and bf16["steps"] >= 1
    cap["L1-a16-m0.05-bf16"] = bf16
    # a capacity drafter continued for more passes, in its own shape (1 layer), from its weights
    run("epochs", out, "--epochs", "1", "--layers", "1", "--anchors", "16", "--init-from", "capacity/L1-a16-m0.05")
    cont = out / "epochs" / "e01-L1-a16-from-capacity-L1-a16-m0.05" / "dspark"
    trained = json.loads((cont / "train.json").read_text())
    assert trained["init_from"] == "capacity/L1-a16-m0.05" and trained["num_layers"] == 1
    assert epoch_entry(cont)["total_epochs"] == 1 + cap["L1-a16-m0.05"]["epochs"]
    report = lc.cmd_report(lc.parse_args(["report", "--profile", "tiny", "--out", str(out),
                                          "--results", str(tmp_path / "results")]), lc.PROFILES["tiny"])
    assert [c["folder"] for c in report["capacity_series"]] == [
        "capacity/L1-a16-m0.05", "capacity/L1-a16-m0.05-bf16", "capacity/L2-a16-m0.05"]
    assert all(c["expected_tau"] >= 1.0 and c["mfu"] > 0 for c in report["capacity_series"])
    assert report["training_sweep"]["settings"] == sweep["settings"]


def test_extra_prompt_set_joins_the_training_rows_and_a_drafter_path_continues(tmp_path):
    """`rollouts --extra-prompts F --extra-name N` writes rollouts-train-N (its own resumable plan); every
    training phase then trains on rollouts-train + rollouts-train-N; `epochs --init-from <drafter path>`
    continues a drafter saved anywhere and keeps its draft vocabulary."""
    out = tmp_path / "lc"
    run("rollouts", out, "--limit-prompts", "4", "--passes", "1")
    extra = tmp_path / "extra.jsonl"
    extra.write_text("".join(json.dumps({"turns": [f"Tell me a fact about the number {k}, please."]}) + "\n"
                             for k in range(5)))
    with pytest.raises(SystemExit, match="extra-name"):
        run("rollouts", out, "--extra-prompts", str(extra), "--which", "train")
    run("rollouts", out, "--which", "train", "--extra-prompts", str(extra), "--extra-name", "more", "--passes", "1")
    base, more = committed_rows(out / "rollouts-train"), committed_rows(out / "rollouts-train-more")
    assert len(base) == 4 and len(more) == 5
    assert json.loads((out / "decontamination-more.json").read_text())["kept"] == 5

    run("epochs", out, "--epochs", "1")
    first = json.loads((out / "epochs" / "e01" / "dspark" / "train.json").read_text())
    assert first["rows"] == 9 and json.loads((out / "train-rows.json").read_text())["sets"] == {
        "rollouts-train": 4, "rollouts-train-more": 5}
    assert (out / "features-train-more" / "meta.json").exists()
    # a run that only continued a drafter has no curve: its report writes no (empty) plot
    (tmp_path / "nocurve").mkdir()
    (tmp_path / "nocurve" / "tiny.png").write_bytes(b"stale")
    nocurve = lc.cmd_report(lc.parse_args(["report", "--profile", "tiny", "--out", str(out), "--no-drafter",
                                           "--results", str(tmp_path / "nocurve")]), lc.PROFILES["tiny"])
    assert nocurve["plot"] is None and nocurve["epochs_series"] and not (tmp_path / "nocurve" / "tiny.png").exists()

    # another point recipe in its own folder: its settings reach every point and the report; a rerun
    # with other settings stops instead of counting those points as done
    run("train", out, "--point-epochs", "2", "--layers", "2", "--anchors", "16")
    trained = [json.loads(p.read_text()) for p in sorted((out / "points").glob("*/dspark/train.json"))]
    assert trained and all((t["epochs"], t["num_layers"], t["anchors_per_seq"]) == (2, 2, 16) for t in trained)
    with pytest.raises(SystemExit, match="other settings: epochs 2 .saved. vs 1"):
        run("train", out, "--layers", "2", "--anchors", "16")
    run("evaluate", out)
    curve = lc.cmd_report(lc.parse_args(["report", "--profile", "tiny", "--out", str(out), "--no-drafter",
                                         "--results", str(tmp_path / "curve")]), lc.PROFILES["tiny"])
    assert "2 epochs, 2 layers, 16 anchors/seq" in curve["points_mode"] and "drafter" not in curve
    assert not list((tmp_path / "curve").glob("drafter-*"))

    from dspark.drafters.checkpoint import saved_draft_ids

    saved = tmp_path / "elsewhere" / "my-drafter"
    import shutil

    shutil.copytree(out / "epochs" / "e01" / "dspark" / "drafter", saved)
    run("epochs", out, "--epochs", "1", "--init-from", str(saved))
    cont = out / "epochs" / "e01-from-my-drafter" / "dspark"
    trained = json.loads((cont / "train.json").read_text())
    assert trained["init_from"] == str(saved.resolve()) and trained["rows"] == 9
    assert saved_draft_ids(str(cont / "drafter")).tolist() == saved_draft_ids(str(saved)).tolist()
    from recipes.learning_curve.report import epoch_entry

    assert epoch_entry(cont)["total_epochs"] is None  # passes over other rows are not added up
    report = lc.cmd_report(lc.parse_args(["report", "--profile", "tiny", "--out", str(out), "--results",
                                          str(tmp_path / "results")]), lc.PROFILES["tiny"])
    assert report["extra_rollouts"]["rollouts-train-more"]["rows"] == 5 and report["train_rows"]["rows"] == 9
    with pytest.raises(SystemExit, match="no saved drafter"):
        run("epochs", out, "--epochs", "1", "--init-from", str(tmp_path / "nowhere"))

    # --refresh-vocab: a drafter with another vocabulary is moved to the one counted on this run's rows
    import torch

    from dspark.drafters import load_drafter, save_drafter
    from recipes.learning_curve.shared import load_target_of

    run_ids = saved_draft_ids(str(saved))
    moved = load_drafter(str(saved), load_target_of(lc.PROFILES["tiny"]))
    elsewhere = torch.tensor(sorted(set(range(int(moved.vocab_size))) - set(run_ids[:8].tolist())))[:len(run_ids)]
    moved.change_draft_vocab(elsewhere)
    save_drafter(moved, str(tmp_path / "elsewhere" / "other-vocab"))
    run("epochs", out, "--epochs", "1", "--init-from", str(tmp_path / "elsewhere" / "other-vocab"), "--refresh-vocab")
    recounted = out / "epochs" / "e01-from-other-vocab-vocab" / "dspark"
    assert saved_draft_ids(str(recounted / "drafter")).tolist() == run_ids.tolist()
    kept = json.loads((recounted / "train.json").read_text())["draft_vocab_recounted"]["kept_tokens"]
    assert kept == len(set(run_ids.tolist()) & set(elsewhere.tolist())) < len(run_ids)

    # two drafters on the same held-out prompts: each one's τ and the paired difference to the first
    run("rollouts", out, "--which", "eval", "--limit-prompts", "4")
    other = str(cont / "drafter")
    rep = lc.cmd_compare(lc.parse_args(["compare", "--profile", "tiny", "--out", str(out), "--drafters", str(saved),
                                        other]), lc.PROFILES["tiny"])
    assert json.loads((out / "compare.json").read_text()) == json.loads(json.dumps(rep))
    assert rep["drafters"][other]["vs_baseline"]["prompts"] >= 1
    lo, hi = rep["drafters"][other]["vs_baseline"]["ci95"]
    assert lo <= rep["drafters"][other]["vs_baseline"]["difference"] <= hi
    assert rep["drafters"][other]["trained"]["rows"] == 9 and rep["drafters"][str(saved)]["label"]
    assert set(rep["drafters"][other]["vs_baseline_per_benchmark"]) <= set(rep["drafters"][other]["expected_tau_per_benchmark"])
    # ... and at a decode run's setting: γ 2 of the block of 3, each answer's first 4 tokens, into its own file
    at = lc.cmd_compare(lc.parse_args(["compare", "--profile", "tiny", "--out", str(out), "--drafters", str(saved),
                                       other, "--gamma", "2", "--answer-tokens", "4", "--labels", "saved", "continued"]),
                        lc.PROFILES["tiny"])
    assert json.loads((out / "compare-g2-a4.json").read_text()) == json.loads(json.dumps(at))
    assert [d["label"] for d in at["drafters"].values()] == ["saved", "continued"]
    assert (out / "compare.png").stat().st_size > 0 and (out / "compare-g2-a4.png").stat().st_size > 0
    with pytest.raises(SystemExit, match="--labels names 1 drafters"):
        run("compare", out, "--drafters", str(saved), other, "--labels", "one")
    assert at["setting"]["gamma"] == {str(saved): 2, other: 2} and at["setting"]["answer_tokens"] == 4
    assert 1.0 <= at["drafters"][other]["expected_tau"] <= 3.0  # at most γ + 1
    # every anchor of the cut answers: the renewal estimate of decoding's τ too, paired like expected τ
    lo, hi = at["drafters"][other]["decoded_tau_estimate_ci95"]
    assert 1.0 <= lo <= at["drafters"][other]["decoded_tau_estimate"] <= hi <= 3.0
    assert at["drafters"][other]["decoded_vs_baseline"]["prompts"] >= 1 and at["setting"]["anchor_stride"] == 1
    # without --answer-tokens the profile's anchor stride holds: renewal only where it keeps every anchor
    assert ("decoded_tau_estimate" in rep["drafters"][other]) == (lc.PROFILES["tiny"].anchor_stride == 1)

    # draft temperature: swept with the renewal estimate (1 always in), the best value saved in a new folder
    dt = lc.cmd_draft_temperature(lc.parse_args(["draft-temperature", "--profile", "tiny", "--out", str(out),
                                                 "--drafters", other, "--temperatures", "0.5", "2",
                                                 "--gamma", "2", "--answer-tokens", "4",
                                                 "--save", str(tmp_path / "tempered")]), lc.PROFILES["tiny"])
    assert json.loads((out / "draft-temperature-g2-a4.json").read_text()) == json.loads(json.dumps(dt))
    assert set(dt["temperatures"]) == {"0.5", "1.0", "2.0"} and dt["temperatures"]["1.0"]["vs_temperature_1"] is None
    best = dt["temperatures"][str(dt["best"])]["decoded_tau_estimate"]
    assert best == max(r["decoded_tau_estimate"] for r in dt["temperatures"].values())
    assert dt["temperatures"]["1.0"]["decoded_tau_estimate"] == pytest.approx(
        at["drafters"][other]["decoded_tau_estimate"])  # 1 = the drafter as compare measured it
    assert load_drafter(dt["saved"]).draft_temperature == dt["best"]
    with pytest.raises(SystemExit, match="already there"):
        run("draft-temperature", out, "--drafters", other, "--save", str(tmp_path / "tempered"))

    # a tree of drafts verified per round: τ rises with its width (paired with one chain), costs measured
    fd = lc.cmd_draft_trees(lc.parse_args(["draft-trees", "--profile", "tiny", "--out", str(out), "--drafters",
                                           other, "--trees", "3", "2", "2x2x1", "--gamma", "2", "--answer-tokens", "4"]),
                            lc.PROFILES["tiny"])
    assert json.loads((out / "draft-trees-g2-a4.json").read_text()) == json.loads(json.dumps(fd))
    rows = fd["trees"]
    assert list(rows) == ["1", "3", "2", "2x2"] and rows["1"]["vs_one_chain"] is None
    assert rows["1"]["decoded_tau_estimate"] == pytest.approx(at["drafters"][other]["decoded_tau_estimate"])
    # (this tiny drafter accepts almost nothing: wider trees never lower τ; the unit tests show them raise it)
    assert rows["1"]["decoded_tau_estimate"] <= rows["2"]["decoded_tau_estimate"] <= rows["3"]["decoded_tau_estimate"]
    assert rows["2"]["decoded_tau_estimate"] <= rows["2x2"]["decoded_tau_estimate"]
    assert [(rows[n]["verify_tokens"], rows[n]["leaves"]) for n in rows] == [(3, 1), (7, 3), (5, 2), (7, 4)]
    assert rows["3"]["vs_one_chain"]["difference"] >= 0 and fd["cost"]["reps"] == 3
    assert all(r["verify_ms"] > 0 and r["draft_ms"] > 0 and r["projected_speedup_vs_target"] > 0 for r in rows.values())
    with pytest.raises(SystemExit, match="deeper than"):
        run("draft-trees", out, "--drafters", other, "--trees", "2x2x2", "--gamma", "2")
    with pytest.raises(SystemExit, match="not a tree"):
        run("draft-trees", out, "--drafters", other, "--trees", "2y")
