"""OpenAI-compatible HTTP API on the built-in `tiny` target.

In-process tests (FastAPI TestClient, engine in its background thread, no Ray): every bad input gets
its 400 naming the field, 401 without the API key, 429 on a full queue, 503 when the engine is
unhealthy, well-formed SSE, greedy HTTP output == target-only output, stop strings.

Integration tests (`-m integration`, one real Ray Serve deployment for the module, run under
`flock /tmp/dspark-heavy.lock`): 32 concurrent requests complete, bad inputs through the Serve proxy,
SSE streaming, the API key, and the `openai` client.
"""

from __future__ import annotations

import asyncio

import json

import os

import socket

import time

import httpx

import pytest

import torch

from dspark.drafters import DrafterConfig, build_drafter, save_drafter

from dspark.decoding.engine import Engine

from dspark.decoding.sampling import SamplingParams

from dspark.serve.service import OpenAIService

from dspark.serve.config import ServeConfig

from dspark.serve.text import TextAssembler

from dspark.serve.deployment import build_app

from dspark.serve.app import make_app

from dspark.decoding.specdec import target_generate

from dspark.models.target import load_target



KEY_ENV = "DSPARK_TEST_API_KEY"



CHAT = {"messages": [{"role": "user", "content": "what is the sum"}], "max_tokens": 8}



