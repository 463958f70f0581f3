"""The flywheel's request side, in process (no Ray): domain resolution, per-position acceptance counts
from the engine, and opt-in capture — every captured row exactly once, readable by jobs.train's rollout
check, nothing of the HTTP request (API key) stored, a full queue drops instead of blocking."""
from __future__ import annotations

import json
import time

import pytest
import torch

from dspark.drafters import DrafterConfig, build_drafter, save_drafter
from dspark.decoding.engine import Engine
from dspark.flywheel import domain
from dspark.flywheel.acceptance import AcceptanceStats, DomainAcceptance, expected_accept_len
from dspark.flywheel.capture import FlywheelWriter, read_captures, split_of, writer_dirs
from dspark.flywheel.config import CaptureConfig, FlywheelConfig
from dspark.flywheel.observer import Flywheel
from dspark.serve.app import make_app
from dspark.serve.config import ServeConfig
from dspark.serve.service import OpenAIService
from dspark.models.target import load_target

KEY_ENV = "DSPARK_FLYWHEEL_TEST_KEY"
SECRET = "sk-flywheel-secret-5f2b9c"
MATH = "what is the sum of 12 + 30 and how many are prime"
CODE = "def add(a, b): return a + b  # fix this python function"


@pytest.fixture(scope="module")
def tiny():
    target = load_target("tiny")
    torch.manual_seed(0)
    return target, build_drafter(DrafterConfig(algo="dspark", block_size=4, num_layers=1), target)


def serve_config(drafter_dir: str, output: str | None, **capture) -> ServeConfig:
    return ServeConfig.model_validate({
        "model": {"target": "tiny", "drafter": drafter_dir, "served_name": "dspark-tiny"},
        "engine": {"scheduler": {"mode": "fixed"}, "max_model_len": 256, "max_batch": 16},
        "api": {"api_key_env": KEY_ENV, "max_tokens_limit": 64, "default_max_tokens": 16},
        "flywheel": {"output": output, "summary_every_s": 3600, "capture": capture},
    })


def test_domain_from_metadata_then_user_then_classifier():
    assert domain.resolve({"domain": "Math"}, "code", CODE) == ("math", "metadata")
    assert domain.resolve(None, "team-a:code", MATH) == ("code", "user")
    assert domain.resolve({}, "alice", MATH) == ("math", "classifier")
    assert domain.resolve(None, None, CODE) == ("code", "classifier")
    assert domain.resolve(None, None, "tell me about your day") == ("chat", "classifier")
    assert domain.resolve({"domain": "x" * 100}, None, "")[0] == "other", "labels stay short (metric cardinality)"


def test_tool_and_json_requests_get_their_own_domains():
    """Agent and JSON traffic (where acceptance collapses most) is measured and captured apart from chat."""
    from dspark.serve.protocol import ChatBody

    def shape(**extra):
        return domain.request_shape(ChatBody.model_validate({"messages": [{"role": "user", "content": "x"}], **extra}))

    tools = [{"type": "function", "function": {"name": "w"}}]
    assert shape(tools=tools) == "tools" and shape(tools=tools, tool_choice="none") is None
    assert shape(response_format={"type": "json_object"}) == "json" and shape() is None
    assert domain.resolve(None, None, MATH, "tools") == ("tools", "request")
    assert domain.resolve({"domain": "math"}, None, MATH, "json") == ("math", "metadata"), "a tag still wins"
    assert domain.resolve(None, "code", MATH, "json") == ("code", "user")


def test_expected_accept_len_is_one_plus_prefix_survival():
    assert expected_accept_len({1: 0.5, 2: 0.25, 3: 0.25}) == pytest.approx(2.0)
    assert expected_accept_len({2: 0.9}) is None and expected_accept_len({}) is None
    a = DomainAcceptance(rounds=4, accepted=3, verified_per_pos=[4, 4], accepted_per_pos=[2, 1])
    assert a.survival() == {1: 0.5, 2: 0.25} and a.expected_accept_len() == pytest.approx(1.75)
    assert a.to_dict()["mean_accepted_length"] == pytest.approx(1.75), "= τ when every draft is verified"


