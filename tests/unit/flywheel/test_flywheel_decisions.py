"""The flywheel's decisions without servers: drift flags, the promotion rule, the retraining mix,
and jobs.train's init_from (architecture from the checkpoint, clashes refused, weights copied)."""
from __future__ import annotations

import json

import pyarrow as pa
import pytest
import torch

from dspark.config import ConfigError
from dspark.flywheel import drift, promotion
from dspark.flywheel.acceptance import DomainAcceptance
from dspark.flywheel.capture import CAPTURE_SCHEMA
from dspark.flywheel.retrain_data import mix, write_heldout_benchmarks
from dspark.data.schema import ROLLOUT_SCHEMA


def acceptance(survival: list[float], rounds: int = 100) -> DomainAcceptance:
    verified = [rounds] * len(survival)
    return DomainAcceptance(requests=10, rounds=rounds, draft_tokens=sum(verified), verified_per_pos=verified,
                            accepted_per_pos=[round(s * rounds) for s in survival])


def test_drift_flags_only_a_drop_beyond_the_margin_with_enough_traffic():
    live = {"math": acceptance([0.8, 0.6]), "code": acceptance([0.2, 0.05]), "chat": acceptance([0.1], rounds=5),
            "new": acceptance([0.5])}
    out = {r.domain: r for r in drift.compare(live, {"math": 2.5, "code": 2.3, "chat": 2.0}, margin=0.2,
                                              min_draft_tokens=50)}
    assert out["code"].drifted and out["code"].drop == pytest.approx(2.3 - 1.25)
    assert not out["math"].drifted and out["math"].live == pytest.approx(2.4)
    assert not out["chat"].drifted and "too little traffic" in out["chat"].reason
    assert not out["new"].drifted and "no baseline" in out["new"].reason


def test_drift_reads_windows_of_one_version_since_a_time(tmp_path):
    for writer, (end_ms, version, req) in {"a": (5_000, "1", 3), "b": (9_000, "1", 4), "c": (9_500, "2", 7)}.items():
        (tmp_path / "acceptance" / writer).mkdir(parents=True)
        record = {"drafter_version": version, "domains": {"math": acceptance([0.5]).to_dict() | {"requests": req}}}
        (tmp_path / "acceptance" / writer / f"{end_ms}.json").write_text(json.dumps(record))
    assert drift.read_windows(str(tmp_path), since=6.0, drafter_version="1")["math"].requests == 4
    assert drift.read_windows(str(tmp_path), since=0.0, drafter_version="1")["math"].requests == 7
    assert drift.read_windows(str(tmp_path), since=0.0)["math"].requests == 14


def test_promotion_needs_a_significant_gain_on_drifted_domains_and_no_loss_elsewhere():
    gain, flat, loss = [0.8, 1.1, 0.9, 1.0, 1.2, 0.7], [0.02, -0.03, 0.0, 0.01], [-0.4, -0.5, -0.3, -0.6]
    assert promotion.decide({"code": gain, "math": flat}, ["code"]).promote
    no = promotion.decide({"code": gain, "math": loss}, ["code"], tolerance=0.05)
    assert not no.promote and any("math" in r and "loses" in r for r in no.reasons)
    noisy = promotion.decide({"code": [1.5, -1.4, 1.2, -1.3], "math": flat}, ["code"])
    assert not noisy.promote and "does not exclude 0" in noisy.reasons[0]
    assert not promotion.decide({"code": gain}, []).promote, "nothing drifted: nothing to promote"
    assert not promotion.decide({"math": flat}, ["code"]).promote, "a drifted domain must be evaluated"


def test_paired_deltas_pair_the_same_prompt_of_both_drafters():
    samples = [{"mode": "serving", "benchmark": "b", "index": 0, "tau": 1.0},
               {"mode": "candidate", "benchmark": "b", "index": 0, "tau": 2.5},
               {"mode": "candidate", "benchmark": "b", "index": 1, "tau": 3.0}]  # no serving partner
    assert promotion.paired_deltas(samples, {"b": "code"}, "serving", "candidate") == {"code": [1.5]}


def _rows(n: int, source: str, domain: str, split: str = "train") -> list[dict]:
    return [{"prompt_id": f"{source}{i:04d}", "source": source, "domain": domain, "split": split,
             "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}],
             "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "num_prompt_tokens": 1, "num_generated_tokens": 2,
             "num_turns": 1, "finish_reason": "stop", "turn_finish_reasons": ["stop"], "target": "tiny",
             "target_revision": "", "sampling": "{}", "chunk": 0} for i in range(n)]


def test_mix_keeps_every_captured_train_row_and_sets_the_ratio(tmp_path):
    captured = pa.Table.from_pylist(_rows(30, "capture", "code") + _rows(10, "capture", "code", "holdout"),
                                    schema=pa.schema(list(ROLLOUT_SCHEMA)))
    original = pa.Table.from_pylist(_rows(500, "orig", "math"), schema=ROLLOUT_SCHEMA)
    table, counts = mix(captured, original, capture_fraction=0.25, seed=0)
    assert counts["captured_rows"] == 30 and counts["original_rows"] == 90 and table.num_rows == 120
    assert table.schema == ROLLOUT_SCHEMA and len(set(table["prompt_id"].to_pylist())) == 120
    few = pa.Table.from_pylist(_rows(5, "orig", "math"), schema=ROLLOUT_SCHEMA)
    assert mix(captured, few, 0.25, 0)[1]["original_rows"] == 5, "capped by what exists"
    paths = write_heldout_benchmarks(str(tmp_path), captured, max_per_domain=4)
    lines = [json.loads(x) for x in open(paths["code"]).read().splitlines()]
    assert len(lines) == 4 and all(len(x["turns"]) == 1 for x in lines)
    assert CAPTURE_SCHEMA.names[:len(ROLLOUT_SCHEMA)] == ROLLOUT_SCHEMA.names