BAD_INPUTS = [  # (route, body, param named in the error)
    ("chat", b"{not json", None),
    ("chat", [1, 2], None),
    ("chat", {"messages": []}, "messages"),
    ("chat", {"messages": "hi"}, "messages"),
    ("chat", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ("chat", {**CHAT, "max_tokens": 0}, "max_tokens"),
    ("chat", {**CHAT, "max_tokens": -3}, "max_tokens"),
    ("chat", {**CHAT, "max_tokens": 10_000}, "max_tokens"),
    ("chat", {**CHAT, "temperature": -0.5}, "temperature"),
    ("chat", {**CHAT, "top_p": 0}, "top_p"),
    ("chat", {**CHAT, "top_p": 1.5}, "top_p"),
    ("chat", {**CHAT, "n": 0}, "n"),
    ("chat", {"messages": [{"role": "user", "content": "the a of " * 200}]}, "messages"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": [1, 2, 99999]}, "prompt"),
    ("completions", {"prompt": "the a of " * 200}, "prompt"),
    ("completions", {"prompt": "x" * 9000}, "prompt"),  # over api.max_prompt_chars: refused before tokenizing
    ("chat", {"messages": [{"role": "user", "content": "y" * 9000}]}, "messages"),
    ("chat", {**CHAT, "seed": 2**64}, "seed"),
    ("chat", {**CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("chat", {**CHAT, "stop": ""}, "stop"),
    ("chat", {**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content.0.type"),
    ("chat", {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]},
     "messages.0.tool_calls.0.function"),
    ("chat", {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1"}}]}]},
     "messages.0.tool_calls.0.function.arguments"),
    ("completions", {"prompt": [[1, 2], []]}, "prompt.1"),
]



UNSUPPORTED = [
    ("chat", "frequency_penalty", 0.5),
    ("chat", "presence_penalty", -1.0), ("chat", "logit_bias", {"5": 10}), ("chat", "functions", [{"name": "f"}]),
    ("chat", "modalities", ["text", "audio"]), ("chat", "prediction", {"type": "content", "content": "x"}),
    ("completions", "best_of", 3), ("completions", "echo", True), ("chat", "store", True),
    ("completions", "suffix", "end"), ("completions", "repetition_penalty", 1.2),
]



NEUTRAL = {"logprobs": False, "n": 1, "frequency_penalty": 0, "presence_penalty": 0.0, "tool_choice": "none",
           "response_format": {"type": "text"}, "logit_bias": {}, "tools": [], "user": "u1", "metadata": {"a": "b"}}



ROUTES = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}



def _serve_config(drafter_dir: str, **engine) -> ServeConfig:
    return ServeConfig.model_validate({
        "model": {"target": "tiny", "drafter": drafter_dir, "served_name": "dspark-tiny"},
        "engine": {"scheduler": {"mode": "dynamic"}, "max_model_len": 256, "max_batch": 32,
                   "sps_table": {1: 300.0, 32: 100.0, 256: 20.0}, **engine},
        "api": {"api_key_env": KEY_ENV, "max_tokens_limit": 64, "default_max_tokens": 16},
    })



def _post(client, route, body, **kw):
    if isinstance(body, bytes):
        return client.post(ROUTES[route], content=body, headers={"content-type": "application/json", **kw})
    return client.post(ROUTES[route], json=body, headers=kw)



def _check_error_shape(resp, status):
    """OpenAI's error shape, exactly: {"error": {"message", "type", "param", "code"}}."""
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"] and body["error"]["type"]
    return body["error"]



def _check_bad_input(resp, param):
    err = _check_error_shape(resp, 400)
    assert err["param"] == param and err["message"]
    if param:
        assert param.split(".")[0] in err["message"]



def _sse_events(lines) -> list:
    """Parse an SSE body strictly: 'data: <json>' events separated by blank lines, ending with [DONE]."""
    lines = [ln for ln in lines]
    events = []
    for i in range(0, len(lines), 2):
        assert lines[i].startswith("data: "), lines[i]
        assert i + 1 < len(lines) and lines[i + 1] == "", "each event ends with a blank line"
        events.append(lines[i][6:])
    assert events and events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]



@pytest.fixture(scope="module")
def tiny():
    target = load_target("tiny")
    torch.manual_seed(0)
    return target, build_drafter(DrafterConfig(algo="dspark", block_size=4, num_layers=1), target)



@pytest.fixture(scope="module")
def drafter_dir(tiny, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("drafter") / "tiny-dspark")
    save_drafter(tiny[1], path)
    return path



@pytest.fixture(scope="module")
def client(tiny, drafter_dir):
    from fastapi.testclient import TestClient

    cfg = _serve_config(drafter_dir)
    engine = Engine(*tiny, cfg.engine).start()
    with TestClient(make_app(OpenAIService(engine, cfg))) as c:
        yield c
    engine.stop()



@pytest.mark.parametrize("route,body,param", BAD_INPUTS, ids=[f"{r}-{p}-{i}" for i, (r, _, p) in enumerate(BAD_INPUTS)])
def test_bad_input_gets_400_naming_the_field(client, route, body, param):
    _check_bad_input(_post(client, route, body), param)



def test_models_health_and_stats(client):
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == "dspark-tiny" and models["data"][0]["scheduler"] == "dynamic"
    health = client.get("/healthz")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    stats = client.get("/v1/stats").json()
    assert stats["sps_table"] == {"1": 300.0, "32": 100.0, "256": 20.0}
    assert stats["graph_caches_full"] == {}  # no compiled step or capture has run out of graphs



def test_chat_and_completions_carry_usage_and_spec_decode(client, tiny):
    target = tiny[0]
    chat = _post(client, "chat", {**CHAT, "temperature": 0}).json()
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["role"] == "assistant"
    usage, spec = chat["usage"], chat["spec_decode"]
    assert usage["completion_tokens"] <= 8 and usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert spec["rounds"] >= 1 and spec["draft_tokens_proposed"] == 4 * spec["rounds"]
    assert spec["mean_accepted_length"] == pytest.approx((spec["draft_tokens_accepted"] + spec["rounds"]) / spec["rounds"])
    # greedy over HTTP == target-only greedy decoding (token ids prompt, two prompts in one request)
    prompts = [[5, 6, 7, 8], [100, 101]]
    out = _post(client, "completions", {"prompt": prompts, "max_tokens": 12, "temperature": 0}).json()
    for prompt, choice in zip(prompts, out["choices"]):
        ref = target_generate(target, prompt, SamplingParams(temperature=0), 12)
        assert choice["token_ids"] == ref.token_ids and choice["finish_reason"] == ref.finish_reason
        assert choice["text"] == target.tokenizer.decode(ref.token_ids, skip_special_tokens=True)
    assert out["usage"]["prompt_tokens"] == 6



def test_streaming_is_well_formed_sse(client):
    body = {**CHAT, "max_tokens": 12, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", ROUTES["chat"], json=body) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        chunks = _sse_events(resp.iter_lines())
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert all(c["choices"][0]["finish_reason"] is None and c["usage"] is None for c in chunks[:-2])
    finish, last = chunks[-2:]  # include_usage: a last chunk with empty choices carries the usage
    assert finish["choices"][0]["finish_reason"] in ("stop", "length") and finish["spec_decode"]["rounds"] >= 1
    assert last["choices"] == [] and last["usage"]["completion_tokens"] >= 1
    with client.stream("POST", ROUTES["completions"], json={"prompt": "the a of", "max_tokens": 6,
                                                             "stream": True}) as resp:
        chunks = _sse_events(resp.iter_lines())
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length") and chunks[-1]["object"] == "text_completion"



def test_api_key_is_enforced_when_set(client, monkeypatch):
    monkeypatch.setenv(KEY_ENV, "s3cret")
    assert _post(client, "chat", CHAT).status_code == 401
    assert _post(client, "chat", CHAT, authorization="Bearer wrong").status_code == 401
    assert client.get("/v1/models").status_code == 401
    assert _post(client, "chat", CHAT, authorization="Bearer s3cret").status_code == 200
    assert client.get("/healthz").status_code == 200  # probes need no key
    monkeypatch.delenv(KEY_ENV)
    assert _post(client, "chat", CHAT).status_code == 200



def test_overload_full_queue_gets_429_and_unhealthy_engine_503_both_with_retry_after(tiny, drafter_dir):
    from fastapi.testclient import TestClient

    cfg = _serve_config(drafter_dir, max_waiting=0)
    engine = Engine(*tiny, cfg.engine).start()
    try:
        with TestClient(make_app(OpenAIService(engine, cfg))) as c:
            resp = _post(c, "chat", CHAT)
            assert resp.status_code == 429 and resp.headers["retry-after"] == "1"
            engine.healthy, engine.health_error = False, "simulated device loss"
            assert c.get("/healthz").status_code == 503
            unavailable = _post(c, "chat", CHAT)
            assert unavailable.status_code == 503 and unavailable.headers["retry-after"] == "5"  # overload: told when
            assert "simulated device loss" in unavailable.json()["error"]["message"]
    finally:
        engine.stop()



def test_text_assembler_holds_back_partial_stop_strings(tiny):
    tok = tiny[0].tokenizer
    ids = tok("the answer is 42. then more")["input_ids"]
    assembler, sent = TextAssembler(tok, ["42."]), ""
    for n in range(1, len(ids) + 1):
        delta, stopped = assembler.update(ids[:n], n == len(ids))
        sent += delta
        assert "4" not in sent  # nothing of a possible stop string leaks before it is decided
        if stopped:
            break
    assert stopped and sent == "the answer is " and assembler.text == "the answer is "



def test_build_app_reads_a_serve_config(drafter_dir, tmp_path):
    pytest.importorskip("ray.serve")
    path = tmp_path / "serve.yaml"
    path.write_text(f"model: {{target: tiny, drafter: {drafter_dir}}}\nray: {{num_cpus: 2}}\n")
    app = build_app({"config": str(path), "set": ["deployment.num_replicas=2"]})
    assert type(app).__name__ == "Application"
    with pytest.raises(ValueError, match="unknown application args"):
        build_app({"config": str(path), "bogus": 1})
    from dspark.config import ConfigError

    with pytest.raises(ConfigError, match="unknown key 'engine.nope'"):
        build_app({"config": str(path), "set": ["engine.nope=1"]})



@pytest.mark.parametrize("device", ["auto", "cpu", "cuda"])
def test_model_device_accepts_auto_cpu_cuda(device):
    from dspark.config import load_config

    assert load_config(ServeConfig, None, [f"model.device={device}"]).model.device == device
    assert ServeConfig().model.device == "auto"



@pytest.mark.parametrize("device", ["gpu", "cuda:1", "mps", "", "CUDA"])
def test_model_device_rejects_others(device):
    from dspark.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="'model.device'"):
        load_config(ServeConfig, None, [f"model.device={device}"])
    with pytest.raises(ConfigError, match="'deployment.num_gpus'"):
        load_config(ServeConfig, None, ["deployment.num_gpus=-1"])



def test_explicit_cuda_without_cuda_fails_naming_the_setting(monkeypatch, drafter_dir):
    from dspark.serve.config import build_engine, resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for has_gpus in (False, True):
        with pytest.raises(ValueError, match=r"model\.device='cuda'.*CUDA is not available"):
            resolve_device("cuda", has_gpus)
    cfg = _serve_config(drafter_dir)
    cfg.model.device = "cuda"
    with pytest.raises(ValueError, match=r"model\.device"):
        build_engine(cfg)  # fails before loading anything



def test_auto_device_is_cuda_only_with_gpus_and_cuda(monkeypatch):
    from dspark.serve.config import resolve_device
    from dspark.serve.deployment import replica_has_gpus

    cfg = ServeConfig()
    assert not replica_has_gpus(cfg)  # no GPUs asked, not in a Ray actor
    assert resolve_device("auto", replica_has_gpus(cfg)) == "cpu"
    cfg.deployment.num_gpus = 1
    assert replica_has_gpus(cfg)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto", True) == "cpu"  # GPUs assigned but no CUDA build: cpu (logged)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto", True) == "cuda"
    assert resolve_device("auto", False) == "cpu"  # CUDA visible, but the replica asked for no GPU
    assert resolve_device("cpu", True) == "cpu" and resolve_device("cuda", False) == "cuda"


def test_auto_dtype_is_bf16_only_where_the_device_computes_it_natively(monkeypatch):
    from dspark.serve.config import resolve_dtype

    assert resolve_dtype("float32", "cpu") == "float32" and resolve_dtype("bfloat16", "cpu") == "bfloat16"
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    assert resolve_dtype("auto", "cpu") == "float32"  # emulated bf16 is slower than fp32
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert resolve_dtype("auto", "cpu") == "bfloat16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_dtype("auto", "cuda") == "float32"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype("auto", "cuda") == "bfloat16"
    with pytest.raises(ValueError):
        ServeConfig.model_validate({"model": {"dtype": "float16"}})



def test_build_engine_puts_target_drafter_and_engine_on_the_resolved_device(drafter_dir):
    from dspark.serve.config import build_engine

    engine = build_engine(_serve_config(drafter_dir))  # model.device=auto, no GPUs asked -> cpu here
    assert engine.target.device.type == engine.drafter.device.type == engine.kv.device.type == "cpu"
    req = engine.submit([1, 2, 3], max_new_tokens=2, seed=7)
    assert req.generator.device.type == "cpu" and engine.stats()["device"] == "cpu"



def test_deployment_for_reserves_the_gpus_asked_for():
    pytest.importorskip("ray.serve")
    from dspark.serve.deployment import deployment_for

    assert "num_gpus" not in deployment_for(ServeConfig())._bound_deployment.ray_actor_options
    cfg = ServeConfig.model_validate({"deployment": {"num_gpus": 1, "num_cpus": 2}})
    assert deployment_for(cfg)._bound_deployment.ray_actor_options == {"num_cpus": 2.0, "num_gpus": 1.0}



def test_the_deployment_drains_on_shutdown_and_autoscales_from_the_serve_config():
    pytest.importorskip("ray.serve")
    from dspark.serve.deployment import deployment_for

    fixed = deployment_for(ServeConfig.model_validate({"deployment": {"num_replicas": 2}}))._bound_deployment
    assert fixed.num_replicas == 2 and fixed._deployment_config.graceful_shutdown_timeout_s == 300.0
    scaled = deployment_for(ServeConfig.model_validate(
        {"deployment": {"autoscaling": {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 8}}})
    )._bound_deployment._deployment_config.autoscaling_config
    assert (scaled.min_replicas, scaled.max_replicas, scaled.target_ongoing_requests) == (1, 3, 8)
    with pytest.raises(ValueError, match="min_replicas 4 > max_replicas 2"):
        ServeConfig.model_validate({"deployment": {"autoscaling": {"min_replicas": 4, "max_replicas": 2}}})


def test_every_replica_serves_the_version_resolved_once_at_deployment(monkeypatch, client):
    """deployment_for resolves the drafter alias before binding, so replicas added later (autoscaling) serve
    the same version even after the alias moves; responses name the drafter that served them."""
    pytest.importorskip("ray.serve")
    from dspark.flywheel import observer
    from dspark.serve.deployment import deployment_for

    resolved = iter(["3", "4"])  # the alias moves between two deployments
    monkeypatch.setattr(observer, "pin_drafter", lambda ref: (f"models:/d/{(v := next(resolved))}", v))
    cfg = ServeConfig.model_validate({"model": {"drafter": "models:/d@champion"}})
    first = deployment_for(cfg)._bound_deployment.init_args[0]
    assert first["model"]["drafter"] == "models:/d/3" and cfg.model.drafter == "models:/d@champion"
    assert deployment_for(cfg)._bound_deployment.init_args[0]["model"]["drafter"] == "models:/d/4"  # a redeploy
    off = ServeConfig.model_validate({"model": {"drafter": "models:/d@champion"}, "engine": {"scheduler": {"mode": "off"}}})
    assert deployment_for(off)._bound_deployment.init_args[0]["model"]["drafter"] == "models:/d@champion"
    r = client.post("/v1/chat/completions", json=CHAT)
    served = client.get("/v1/models").json()["data"][0]["drafter"]
    assert r.status_code == 200 and served and r.headers["X-DSpark-Drafter"] == served


@pytest.mark.parametrize("route,field,value", UNSUPPORTED, ids=[f"{r}-{f}" for r, f, _ in UNSUPPORTED])
def test_unimplemented_openai_fields_get_400_naming_the_field(client, route, field, value):
    body = {**CHAT} if route == "chat" else {"prompt": "the a of", "max_tokens": 4}
    err = _check_error_shape(_post(client, route, {**body, field: value}), 400)
    assert err["param"] == field and f"'{field}' is not supported" in err["message"]



def test_neutral_values_of_unimplemented_fields_are_accepted(client):
    """Generic clients send logprobs=false, n=1, zero penalties...: those ask for nothing and are served."""
    resp = _post(client, "chat", {**CHAT, **NEUTRAL})
    assert resp.status_code == 200, resp.text
    assert _post(client, "completions", {"prompt": "the a", "max_tokens": 2, "logprobs": None, "echo": False,
                                         "best_of": 1, "n": 1}).status_code == 200



def test_unknown_model_is_404(client):
    err = _check_error_shape(_post(client, "chat", {**CHAT, "model": "gpt-4"}), 404)
    assert err["param"] == "model" and err["code"] == "model_not_found" and "gpt-4" in err["message"]
    err = _check_error_shape(_post(client, "completions", {"prompt": "a", "model": "nope"}), 404)
    assert err["code"] == "model_not_found"
    assert client.get("/v1/models/dspark-tiny").json()["id"] == "dspark-tiny"
    assert _check_error_shape(client.get("/v1/models/gpt-4"), 404)["code"] == "model_not_found"



def test_every_error_has_openais_shape(client):
    err = _check_error_shape(_post(client, "chat", b'{"messages": [}'), 400)
    assert "not valid JSON" in err["message"]
    assert "JSON object" in _check_error_shape(_post(client, "chat", b'"a string"'), 400)["message"]
    err = _check_error_shape(client.post(ROUTES["chat"], content=json.dumps(CHAT),
                                         headers={"content-type": "text/plain"}), 400)
    assert "application/json" in err["message"]
    assert _check_error_shape(client.get("/v1/nope"), 404)["code"] == "not_found"
    assert _check_error_shape(client.post("/v1/embeddings", json={}), 404)["code"] == "not_found"
    resp = client.get(ROUTES["chat"])
    assert _check_error_shape(resp, 405)["code"] == "method_not_allowed" and resp.headers["allow"] == "POST"
    _check_error_shape(client.delete("/v1/models"), 405)
    big = b'{"prompt": "' + b"a" * (4 * 1024 * 1024) + b'"}'  # the default api.max_body_bytes is 4 MiB
    assert _check_error_shape(_post(client, "completions", big), 413)["code"] == "request_too_large"
    assert _check_error_shape(_post(client, "chat", b'{"messages": [], "temperature": NaN}'), 400)["param"]



MALFORMED = [b"", b"null", b"[]", b"123", b"{", b"\xff\xfe", b'{"messages": null}', b'{"messages": [null]}',
             b'{"messages": [{"role": "user", "content": {"a": 1}}]}', b'{"messages": [{"content": "x"}]}',
             b'{"messages": [{"role": "user", "content": [{"type": "text"}]}]}', b'{"prompt": [[1], "a"]}',
             b'{"prompt": {"a": 1}}', b'{"prompt": [1e400]}', b'{"prompt": [10000000000000000000000000]}',
             b'{"prompt": "a", "max_tokens": 1e30}', b'{"prompt": "a", "max_tokens": "many"}',
             b'{"prompt": "a", "stop": [1, 2]}', b'{"prompt": "a", "seed": -1e100}', b'{"prompt": "a", "top_k": -1}',
             b'{"prompt": "a", "stream": "yes"}', b'{"prompt": "a", "stream": true, "stream_options": 5}',
             b'{"prompt": [-1]}', b'{"prompt": "a", "temperature": "hot"}', b'{"prompt": "a", "top_p": Infinity}',
             b'{"messages": [{"role": "tool", "content": "x"}], "max_tokens": 2}']



@pytest.mark.parametrize("body", MALFORMED, ids=range(len(MALFORMED)))
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_malformed_input_never_gets_a_5xx(client, route, body):
    resp = _post(client, route, body)
    assert resp.status_code < 500, resp.text
    if resp.status_code >= 400:
        _check_error_shape(resp, resp.status_code)



def _openai(client):
    from openai import OpenAI

    return OpenAI(base_url=f"{client.base_url}/v1", api_key="unused", http_client=client, max_retries=0)



def test_openai_client_sync_and_streaming(client):
    import openai

    api = _openai(client)
    assert [m.id for m in api.models.list().data] == ["dspark-tiny"]
    assert api.models.retrieve("dspark-tiny").model_extra["scheduler"] == "dynamic"
    chat = api.chat.completions.create(model="dspark-tiny", messages=CHAT["messages"], max_tokens=8)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
    assert chat.model_extra["spec_decode"]["rounds"] >= 1
    text = api.completions.create(model="dspark-tiny", prompt="the a of", max_tokens=6, temperature=0)
    assert text.choices[0].finish_reason in ("stop", "length") and text.usage.prompt_tokens >= 1
    seeded = {"model": "dspark-tiny", "messages": CHAT["messages"], "max_tokens": 8, "seed": 3, "temperature": 1.0}
    whole = api.chat.completions.create(**seeded).choices[0].message.content
    chunks = list(api.chat.completions.create(**seeded, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-2].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    plain = list(api.completions.create(model="dspark-tiny", prompt="the a of", max_tokens=6, temperature=0,
                                        stream=True))
    assert "".join(c.choices[0].text for c in plain) == text.choices[0].text
    assert all(c.usage is None for c in plain)  # no include_usage: no usage anywhere
    assert streamed == whole  # the same seed streamed: the same text, in pieces
    with pytest.raises(openai.NotFoundError) as e:
        api.chat.completions.create(model="gpt-4", messages=CHAT["messages"])
    assert e.value.code == "model_not_found" and e.value.param == "model"
    auto = api.chat.completions.create(model="dspark-tiny", messages=CHAT["messages"], max_tokens=4, tools=[
        {"type": "function", "function": {"name": "f"}}])  # tool_choice auto (the default): a free answer
    assert auto.choices[0].message.tool_calls is None and auto.choices[0].message.content is not None



def test_structured_output_over_http_with_speculative_decoding(client):
    """response_format json_schema / json_object through the OpenAI client: the content parses and follows
    the schema (when the answer ends before max_tokens), the drafter still drafted; a bad schema is a 400
    naming response_format."""
    import openai

    pytest.importorskip("llguidance")
    api = _openai(client)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "unit": {"enum": ["m", "s"]}},
              "required": ["ok", "unit"], "additionalProperties": False}
    for seed in range(3):
        chat = api.chat.completions.create(
            model="dspark-tiny", messages=CHAT["messages"], max_tokens=40, temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}})
        assert chat.choices[0].finish_reason == "stop", chat.choices[0].message.content
        value = json.loads(chat.choices[0].message.content)
        assert set(value) == {"ok", "unit"} and isinstance(value["ok"], bool) and value["unit"] in ("m", "s")
        assert chat.model_extra["spec_decode"]["rounds"] >= 1
    streamed = api.chat.completions.create(
        model="dspark-tiny", messages=CHAT["messages"], max_tokens=40, temperature=1.0, seed=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}})
    chunks = list(streamed)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop" and set(json.loads(text)) == {"ok", "unit"}  # streamed too
    obj = api.chat.completions.create(model="dspark-tiny", messages=CHAT["messages"], max_tokens=12,
                                      response_format={"type": "json_object"}, temperature=0)
    assert obj.choices[0].message.content.startswith("{")
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(model="dspark-tiny", messages=CHAT["messages"],
                                    response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    assert e.value.param == "response_format"


@pytest.fixture
def long_client(tiny, drafter_dir):
    """The app with a 1024-token context (tiny's tokenizer spends about a token per character of JSON)."""
    from fastapi.testclient import TestClient

    cfg = _serve_config(drafter_dir, max_model_len=1024)
    engine = Engine(*tiny, cfg.engine).start()
    with TestClient(make_app(OpenAIService(engine, cfg))) as c:
        yield c
    engine.stop()


def test_an_earlier_call_is_shown_to_the_model_as_the_call_json_it_writes():
    from dspark.serve.protocol import ChatMessage

    message = ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "w", "arguments": '{"c": "P"}'}}]})
    assert json.loads(message.text()) == {"name": "w", "arguments": {"c": "P"}}


