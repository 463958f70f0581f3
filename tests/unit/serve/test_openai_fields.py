"""The OpenAI fields users rely on (issue #22 items 7-8), through the official `openai` client against
the in-process app on the built-in `tiny` target (engine in its background thread, no Ray):
logprobs / top_logprobs (the target's own log-probabilities, streaming included), n > 1, min_p,
stop_token_ids, include_stop_str_in_output, skip_special_tokens, chat_template_kwargs, the
temperature bound, unknown fields, GET /health and GET /metrics, and a seeded request's output
independent of concurrent traffic. The χ² check (n > 1 with logprobs on, over HTTP) runs on a micro
target whose exact joint is computable."""
from __future__ import annotations

import asyncio
import math

import httpx
import numpy as np
import openai
import pytest
import torch
from openai import AsyncOpenAI, OpenAI

from dspark.decoding.engine import Engine
from dspark.decoding.sampling import SamplingParams, to_logprobs
from dspark.drafters import DrafterConfig, build_drafter
from dspark.models.target import load_target
from dspark.serve.app import make_app
from dspark.serve.config import ServeConfig
from dspark.serve.service import OpenAIService
from dspark.serve.text import TextAssembler
from tests.lossless_stats import chi2_pvalue, exact_joint
from tests.tiny_models import build_tiny_model
from tests.unit.serve.test_serve import drafter_dir, tiny  # noqa: F401 (shared module fixtures)

MODEL = "dspark-tiny"
MESSAGES = [{"role": "user", "content": "what is the sum"}]
# Qwen3's switch, reduced to the variable: the empty think block only when enable_thinking is false
THINK_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


def _config(drafter_dir: str | None, mode: str = "dynamic", **api) -> ServeConfig:
    return ServeConfig.model_validate({
        "model": {"target": "tiny", "drafter": drafter_dir, "served_name": MODEL},
        "engine": {"scheduler": {"mode": mode}, "max_model_len": 256, "max_batch": 32,
                   "sps_table": {1: 300.0, 32: 100.0, 256: 20.0}},
        "api": {"api_key_env": "DSPARK_TEST_FIELDS_KEY", "max_tokens_limit": 64, "default_max_tokens": 16, **api},
    })


class Served:
    """An engine + app + TestClient, and the official clients on it."""

    def __init__(self, target, drafter, cfg: ServeConfig):
        from fastapi.testclient import TestClient

        self.target = target
        self.engine = Engine(target, drafter, cfg.engine).start()
        self.app = make_app(OpenAIService(self.engine, cfg))
        self.http = TestClient(self.app).__enter__()
        self.api = OpenAI(base_url=f"{self.http.base_url}/v1", api_key="unused", http_client=self.http,
                          max_retries=0)

    def close(self):
        self.http.__exit__(None, None, None)
        self.engine.stop()


@pytest.fixture(scope="module")
def served(tiny, drafter_dir):
    s = Served(*tiny, _config(drafter_dir))
    yield s
    s.close()


def _target_logprobs(target, prompt: list[int], tokens: list[int], sp: SamplingParams, mode="processed"):
    """[len(tokens), V] log-probabilities of each output position, from one target forward."""
    with torch.no_grad():
        logits = target.forward(torch.tensor([prompt + tokens]), logits_at="all").logits[0]
    return to_logprobs(logits[len(prompt) - 1: len(prompt) - 1 + len(tokens)], sp, mode)