def test_engine_counts_acceptance_per_position(tiny):
    target, drafter = tiny
    engine = Engine(target, drafter, serve_config("unused", None).engine)
    prompts = [target.chat_ids([{"role": "user", "content": t}]) for t in (MATH, CODE, "hello there")]
    for req in engine.generate(prompts, max_new_tokens=24):
        s = req.stats
        assert sum(s.verified_per_pos) == s.verified and sum(s.accepted_per_pos) == s.accepted
        assert s.verified_per_pos[0] == s.rounds, "fixed mode verifies position 1 every round"
        assert all(a <= v for a, v in zip(s.accepted_per_pos, s.verified_per_pos))
        assert s.accepted_per_pos == sorted(s.accepted_per_pos, reverse=True), "accepted at k implies at k-1"


def test_capture_stores_each_opted_in_request_once_and_never_the_api_key(tiny, tmp_path, monkeypatch):
    from fastapi.testclient import TestClient

    from dspark.io.storage.rollout_store import check_rollouts

    target, drafter = tiny
    drafter_dir = str(tmp_path / "drafter")
    save_drafter(drafter, drafter_dir)
    out = tmp_path / "flywheel"
    cfg = serve_config(drafter_dir, str(out), enabled=True, sample_rate=1.0, max_per_s=1000, domains=["math"],
                       holdout_fraction=0.3, shard_rows=4)
    monkeypatch.setenv(KEY_ENV, SECRET)
    engine = Engine(target, drafter, cfg.engine).start()
    flywheel = Flywheel(cfg.flywheel, {"target": "tiny", "target_revision": target.revision,
                                       "drafter": drafter_dir, "drafter_version": ""}, tokenizer=target.tokenizer)
    service = OpenAIService(engine, cfg, None, flywheel)
    auth = {"authorization": f"Bearer {SECRET}"}
    ids = []
    try:
        with TestClient(make_app(service)) as client:
            for i in range(6):  # opted in: math, by metadata or by the classifier
                body = {"messages": [{"role": "user", "content": f"{MATH} {i}"}], "max_tokens": 12,
                        **({"metadata": {"domain": "math"}} if i % 2 else {})}
                client_id = {"x-request-id": f"client-{i}"} if i < 3 else {}  # the client names its rows
                answer = client.post("/v1/chat/completions", json=body, headers={**auth, **client_id})
                assert answer.headers.get("x-request-id") == client_id.get("x-request-id")
                ids.append(answer.json()["id"])
            for i in range(4):  # not opted in: code
                body = {"messages": [{"role": "user", "content": CODE}], "max_tokens": 12, "user": "code"}
                assert client.post("/v1/chat/completions", json=body, headers=auth).status_code == 200
            stats = client.get("/v1/stats", headers=auth).json()
            metrics = client.get("/metrics").text
    finally:
        engine.stop()
        flywheel.close()
    by_domain = stats["acceptance_by_domain"]
    assert by_domain["math"]["requests"] == 6 and by_domain["code"]["requests"] == 4
    assert by_domain["math"]["draft_tokens"] > 0 and by_domain["math"]["expected_accept_len"] >= 1.0
    for domain in ("math", "code"):  # per-domain acceptance on the endpoint's /metrics too
        line = next(ln for ln in metrics.splitlines() if ln.startswith("dspark_spec_decode_num_draft_tokens_total{")
                    and f'domain="{domain}"' in ln)
        assert float(line.rsplit(" ", 1)[1]) == by_domain[domain]["draft_tokens"]

    rows = read_captures(str(out)).to_pylist()
    assert len(ids) == 6 and sorted(r["messages"][0]["content"] for r in rows) == [f"{MATH} {i}" for i in range(6)], \
        "every opted-in request exactly once, nothing else"
    assert len({r["prompt_id"] for r in rows}) == 6
    assert ids[:3] == [f"chatcmpl-client-{i}" for i in range(3)]
    named = {r["prompt_id"]: r["split"] for r in rows if r["prompt_id"].startswith("client-")}
    assert named == {f"client-{i}": split_of(f"client-{i}", 0.3) for i in range(3)}  # the client's ids decide the split
    assert {r["domain"] for r in rows} == {"math"} and {r["source"] for r in rows} == {"capture"}
    assert {r["split"] for r in rows} <= {"train", "holdout"}
    for r in rows:
        assert r["num_generated_tokens"] == sum(r["loss_mask"]) > 0
        assert r["messages"][-1]["role"] == "assistant"
        assert sum(r["accepted_per_pos"]) == r["accepted_tokens"] and sum(r["verified_per_pos"]) == r["draft_tokens"]
    (writer,) = writer_dirs(str(out))
    manifest = json.loads((out / "capture" / writer / "manifest.json").read_text())
    assert manifest["counts"]["written"] == 6 and manifest["shards"] == 2 and manifest["counts"]["dropped"] == 0
    files, n_train = check_rollouts(str(out / "capture" / writer), "train")  # what jobs.train checks
    assert len(files) == 2 and n_train == sum(r["split"] == "train" for r in rows)
    windows = list((out / "acceptance" / writer).glob("*.json"))
    assert windows and json.loads(windows[0].read_text())["domains"]["math"]["requests"] == 6

    stored = b"".join(p.read_bytes() for p in out.rglob("*") if p.is_file())
    assert SECRET.encode() not in stored and b"authorization" not in stored.lower()