def test_init_from_takes_the_checkpoints_architecture_and_refuses_clashes(tmp_path):
    from dspark.drafters import DrafterConfig, build_drafter, save_drafter
    from dspark.models.target import load_target
    from dspark.training.config import TrainJobConfig
    from dspark.training.session import load_initial_weights
    from jobs.train import resolve_init_from

    target = load_target("tiny")
    torch.manual_seed(1)
    source = build_drafter(DrafterConfig(algo="dspark", block_size=4, num_layers=1, rank=16), target)
    save_drafter(source, str(tmp_path / "d"))
    base = {"run_name": "r", "data": {"rollouts": "x"}, "init_from": str(tmp_path / "d"),
            "scaling": {"num_workers": 1}, "optim": {"micro_batch_size": 4, "global_batch_size": 4}}
    cfg, pinned = resolve_init_from(TrainJobConfig.model_validate({**base, "drafter": {"loss_ce": 0.5}}))
    assert pinned == str(tmp_path / "d")
    assert (cfg.drafter.block_size, cfg.drafter.rank, cfg.drafter.loss_ce) == (4, 16, 0.5)
    with pytest.raises(ConfigError, match="block_size"):
        resolve_init_from(TrainJobConfig.model_validate({**base, "drafter": {"block_size": 7}}))
    fresh = build_drafter(cfg.drafter, target)
    load_initial_weights(fresh, str(tmp_path / "d"), target)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), source.state_dict().values()))


def test_init_from_a_draft_vocabulary_drafter_keeps_its_vocabulary(tmp_path):
    """Every smollm2 config drafts over an 8k subset: retraining one must keep the checkpoint's ids (its
    LM head rows), not a vocabulary rebuilt from the new rollouts."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dspark.drafters import DrafterConfig, build_drafter, save_drafter
    from dspark.models.target import load_target
    from dspark.training.config import TrainJobConfig
    from dspark.training.session import load_initial_weights
    from jobs.train import build_draft_vocab, resolve_init_from

    target = load_target("tiny")
    ids = torch.arange(3, 3 + 2 * 24, 2)  # 24 ids the new rollouts below barely use
    torch.manual_seed(2)
    source = build_drafter(DrafterConfig(algo="dspark", block_size=4, num_layers=1, rank=16, draft_vocab_size=24),
                           target, draft_ids=ids)
    save_drafter(source, str(tmp_path / "d"))
    rollouts = tmp_path / "r" / "part-00000.parquet"
    rollouts.parent.mkdir()
    pq.write_table(pa.table({"input_ids": [[1, 2, 3, 4, 5, 6]] * 4, "loss_mask": [[0, 0, 1, 1, 1, 1]] * 4,
                             "split": ["train"] * 4}), rollouts)
    cfg, pinned = resolve_init_from(TrainJobConfig.model_validate({
        "run_name": "r", "data": {"rollouts": str(rollouts.parent)}, "init_from": str(tmp_path / "d"),
        "scaling": {"num_workers": 1}, "optim": {"micro_batch_size": 4, "global_batch_size": 4}}))
    assert cfg.drafter.draft_vocab_size == 24
    vocab = build_draft_vocab(cfg, [str(rollouts)], pinned)
    assert vocab.draft_ids == tuple(ids.tolist()) and vocab.coverage == pytest.approx(0.5)  # ids 3 and 5 of 4..6
    fresh = build_drafter(cfg.drafter, target, draft_ids=vocab.ids())
    load_initial_weights(fresh, str(tmp_path / "d"), target)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), source.state_dict().values()))
    assert build_draft_vocab(cfg, [str(rollouts)]).draft_ids != vocab.draft_ids  # without init_from: rebuilt


def test_wait_serving_polls_the_model_cards_until_every_one_names_the_drafter(monkeypatch):
    from jobs.promote import wait_serving
    from tests.http_stub import http_stub

    seen = []

    def cards(request):
        seen.append((request.path, request.headers.get("authorization")))
        drafter = "dspark-drafter/1" if len(seen) < 3 else "dspark-drafter/2"
        return 200, b"not json" if len(seen) == 1 else json.dumps({"data": [{"id": "m", "drafter": drafter}]}).encode()

    monkeypatch.setenv("DSPARK_TEST_KEY", "k")
    with http_stub(cards) as url:
        wait_serving(url, "dspark-drafter/2", timeout_s=20, key_env="DSPARK_TEST_KEY")
        assert len(seen) == 3 and seen[0] == ("/v1/models", "Bearer k")  # bad JSON, old drafter, new drafter
        with pytest.raises(TimeoutError, match="did not serve dspark-drafter/3"):
            wait_serving(url, "dspark-drafter/3", timeout_s=0.5, key_env="DSPARK_TEST_KEY")