# ---- logprobs ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.7, "top_p": 0.9, "seed": 5}])
def test_completion_logprobs_are_the_targets(served, sampling):
    """Each emitted token's logprob and the top alternatives equal the target's own, from a plain forward
    over prompt + output, in the distribution the token was drawn from (temperature, top-p applied;
    raw at temperature 0); the streamed logprobs are the same entries."""
    prompt = [5, 6, 7, 8]
    out = served.api.completions.create(model=MODEL, prompt=prompt, max_tokens=12, logprobs=3,
                                        extra_body={"ignore_eos": True}, **sampling)
    choice = out.choices[0]
    ids, lp = choice.model_extra["token_ids"], choice.logprobs
    assert len(lp.token_logprobs) == len(lp.tokens) == len(ids) == out.usage.completion_tokens == 12
    sp = SamplingParams(temperature=sampling["temperature"], top_p=sampling.get("top_p", 1.0))
    ref = _target_logprobs(served.target, prompt, ids, sp)
    tok = served.target.tokenizer
    for k, tid in enumerate(ids):
        assert lp.tokens[k] == tok.decode([tid]) and lp.token_logprobs[k] == pytest.approx(float(ref[k, tid]), abs=1e-4)
        values, top = ref[k].topk(3)
        want = {tok.decode([t]): max(v, -9999.0) for t, v in zip(top.tolist(), values.tolist())}
        assert lp.top_logprobs[k] == pytest.approx(want, abs=1e-4)
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    streamed = list(served.api.completions.create(model=MODEL, prompt=prompt, max_tokens=12, logprobs=3, stream=True,
                                                  extra_body={"ignore_eos": True}, **sampling))
    pieces = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert sum((p.token_logprobs for p in pieces), []) == lp.token_logprobs
    assert sum((p.text_offset for p in pieces), []) == lp.text_offset


def test_chat_logprobs_with_top_alternatives_streamed_and_not(served):
    body = dict(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=1.0, seed=21, logprobs=True,
                top_logprobs=2)
    chat = served.api.chat.completions.create(**body)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)
    assert all(c.logprob <= 0 and c.bytes == list(c.token.encode()) for c in content)
    chunks = list(served.api.chat.completions.create(**body, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = served.api.chat.completions.create(**{**body, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


# ---- n > 1 ---------------------------------------------------------------------------------------------
def test_n_choices_are_independent_samples(served):
    body = dict(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=16, temperature=1.0, seed=77,
                extra_body={"ignore_eos": True})
    three = served.api.completions.create(**body, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    ids = [c.model_extra["token_ids"] for c in three.choices]
    assert len({tuple(i) for i in ids}) == 3  # 16 tokens from 512: three different samples
    assert three.usage.prompt_tokens == 4 and three.usage.completion_tokens == 48
    one = served.api.completions.create(**body)
    assert one.choices[0].model_extra["token_ids"] == ids[0]  # choice 0 uses the request's seed
    assert served.api.completions.create(**body, n=3).choices[2].model_extra["token_ids"] == ids[2]
    two_prompts = served.api.completions.create(**{**body, "prompt": [[5, 6, 7, 8], [9, 10]]}, n=2)
    assert [c.index for c in two_prompts.choices] == [0, 1, 2, 3] and two_prompts.usage.prompt_tokens == 6
    chat = served.api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, seed=3, n=2)
    chunks = list(served.api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, seed=3, n=2,
                                                     stream=True, stream_options={"include_usage": True}))
    for i in range(2):
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
        assert text == chat.choices[i].message.content
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].index == i][-1]
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    with pytest.raises(openai.BadRequestError) as e:
        served.api.completions.create(**body, n=17)
    assert e.value.param == "n"


# ---- sampling and stopping fields -------------------------------------------------------------------------
def test_min_p_one_keeps_only_the_argmax(served):
    greedy = served.api.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=16, temperature=0,
                                           extra_body={"ignore_eos": True})
    for seed in (1, 2):
        sampled = served.api.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=16, temperature=1.5,
                                                seed=seed, extra_body={"ignore_eos": True, "min_p": 1.0})
        assert sampled.choices[0].model_extra["token_ids"] == greedy.choices[0].model_extra["token_ids"]


