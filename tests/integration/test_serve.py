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




import time

import httpx

import pytest











from tests.unit.serve.test_serve import BAD_INPUTS, CHAT, KEY_ENV, ROUTES, _check_bad_input, _check_error_shape, _free_port, _post, _serve_config, _sse_events, drafter_dir, served, tiny  # noqa: F401 (shared helpers and fixtures)



@pytest.mark.integration
def test_serve_32_concurrent_requests_complete(served):
    url, auth = served

    async def run():
        async with httpx.AsyncClient(base_url=url, headers=auth, timeout=120) as c:
            bodies = [{"messages": [{"role": "user", "content": f"question {i}: add the sum"}], "max_tokens": 12,
                       "temperature": 1.0} for i in range(32)]
            return await asyncio.gather(*(c.post("/v1/chat/completions", json=b) for b in bodies))

    t0 = time.time()
    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200] * 32
    for r in responses:
        body = r.json()
        assert body["choices"][0]["finish_reason"] in ("stop", "length") and body["usage"]["completion_tokens"] >= 1
    stats = httpx.get(f"{url}/v1/stats", headers=auth).json()
    assert stats["totals"]["finished"] >= 32 and stats["sps_table"] and set(stats["sps_table"]) == {"1", "8", "32"}
    print(f"\n[serve] 32 concurrent chat requests in {time.time() - t0:.1f} s; "
          f"mean batch tokens {stats['mean_batch_tokens']:.1f}, verify budget {stats['mean_verify_budget']:.2f}")



@pytest.mark.integration
def test_serve_rejects_bad_input_and_missing_key(served):
    url, auth = served
    with httpx.Client(base_url=url, timeout=60) as c:
        assert c.post(ROUTES["chat"], json=CHAT).status_code == 401
        assert c.post(ROUTES["chat"], json=CHAT, headers={"authorization": "Bearer nope"}).status_code == 401
        assert c.get("/healthz").status_code == 200
        for route, body, param in BAD_INPUTS:
            _check_bad_input(_post(c, route, body, **auth), param)



@pytest.mark.integration
def test_serve_streams_sse_and_works_with_the_openai_client(served):
    from openai import OpenAI

    url, auth = served
    with httpx.Client(base_url=url, headers=auth, timeout=60) as c:
        with c.stream("POST", ROUTES["chat"], json={**CHAT, "stream": True}) as resp:
            assert resp.status_code == 200
            chunks = _sse_events(resp.iter_lines())
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    client = OpenAI(base_url=f"{url}/v1", api_key="test-key", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["dspark-tiny"]
    chat = client.chat.completions.create(model="dspark-tiny", messages=CHAT["messages"], max_tokens=8)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
    assert chat.model_extra["spec_decode"]["rounds"] >= 1
    text = client.completions.create(model="dspark-tiny", prompt="the a of", max_tokens=6, temperature=0)
    assert text.choices[0].finish_reason in ("stop", "length")
    pieces = list(client.chat.completions.create(model="dspark-tiny", messages=CHAT["messages"], max_tokens=8,
                                                 stream=True))
    assert pieces[-1].choices[0].finish_reason in ("stop", "length")
    import openai

    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="dspark-tiny", messages=CHAT["messages"], temperature=-1)