def test_full_queue_drops_and_counts_without_blocking(tmp_path):
    cfg = FlywheelConfig(output=str(tmp_path), capture=CaptureConfig(enabled=True, sample_rate=1.0, domains=["m"],
                                                                     queue_size=2))
    writer = FlywheelWriter(cfg, AcceptanceStats(), {})  # not started: nothing drains the queue
    t0 = time.perf_counter()
    results = [writer.offer({"n": i}) for i in range(50)]
    assert time.perf_counter() - t0 < 0.05, "offer never waits"
    assert results[:2] == [True, True] and not any(results[2:]) and writer.counts.dropped == 48


def test_replica_kill_loses_only_the_pending_rows_and_its_manifest_counts_them(tmp_path):
    """The manifest is kept current at every window with the rows queued and not yet committed; a writer that
    is never closed (its replica killed) leaves that count behind, a closed one says so."""
    from dspark.flywheel.capture import unclosed_writers

    cfg = FlywheelConfig(output=str(tmp_path), summary_every_s=0.2, capture=CaptureConfig(
        enabled=True, sample_rate=1.0, domains=["m"], shard_rows=100, flush_every_s=3600))
    killed = FlywheelWriter(cfg, AcceptanceStats(), {}, writer="replica-a").start()
    for i in range(3):
        assert killed.offer({"n": i})
    deadline = time.monotonic() + 10
    while unclosed_writers(str(tmp_path)).get("replica-a", {}).get("pending") != 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert unclosed_writers(str(tmp_path))["replica-a"]["pending"] == 3  # what a kill -9 now would lose
    closed = FlywheelWriter(cfg, AcceptanceStats(), {}, writer="replica-b").start()
    closed.close()
    assert set(unclosed_writers(str(tmp_path))) == {"replica-a"}, "a closed writer is not reported"
    killed._stop.set()  # let the stand-in replica's thread end (its rows are not real captures)


def test_capture_policy_sample_rate_rate_limit_and_allow_list(tmp_path):
    cfg = FlywheelConfig(output=str(tmp_path), capture=CaptureConfig(enabled=True, sample_rate=1.0, max_per_s=3,
                                                                     domains=["math"]))
    writer = FlywheelWriter(cfg, AcceptanceStats(), {}, seed=0)
    assert not writer.wants("code")
    assert sum(writer.wants("math") for _ in range(100)) == 3, "a burst is capped at max_per_s"
    half = FlywheelWriter(cfg.model_copy(update={"capture": cfg.capture.model_copy(
        update={"sample_rate": 0.5, "max_per_s": 1e6})}), AcceptanceStats(), {}, seed=0)
    taken = sum(half.wants("math") for _ in range(2000))
    assert 850 < taken < 1150
    with pytest.raises(ValueError, match="capture.domains"):
        CaptureConfig(enabled=True, sample_rate=1.0)
    with pytest.raises(ValueError, match="flywheel.output"):
        FlywheelConfig(capture={"enabled": True, "domains": ["math"]})


def test_capture_writes_retry_then_give_up_with_an_error_logged(monkeypatch, caplog):
    from dspark.flywheel import capture

    monkeypatch.setattr(capture, "WRITE_BACKOFF_S", 0.0)
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < capture.WRITE_ATTEMPTS:
            raise OSError("bucket unreachable")

    assert capture._retry_write(flaky, "shard a") is True and len(calls) == capture.WRITE_ATTEMPTS

    def broken():
        calls.append(1)
        raise OSError("bucket gone")

    calls.clear()
    assert capture._retry_write(broken, "shard b") is False and len(calls) == capture.WRITE_ATTEMPTS
    assert "shard b not written after 3 attempts: bucket gone" in caplog.text