def test_stop_token_ids_and_include_stop_str_in_output(served):
    tok = served.target.tokenizer
    base = dict(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=24, temperature=0)
    full = served.api.completions.create(**base, extra_body={"ignore_eos": True}).choices[0]
    ids = full.model_extra["token_ids"]
    stop = ids[5]
    cut = ids.index(stop) + 1
    out = served.api.completions.create(**base, extra_body={"ignore_eos": True, "stop_token_ids": [stop]})
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra["token_ids"] == ids[:cut]
    assert choice.text == tok.decode(ids[: cut - 1]) and out.usage.completion_tokens == cut
    kept = served.api.completions.create(**base, extra_body={"ignore_eos": True, "stop_token_ids": [stop],
                                                             "include_stop_str_in_output": True}).choices[0]
    assert kept.text == tok.decode(ids[:cut])
    text = full.text
    stop_str = next(text[i: i + 2] for i in range(len(text) // 3, len(text) - 2)
                    if text[i: i + 2].isascii() and text[i: i + 2].strip() == text[i: i + 2])
    with_stop = served.api.completions.create(**base, stop=stop_str,
                                              extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert with_stop.choices[0].text == text[: text.find(stop_str) + len(stop_str)]


def test_skip_special_tokens(tiny):
    tok = tiny[0].tokenizer
    ids = tok("the a of")["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")] + tok("the")["input_ids"]
    shown, hidden = TextAssembler(tok, None, skip_special_tokens=False), TextAssembler(tok, None)
    assert "<|im_end|>" in shown.update(ids, True)[0] and "<|im_end|>" not in hidden.update(ids, True)[0]


def test_skip_special_tokens_and_eos_text_over_http(served):
    """A greedy answer that ends at EOS: its text shows <|im_end|> only with skip_special_tokens=false and
    include_stop_str_in_output=true (the stop token's text is never shown otherwise, as in vLLM)."""
    tok, eos = served.target.tokenizer, served.target.eos_token_ids[0]
    ending = next(p for p in ([k] for k in range(3, 200))
                  if served.api.completions.create(model=MODEL, prompt=p, max_tokens=24,
                                                   temperature=0).choices[0].finish_reason == "stop")
    base = dict(model=MODEL, prompt=ending, max_tokens=24, temperature=0)
    plain = served.api.completions.create(**base).choices[0]
    assert plain.model_extra["token_ids"][-1] == eos and "<|im_end|>" not in plain.text
    raw = served.api.completions.create(**base, extra_body={"skip_special_tokens": False}).choices[0]
    assert raw.text == plain.text  # the stop token's text stays out
    shown = served.api.completions.create(**base, extra_body={"skip_special_tokens": False,
                                                              "include_stop_str_in_output": True}).choices[0]
    assert shown.text == tok.decode(plain.model_extra["token_ids"], skip_special_tokens=False)
    assert shown.text.endswith("<|im_end|>")


def test_chat_template_kwargs_are_passed_or_refused(served, tiny):
    with pytest.raises(openai.BadRequestError) as e:  # tiny's ChatML template has no enable_thinking
        served.api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert e.value.param == "chat_template_kwargs.enable_thinking" and "has no variable" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        served.api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, reasoning_effort="low")
    assert e.value.param == "reasoning_effort"
    with pytest.raises(openai.BadRequestError) as e:
        served.api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                           extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})
    assert e.value.param == "chat_template_kwargs.add_generation_prompt"
    target = load_target("tiny")
    target.tokenizer.chat_template = THINK_TEMPLATE
    thinking = Served(target, None, _config(None, mode="off"))
    try:
        def prompt_tokens(**extra):
            return thinking.api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1,
                                                        **extra).usage.prompt_tokens

        think_block = len(target.tokenizer("<think>\n\n</think>\n\n", add_special_tokens=False)["input_ids"])
        off = prompt_tokens()  # the server's default for templates that read it: non-thinking
        on = prompt_tokens(extra_body={"chat_template_kwargs": {"enable_thinking": True}})
        assert off - on == think_block > 0
        assert prompt_tokens(extra_body={"chat_template_kwargs": {"enable_thinking": False}}) == off
    finally:
        thinking.close()


@pytest.mark.parametrize("route,body,param", [
    ("chat", {"temperature": 2.5}, "temperature"), ("completions", {"temperature": 3}, "temperature"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"), ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("completions", {"logprobs": 21}, "logprobs"), ("chat", {"min_p": 1.5}, "min_p"),
    ("chat", {"frobnicate": 1}, "frobnicate"), ("completions", {"guided_json": {}}, "guided_json"),
    ("chat", {"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options.continuous_usage_stats"),
    ("completions", {"stop_token_ids": [512]}, "stop_token_ids"), ("chat", {"store": True}, "store"),
    ("chat", {"n": 0}, "n")])
def test_every_field_is_honoured_or_refused(served, route, body, param):
    base = {"messages": MESSAGES} if route == "chat" else {"prompt": "the a of"}
    resp = served.http.post(f"/v1/{'chat/' if route == 'chat' else ''}completions",
                            json={**base, "max_tokens": 2, **body})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and param.split(".")[-1] in err["message"]
    ok = served.http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, "temperature": 2})
    assert ok.status_code == 200