def test_tool_choice_auto_returns_a_call_only_when_the_answer_is_exactly_one():
    from dspark.serve.tools import tool_calls_of, tool_plan

    tools = [{"type": "function", "function": {"name": "w"}}]
    assert tool_plan(tools, None) == (tools, False) and tool_plan(tools, "auto") == (tools, False)
    assert tool_plan(tools, "required") == (tools, True) and tool_plan(tools, "none") == ([], False)
    (call,) = tool_calls_of('{"name": "w", "arguments": {"x": 1}}', ["w"])
    assert call["function"] == {"name": "w", "arguments": '{"x": 1}'}
    for text in ("the weather is fine", '{"name": "v", "arguments": {}}', '{"name": "w"}', "[1]",
                 '{"name": "w", "arguments": 3}'):
        assert tool_calls_of(text, ["w"]) is None, text


def test_tool_calls_required_or_named_are_decoded_under_the_arguments_schema(long_client):
    """tool_choice required / a named function: the answer is one call whose arguments follow that tool's
    schema, returned as tool_calls with finish_reason tool_calls, drafted and verified as usual, streamed too (one
    tool_calls delta in the finish chunk); a choice naming no tool is a 400 naming the field."""
    import openai

    pytest.importorskip("llguidance")
    api = _openai(long_client)
    tools = [{"type": "function", "function": {"name": "w", "parameters": {  # short: tiny's context is 256 tokens
                 "type": "object", "properties": {"c": {"enum": ["P", "O"]}}, "required": ["c"],
                 "additionalProperties": False}}},
             {"type": "function", "function": {"name": "s", "parameters": {
                 "type": "object", "properties": {"n": {"type": "boolean"}}, "required": ["n"],
                 "additionalProperties": False}}}]
    for choice in ("required", {"type": "function", "function": {"name": "w"}}):
        for seed in range(2):
            chat = api.chat.completions.create(model="dspark-tiny", messages=CHAT["messages"], max_tokens=64,
                                               temperature=1.0, seed=seed, tools=tools, tool_choice=choice)
            c = chat.choices[0]
            assert c.finish_reason == "tool_calls" and c.message.content is None, c.message.content
            (call,) = c.message.tool_calls
            args = json.loads(call.function.arguments)
            if call.function.name == "w":
                assert set(args) == {"c"} and args["c"] in ("P", "O")
            else:
                assert choice == "required" and set(args) == {"n"} and isinstance(args["n"], bool)
            assert call.type == "function" and call.id.startswith("call_")
            assert chat.model_extra["spec_decode"]["rounds"] >= 1
    chunks = list(api.chat.completions.create(model="dspark-tiny", messages=CHAT["messages"], max_tokens=64,
                                              temperature=1.0, seed=0, tools=tools, tool_choice="required",
                                              stream=True))
    (last,) = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert last.choices[0].finish_reason == "tool_calls" and not any(c.choices[0].delta.content for c in chunks)
    (streamed,) = last.choices[0].delta.tool_calls
    assert streamed.index == 0 and streamed.id.startswith("call_") and streamed.function.name in ("w", "s")
    assert set(json.loads(streamed.function.arguments)) in ({"c"}, {"n"})
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(model="dspark-tiny", messages=CHAT["messages"], tools=tools,
                                    tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.param == "tool_choice"
    # the call's result goes back in the conversation (assistant tool_calls, then a `tool` message): answered
    history = CHAT["messages"] + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                                  {"role": "tool", "tool_call_id": call.id, "content": "P"}]
    after = api.chat.completions.create(model="dspark-tiny", messages=history, max_tokens=4, tools=tools)
    assert after.choices[0].finish_reason in ("stop", "length", "tool_calls")
    plain = api.chat.completions.create(model="dspark-tiny", messages=CHAT["messages"], max_tokens=4, tools=tools,
                                        tool_choice="none")
    assert plain.choices[0].message.tool_calls is None