# ---- /health and /metrics ----------------------------------------------------------------------------------
def test_health_and_prometheus_metrics(served):
    from prometheus_client.parser import text_string_to_metric_families

    resp = served.http.get("/health")
    assert resp.status_code == 200 and resp.content == b""
    served.api.completions.create(model=MODEL, prompt="the a of", max_tokens=3)
    served.http.post("/v1/completions", json={"prompt": "a", "temperature": 9})
    resp = served.http.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(resp.text) for s in f.samples}
    ok = samples[("dspark_http_requests_total", (("method", "POST"), ("route", "/v1/completions"), ("status", "200")))]
    bad = samples[("dspark_http_requests_total", (("method", "POST"), ("route", "/v1/completions"), ("status", "400")))]
    assert ok >= 1 and bad >= 1
    assert samples[("dspark_generation_tokens_total", (("model_name", MODEL),))] >= 3
    assert samples[("dspark_num_requests_waiting", (("model_name", MODEL),))] == 0
    assert samples[("dspark_engine_healthy", (("model_name", MODEL),))] == 1
    served.http.get("/no/such/path")
    again = served.http.get("/metrics").text
    assert 'route="other"' in again and "/no/such/path" not in again


def test_spec_decode_counters_carry_vllms_names_on_metrics(served):
    """/metrics counts what the responses' spec_decode objects report, under vLLM's metric names."""
    from prometheus_client.parser import text_string_to_metric_families

    def counters() -> dict:
        text = served.http.get("/metrics").text
        return {(s.name, s.labels.get("position")): s.value for f in text_string_to_metric_families(text)
                for s in f.samples if s.name.startswith("vllm:spec_decode") and s.name.endswith("_total")}

    before = counters()
    accepted = verified = 0
    for i in range(3):
        body = served.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": f"sum {i}"}],
                                                              "max_tokens": 16, "temperature": 0}).json()
        accepted += body["spec_decode"]["draft_tokens_accepted"]
        verified += body["spec_decode"]["draft_tokens_verified"]
    after = counters()
    delta = {key: after[key] - before.get(key, 0.0) for key in after}
    assert verified > 0, "the drafter drafted"
    assert delta[("vllm:spec_decode_num_draft_tokens_total", None)] == verified
    assert delta[("vllm:spec_decode_num_accepted_tokens_total", None)] == accepted
    assert 0 < delta[("vllm:spec_decode_num_drafts_total", None)] <= verified
    per_pos = sum(v for (name, pos), v in delta.items() if name.endswith("_per_pos_total"))
    assert per_pos == accepted  # every accepted draft counted at its position


def test_health_is_503_when_the_engine_is_unhealthy(tiny):
    s = Served(tiny[0], None, _config(None, mode="off"))
    try:
        s.engine.healthy, s.engine.health_error = False, "simulated device loss"
        resp = s.http.get("/health")
        assert resp.status_code == 503 and "simulated device loss" in resp.json()["error"]["message"]
    finally:
        s.close()


# ---- seed: independent of the other traffic -------------------------------------------------------------------
def test_seeded_output_does_not_depend_on_concurrent_requests(served):
    """The same seed alone and alongside concurrent unseeded requests (the dynamic scheduler then picks
    other verify lengths for it): the same tokens."""
    body = dict(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=40, temperature=1.0, seed=2024,
                extra_body={"ignore_eos": True})
    alone = served.api.completions.create(**body).choices[0].model_extra["token_ids"]

    async def crowd():
        transport = httpx.ASGITransport(app=served.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://asgi") as http:
            api = AsyncOpenAI(base_url="http://asgi/v1", api_key="unused", http_client=http, max_retries=0)
            others = [api.completions.create(model=MODEL, prompt=[9 + k] * (3 + 5 * k), max_tokens=40,
                                             temperature=1.0, extra_body={"ignore_eos": True}) for k in range(5)]
            outs = await asyncio.gather(api.completions.create(**body), *others)
            return outs[0].choices[0].model_extra["token_ids"]

    before = served.engine.stats()["totals"]["steps"]
    assert asyncio.run(crowd()) == alone
    assert served.engine.stats()["totals"]["steps"] > before


# ---- χ²: n > 1 with logprobs on stays lossless ------------------------------------------------------------------
def test_n_choices_with_logprobs_are_lossless_over_http():
    """Completions with n=16, logprobs on, temperature 1, on a micro target (vocabulary 8) with a DSpark
    drafter under the dynamic scheduler: the joint of the first three tokens over 1600 choices matches
    the target's exact joint (χ²), and every reported logprob is the exact conditional log-probability."""
    vocab, prompt, runs = 8, [1, 5, 2, 7, 3], 1600
    target = build_tiny_model(vocab_size=vocab, seed=0, num_layers=3, hidden_size=32, init_std=0.3)
    torch.manual_seed(0)
    drafter = build_drafter(DrafterConfig(algo="dspark", block_size=3, num_layers=1, num_context_layers=2, rank=8,
                                          init_std=0.2), target)
    cfg = ServeConfig.model_validate({
        "model": {"target": "micro", "served_name": "micro"},
        "engine": {"scheduler": {"mode": "dynamic"}, "max_batch": 96, "max_waiting": 4096, "max_model_len": 64,
                   "sps_table": {1: 100.0, 128: 60.0, 512: 25.0}, "seed": 0},
        "api": {"max_choices": 16}})
    s = Served(target, drafter, cfg)
    try:
        async def sample_all():
            transport = httpx.ASGITransport(app=s.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://asgi", timeout=120) as http:
                api = AsyncOpenAI(base_url="http://asgi/v1", api_key="unused", http_client=http, max_retries=0)
                calls = [api.completions.create(model="micro", prompt=prompt, n=16, max_tokens=3, temperature=1.0,
                                                logprobs=1, extra_body={"ignore_eos": True})
                         for _ in range(runs // 16)]
                return await asyncio.gather(*calls)

        outs = asyncio.run(sample_all())
    finally:
        s.close()
    sp = SamplingParams(temperature=1.0)
    joint = exact_joint(target, prompt, 3, sp, vocab)
    counts = np.zeros([vocab] * 3)
    for out in outs:
        for c in out.choices:
            ids = c.model_extra["token_ids"]
            counts[tuple(ids)] += 1
            cond = [joint.sum((1, 2))[ids[0]], joint[ids[0]].sum(1)[ids[1]] / joint[ids[0]].sum(),
                    joint[ids[0], ids[1], ids[2]] / joint[ids[0], ids[1]].sum()]
            assert c.logprobs.token_logprobs == pytest.approx([math.log(p) for p in cond], abs=1e-4)
    assert counts.sum() == runs
    totals = s.engine.stats()["totals"]
    assert 0 < totals["accepted"] < totals["verified"]  # drafts were both accepted and rejected
    assert chi2_pvalue(counts.sum(2), joint.sum(2)) > 1e-3 and chi2_pvalue(counts.sum(0), joint.sum(0)) > 1e-3


def test_x_request_id_is_echoed_names_the_response_and_is_validated(served):
    auth = {"authorization": "Bearer unused"}
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4}
    ok = served.http.post("/v1/chat/completions", json=body, headers={**auth, "X-Request-Id": "trace-7.a:b_c"})
    assert ok.status_code == 200, ok.text
    assert ok.headers["x-request-id"] == "trace-7.a:b_c" and ok.json()["id"] == "chatcmpl-trace-7.a:b_c"
    streamed = served.http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": True},
                                headers={**auth, "X-Request-Id": "s1"})
    assert streamed.status_code == 200 and streamed.headers["x-request-id"] == "s1" and '"cmpl-s1"' in streamed.text
    for bad in ("has space", "x" * 129, "a/b"):
        r = served.http.post("/v1/chat/completions", json=body, headers={**auth, "X-Request-Id": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "x-request-id", r.text
    plain = served.http.post("/v1/chat/completions", json=body, headers=auth)
    assert "x-request-id" not in plain.headers and plain.json()["id"].startswith("chatcmpl-")