def test_async_openai_client_over_asgi(client):
    """The async client on httpx's ASGI transport (the app in this event loop, no server)."""
    from openai import AsyncOpenAI

    async def run():
        transport = httpx.ASGITransport(app=client.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://asgi") as http:
            api = AsyncOpenAI(base_url="http://asgi/v1", api_key="unused", http_client=http, max_retries=0)
            seeded = {"model": "dspark-tiny", "messages": CHAT["messages"], "max_tokens": 8, "seed": 11}
            whole = await api.chat.completions.create(**seeded)
            stream = await api.chat.completions.create(**seeded, stream=True)
            pieces = [c async for c in stream]
            return whole, pieces

    whole, pieces = asyncio.run(run())
    assert "".join(c.choices[0].delta.content or "" for c in pieces) == whole.choices[0].message.content
    assert pieces[-1].choices[0].finish_reason == whole.choices[0].finish_reason



def test_seed_reproduces_the_sample(client):
    """Same seed and settings: the same tokens (temperature 1); another seed: another sample."""
    api = _openai(client)

    def run(seed):
        out = api.completions.create(model="dspark-tiny", prompt=[5, 6, 7, 8], max_tokens=24, temperature=1.0,
                                     seed=seed, extra_body={"ignore_eos": True})
        return out.choices[0].model_extra["token_ids"]

    first = run(1234)
    assert len(first) == 24 and run(1234) == first and run(4321) != first
    chat = [api.chat.completions.create(model="dspark-tiny", messages=CHAT["messages"], max_tokens=16, seed=7,
                                        temperature=1.0).choices[0].message.content for _ in range(2)]
    assert chat[0] == chat[1]



def test_stop_string_ends_text_and_usage_at_the_stop(client, tiny):
    """The text ends before the stop string; usage and token_ids count the tokens up to the one that
    completed it, not what the engine generated after it in the same step."""
    tok = tiny[0].tokenizer
    base = {"prompt": [5, 6, 7, 8], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    full = _post(client, "completions", base).json()["choices"][0]
    ids, text = full["token_ids"], full["text"]
    stop = next(text[i: i + 2] for i in range(len(text) // 3, len(text) - 2)
                if text[i: i + 2].isascii() and text[i: i + 2].strip() == text[i: i + 2])
    needed = next(k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k], skip_special_tokens=True))
    out = _post(client, "completions", {**base, "stop": stop}).json()
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"] == text[: text.find(stop)]
    assert choice["token_ids"] == ids[:needed] and out["usage"]["completion_tokens"] == needed
    with client.stream("POST", ROUTES["completions"], json={**base, "stop": stop, "stream": True,
                                                            "stream_options": {"include_usage": True}}) as resp:
        chunks = _sse_events(resp.iter_lines())
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == text[: text.find(stop)]
    assert chunks[-1]["usage"]["completion_tokens"] == needed



def test_text_assembler_equals_a_full_decode(tiny):
    """Incremental detokenization (DecodeStream) gives exactly decode() of the whole answer, multi-byte
    characters split over tokens and random (invalid UTF-8) byte tokens included."""
    tok = tiny[0].tokenizer
    gen = torch.Generator().manual_seed(0)
    cases = [tok("héllo 漢字 🙂 the a of")["input_ids"]] + [
        torch.randint(0, tiny[0].vocab_size, (40,), generator=gen).tolist() for _ in range(5)]
    for ids in cases:
        assembler, streamed = TextAssembler(tok, None), ""
        for n in range(1, len(ids) + 1):
            streamed += assembler.update(ids[:n], n == len(ids))[0]
        assert streamed == assembler.text == tok.decode(ids, skip_special_tokens=True)
        assert assembler.n_tokens == len(ids)



@pytest.fixture
def live_server(tiny, drafter_dir):
    """The app served by uvicorn on a free port, in a thread (real sockets, no Ray)."""
    import threading

    import uvicorn

    cfg = _serve_config(drafter_dir)
    engine = Engine(*tiny, cfg.engine).start()
    server = uvicorn.Server(uvicorn.Config(make_app(OpenAIService(engine, cfg)), host="127.0.0.1", port=0,
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        engine.stop()



def test_a_20mb_body_is_refused_fast_while_others_keep_their_latency(live_server):
    small = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
    big = b'{"prompt": "' + b"the a of " * 2_300_000 + b'"}'  # ~20 MB
    assert len(big) > 20_000_000

    async def timed(coro):
        t0 = time.perf_counter()
        resp = await coro
        return resp, time.perf_counter() - t0

    async def run():
        async with httpx.AsyncClient(base_url=live_server, timeout=30) as c:
            alone = [(await timed(c.post(ROUTES["completions"], json=small)))[1] for _ in range(3)]
            async def upload():  # no Content-Length: a chunked upload, refused once past the limit
                for i in range(0, len(big), 2**20):
                    yield big[i: i + 2**20]

            chunked = await timed(c.post(ROUTES["completions"], content=upload(),
                                         headers={"content-type": "application/json"}))
            mixed = await asyncio.gather(
                timed(c.post(ROUTES["completions"], content=big, headers={"content-type": "application/json"})),
                *(timed(c.post(ROUTES["completions"], json=small)) for _ in range(3)))
            return sorted(alone)[1], chunked, mixed

    alone, chunked, ((big_resp, big_s), *others) = asyncio.run(run())
    for resp, seconds in (chunked, (big_resp, big_s)):  # by Content-Length, and a chunked upload
        assert _check_error_shape(resp, 413)["code"] == "request_too_large" and seconds < 1.0
    assert all(r.status_code == 200 for r, _ in others)
    # the small requests share the client's event loop with the 20 MB upload, so under xdist on 2 cores they
    # wait for its chunks too (0.7 s seen once); a server that parsed the body inline would take seconds
    assert max(s for _, s in others) < alone + 1.0, (alone, [s for _, s in others])
    print(f"\n[serve] 20 MB body refused in {big_s * 1000:.0f} ms; small requests {alone * 1000:.0f} ms alone, "
          f"{max(s for _, s in others) * 1000:.0f} ms next to it")



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]



@pytest.fixture(scope="module")
def served(drafter_dir):
    """One Serve deployment for the module: tiny target, dynamic scheduler (SPS profiled at start),
    API key required."""
    from pipelines.ray_cluster import init_ray
    from dspark.config import RayConfig
    from ray import serve

    from dspark.serve.deployment import deployment_for

    os.environ[KEY_ENV] = "test-key"
    cfg = _serve_config(drafter_dir, sps_table=None, sps_batch_sizes=[1, 8, 32], sps_repeats=1, sps_context=32)
    cfg.deployment.num_cpus = 1
    cfg.deployment.max_ongoing_requests = 64
    port = _free_port()
    init_ray(RayConfig(num_cpus=2))
    import ray

    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(deployment_for(cfg), name="dspark-test", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        from jobs.serve import wait_ready

        wait_ready(url, timeout_s=60)
        yield url, {"authorization": "Bearer test-key"}
    finally:
        os.environ.pop(KEY_ENV, None)
        serve.shutdown()
        ray.shutdown()


def test_draft_trees_serve_over_http(tiny, drafter_dir):
    """engine.draft_tree in the serve config: greedy completions equal target-only decoding, streaming
    works, and spec_decode counts the tree's nodes as proposed drafts (depth γ verified per round)."""
    from fastapi.testclient import TestClient

    cfg = _serve_config(drafter_dir, draft_tree=[2, 2], tree_max_rows=4)
    engine = Engine(*tiny, cfg.engine).start()
    try:
        with TestClient(make_app(OpenAIService(engine, cfg))) as client:
            prompts = [[5, 6, 7, 8], [100, 101]]
            out = _post(client, "completions", {"prompt": prompts, "max_tokens": 12, "temperature": 0}).json()
            for prompt, choice in zip(prompts, out["choices"]):
                assert choice["token_ids"] == target_generate(tiny[0], prompt, SamplingParams(temperature=0), 12).token_ids
            spec = _post(client, "chat", {**CHAT, "temperature": 0}).json()["spec_decode"]
            assert spec["draft_tokens_proposed"] == (2 + 4 + 4 + 4) * spec["rounds"]
            assert spec["draft_tokens_verified"] == 4 * spec["rounds"]
            with client.stream("POST", ROUTES["chat"], json={**CHAT, "max_tokens": 12, "stream": True}) as resp:
                assert resp.status_code == 200 and _sse_events(resp.iter_lines())
            assert client.get("/v1/stats").json()["draft_tree"] == [2, 2]
    finally:
        engine.stop()
