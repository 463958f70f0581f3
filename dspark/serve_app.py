"""OpenAI-compatible HTTP serving of the draft-plus-verify engine on Ray Serve.

Pieces, top to bottom:
- `ServeConfig`: what to serve (target, drafter reference, device, engine + scheduler), the HTTP API
  limits and auth, and the Ray Serve deployment shape (replicas, max ongoing/queued requests, CPUs,
  GPUs). `resolve_device` turns model.device ("auto" | "cpu" | "cuda") into the replica's device.
- `OpenAIService`: protocol logic without Ray — request validation, chat template / tokenization,
  submission to the engine (which runs in its own thread), non-streaming and SSE responses with
  `usage` and `spec_decode`. `make_app(service)` wraps it in a FastAPI app:
      POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /healthz, GET /v1/stats
- `DSparkServer`: the Ray Serve deployment (FastAPI ingress) hosting one engine per replica, with
  per-replica metrics exported through `ray.serve.metrics`.
- `deployment_for(cfg)` / `build_app(args)`: the bound application, for `jobs/serve.py` and for
  `serve deploy infra/serve/serve_config.yaml`.

Errors follow OpenAI's shape {"error": {"message", "type", "param", "code"}}: invalid JSON and bad
fields -> 400 naming the field, missing/wrong API key -> 401, full queue -> 429, engine unhealthy
-> 503 (Ray Serve itself answers 503 when its own request queue is full).
"""
from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import os
import time
import uuid
from typing import Any, Literal

from fastapi import Depends, FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from dspark.config import StrictModel, config_to_dict
from dspark.engine import Engine, EngineConfig, EngineUnavailableError, QueueFullError, Request, StepReport
from dspark.sampling import SamplingParams

log = logging.getLogger("dspark.serve")


# ---- configuration ----------------------------------------------------------------------------------
class ModelSection(StrictModel):
    target: str = "tiny"  # "tiny" | "smollm2-135m" | local dir | s3:// dir | hub name
    drafter: str | None = None  # local dir | s3://... | runs:/<id>/<path> | models:/<name>@<alias> (None: mode off)
    served_name: str | None = None  # the `model` clients send; None -> "dspark-<target>"
    dtype: Literal["float32", "bfloat16"] = "float32"
    # "auto": cuda when this replica has a GPU assigned and CUDA works, else cpu; "cuda" fails the
    # replica start (naming this key) where CUDA is unavailable, instead of silently serving on CPU
    device: Literal["auto", "cpu", "cuda"] = "auto"


class ApiSection(StrictModel):
    api_key_env: str = "DSPARK_API_KEY"  # when this env var is set on the replica, Bearer auth is required
    max_tokens_limit: int = 1024  # largest max_tokens a request may ask for
    default_max_tokens: int = 256  # when a request gives none (capped by the room left in the context)
    max_prompts: int = 16  # prompts per /v1/completions request


class DeploymentSection(StrictModel):
    name: str = "dspark"  # Serve application name
    num_replicas: int = 1
    max_ongoing_requests: int = 128  # per replica; keep >= engine.max_batch so the engine can batch
    max_queued_requests: int = 256  # Serve-side queue; beyond it Serve answers 503
    num_cpus: float = 1.0  # CPUs reserved per replica (fractional is fine)
    num_gpus: float = Field(0.0, ge=0)  # GPUs reserved per replica (ray_actor_options.num_gpus)
    torch_threads: int | None = None  # None -> max(1, round(num_cpus))
    health_check_period_s: float = 10.0
    health_check_timeout_s: float = 30.0


class HttpSection(StrictModel):
    host: str = "127.0.0.1"
    port: int = 8000
    route_prefix: str = "/"


class ServeConfig(StrictModel):
    model: ModelSection = Field(default_factory=ModelSection)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    api: ApiSection = Field(default_factory=ApiSection)
    deployment: DeploymentSection = Field(default_factory=DeploymentSection)
    http: HttpSection = Field(default_factory=HttpSection)


def served_name(cfg: ServeConfig) -> str:
    return cfg.model.served_name or f"dspark-{os.path.basename(cfg.model.target.rstrip('/'))}"


def replica_has_gpus(cfg: ServeConfig) -> bool:
    """Whether this process was given GPUs. Inside a Ray actor (a Serve replica) Ray's own assignment
    decides: it also sees num_gpus set outside the ServeConfig (a Serve YAML / RayService
    `deployments:` entry overrides ray_actor_options). Elsewhere: deployment.num_gpus > 0."""
    try:
        import ray
    except ImportError:
        return cfg.deployment.num_gpus > 0
    if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
        return bool(ray.get_runtime_context().get_accelerator_ids().get("GPU"))
    return cfg.deployment.num_gpus > 0


def resolve_device(setting: str, has_gpus: bool) -> str:
    """model.device -> the torch device target, drafter and engine tensors live on ("cpu" | "cuda")."""
    import torch

    cuda = torch.cuda.is_available()
    if setting == "cuda" and not cuda:
        raise ValueError("model.device='cuda' but CUDA is not available on this replica "
                         "(torch.cuda.is_available() is False); give the deployment a GPU "
                         "(deployment.num_gpus / ray_actor_options.num_gpus) with a CUDA build of torch, "
                         "or set model.device to 'auto' or 'cpu'")
    if setting == "auto":
        if has_gpus and not cuda:
            log.warning("model.device=auto: GPUs are assigned but CUDA is unavailable; serving on cpu")
        return "cuda" if has_gpus and cuda else "cpu"
    return setting


def build_engine(cfg: ServeConfig, device: str | None = None) -> Engine:
    """Load the target and drafter named in the config and start nothing (call engine.start()).
    device None: resolved from model.device (see `resolve_device`)."""
    import torch

    from dspark.io.drafter_source import load_drafter_ref
    from dspark.target import load_target

    device = device or resolve_device(cfg.model.device, replica_has_gpus(cfg))
    target = load_target(cfg.model.target, dtype=getattr(torch, cfg.model.dtype), device=device)
    drafter = None
    if cfg.engine.scheduler.mode != "off":
        if not cfg.model.drafter:
            raise ValueError(f"engine.scheduler.mode={cfg.engine.scheduler.mode!r} needs model.drafter "
                             "(a local dir, s3://, runs:/ or models:/ reference); or set engine.scheduler.mode=off")
        drafter = load_drafter_ref(cfg.model.drafter, target, device=device).eval()
    return Engine(target, drafter, cfg.engine)  # the engine puts its KV slots and RNG on target.device


# ---- request bodies -----------------------------------------------------------------------------------
class _Body(BaseModel):
    """Common OpenAI sampling fields; unknown fields are ignored (clients send many)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    stream: bool = False
    stop: str | list[str] | None = None
    stream_options: dict | None = None
    ignore_eos: bool = False  # extension (as in vLLM): do not stop at the target's EOS (benchmarks)

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, v):
        if v is not None and v < 1:
            raise ValueError("max_tokens must be >= 1")
        return v

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v):
        if not v >= 0:
            raise ValueError("temperature must be >= 0 (0 = greedy)")
        return v

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v):
        if not 0 < v <= 1:
            raise ValueError("top_p must be in (0, 1]")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v):
        if v < 0:
            raise ValueError("top_k must be >= 0 (0 = off)")
        return v

    @field_validator("n")
    @classmethod
    def _n(cls, v):
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stops or None

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = ""

    def text(self) -> str:
        if isinstance(self.content, list):
            if any(part.get("type") != "text" for part in self.content):
                raise ValueError("only text content parts are supported")
            return "".join(str(part.get("text", "")) for part in self.content)
        return self.content or ""


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None

    @field_validator("max_completion_tokens")
    @classmethod
    def _max_completion_tokens(cls, v):
        if v is not None and v < 1:
            raise ValueError("max_completion_tokens must be >= 1")
        return v


class CompletionBody(_Body):
    prompt: str | list[str] | list[int] | list[list[int]]

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        prompts = [v] if isinstance(v, str) or (v and isinstance(v[0], int)) else v
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompt must be a non-empty string or token list")
        return v

    def prompts(self) -> list[str | list[int]]:
        v = self.prompt
        return [v] if isinstance(v, str) or isinstance(v[0], int) else list(v)


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.headers = status, message, param, kind, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


# ---- text assembly (incremental detokenization + stop strings) -----------------------------------------
class TextAssembler:
    """Turns the growing token list into text deltas; holds back an incomplete UTF-8 tail and any text
    that could still become a stop string. `update` returns (delta, stopped)."""

    def __init__(self, tokenizer, stops: list[str] | None):
        self.tokenizer, self.stops = tokenizer, stops or []
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.sent = ""
        self.text = ""

    def update(self, tokens: list[int], final: bool) -> tuple[str, bool]:
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        stopped = False
        for stop in self.stops:
            at = text.find(stop)
            if at >= 0:
                text, stopped = text[:at], True
        self.text = text
        if not (final or stopped):
            if text.endswith("\ufffd"):
                return "", False
            text = text[: len(text) - self.hold] if self.hold else text
        if not text.startswith(self.sent) or len(text) <= len(self.sent):
            return "", stopped
        delta, self.sent = text[len(self.sent):], text
        return delta, stopped


# ---- the service -----------------------------------------------------------------------------------------
class OpenAIService:
    """OpenAI protocol over an engine running in a background thread (`engine.start()`)."""

    def __init__(self, engine: Engine, cfg: ServeConfig, metrics: "ServeMetrics | None" = None):
        self.engine, self.cfg, self.metrics = engine, cfg, metrics
        self.target = engine.target
        self.model_name = served_name(cfg)
        self.created = int(time.time())

    @property
    def api_key(self) -> str | None:
        return os.environ.get(self.cfg.api.api_key_env) or None

    # ---- validation --------------------------------------------------------------------------------
    def check_model(self, body: _Body) -> None:
        if body.model is not None and body.model != self.model_name:
            raise ApiError(400, f"unknown model {body.model!r}; this server serves {self.model_name!r} "
                                f"(see GET /v1/models)", "model", "model_not_found")

    def prompt_ids(self, prompt: str | list[int] | list[dict], param: str) -> list[int]:
        tok = self.target.tokenizer
        if isinstance(prompt, str):
            if tok is None:
                raise ApiError(400, f"target {self.target.name} has no tokenizer; send token ids", param)
            return tok(prompt)["input_ids"]
        if prompt and isinstance(prompt[0], dict):
            if tok is None or tok.chat_template is None:
                raise ApiError(400, f"target {self.target.name} has no chat template; use /v1/completions", param)
            return self.target.chat_ids(prompt)
        ids = list(prompt)
        if min(ids) < 0 or max(ids) >= self.target.vocab_size:
            raise ApiError(400, f"prompt token ids must be in [0, {self.target.vocab_size})", param)
        return ids

    def max_tokens(self, body: _Body, prompt_len: int, param: str) -> int:
        """The request's max_tokens (or the default, capped by the room left); 400 naming the field."""
        asked = getattr(body, "max_completion_tokens", None) or body.max_tokens
        name = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
        limit = self.cfg.api.max_tokens_limit
        if asked is not None and asked > limit:
            raise ApiError(400, f"{name}={asked} exceeds this server's limit of {limit}", name)
        room = self.engine.max_model_len - (self.engine.gamma + 1) - prompt_len
        if room < 1:
            raise ApiError(400, f"'{param}' is {prompt_len} tokens; the context holds {self.engine.max_model_len} "
                                f"(at most {self.engine.max_model_len - self.engine.gamma - 2} prompt tokens); "
                                f"shorten the prompt", param, "context_length_exceeded")
        if asked is None:
            return min(self.cfg.api.default_max_tokens, room, limit)
        if asked > room:
            raise ApiError(400, f"{param} ({prompt_len} tokens) + {name} ({asked}) exceeds the context of "
                                f"{self.engine.max_model_len}; lower {name} to <= {room}", name,
                           "context_length_exceeded")
        return asked

    # ---- running requests ------------------------------------------------------------------------------
    def submit(self, ids: list[int], body: _Body, max_tokens: int, queue: asyncio.Queue) -> Request:
        loop = asyncio.get_running_loop()

        def listener(req: Request, new: list[int], final: bool) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (req, final))

        try:
            return self.engine.submit(ids, body.sampling(), max_tokens, stop_ids=[] if body.ignore_eos else None,
                                      listener=listener)
        except QueueFullError as err:
            if self.metrics:
                self.metrics.rejected()
            raise ApiError(429, str(err), None, "rate_limit_exceeded", {"Retry-After": "1"}) from None
        except EngineUnavailableError as err:
            raise ApiError(503, str(err), None, "service_unavailable") from None
        except ValueError as err:
            raise ApiError(400, str(err), "prompt") from None

    async def run_to_end(self, ids: list[int], body: _Body, max_tokens: int) -> tuple[Request, str, str]:
        """Non-streaming: (request, text, finish_reason)."""
        queue: asyncio.Queue = asyncio.Queue()
        req = self.submit(ids, body, max_tokens, queue)
        assembler = TextAssembler(self.target.tokenizer, body.stop) if self.target.tokenizer else None
        try:
            while True:
                _, final = await queue.get()
                if assembler and body.stop:
                    _, stopped = assembler.update(list(req.tokens), final)
                    if stopped and not final:
                        self.engine.cancel(req)
                        return self._done(req), assembler.text, "stop"
                if final:
                    break
        except asyncio.CancelledError:  # the client went away
            self.engine.cancel(req)
            raise
        self._done(req)
        if req.finish_reason == "error":
            raise ApiError(500, f"generation failed: {req.error}", None, "server_error")
        text = ""
        if assembler:
            assembler.update(list(req.tokens), True)
            text = assembler.text
        return req, text, req.finish_reason

    def _done(self, req: Request) -> Request:
        if self.metrics:
            self.metrics.request_done(req)
        return req

    def stream(self, ids: list[int], body: _Body, max_tokens: int, chunk):
        """Submit now (so queue-full / bad input still become HTTP errors), then return the SSE event
        generator: chunk(delta, finish_reason, req, first=, last=) builds each JSON object."""
        queue: asyncio.Queue = asyncio.Queue()
        req = self.submit(ids, body, max_tokens, queue)
        return self._events(req, queue, body, chunk)

    async def _events(self, req: Request, queue: asyncio.Queue, body: _Body, chunk):
        assembler = TextAssembler(self.target.tokenizer, body.stop)
        finished = False
        try:
            yield _sse(chunk("", None, req, first=True))
            while not finished:
                _, final = await queue.get()
                while not final and not queue.empty():  # coalesce updates that arrived meanwhile
                    _, final = queue.get_nowait()
                if req.finish_reason == "error":
                    finished = True
                    self._done(req)
                    yield _sse(ApiError(500, f"generation failed: {req.error}", None, "server_error").body())
                    break
                delta, stopped = assembler.update(list(req.tokens), final)
                if delta:
                    yield _sse(chunk(delta, None, req))
                if stopped or final:
                    finished = True
                    if stopped and not final:
                        self.engine.cancel(req)
                    self._done(req)
                    yield _sse(chunk("", "stop" if stopped else req.finish_reason, req, last=True))
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client disconnected mid-stream
                self.engine.cancel(req)

    # ---- responses ---------------------------------------------------------------------------------------
    @staticmethod
    def usage(reqs: list[Request]) -> dict:
        prompt = sum(len(r.prompt_ids) for r in reqs)
        completion = sum(len(r.tokens) for r in reqs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    @staticmethod
    def spec_decode(reqs: list[Request]) -> dict:
        total = {"rounds": 0, "draft_tokens_proposed": 0, "draft_tokens_verified": 0, "draft_tokens_accepted": 0}
        for r in reqs:
            for key, value in r.stats.spec_decode().items():
                if key in total:
                    total[key] += value
        rounds = total["rounds"]
        total["mean_accepted_length"] = (total["draft_tokens_accepted"] + rounds) / rounds if rounds else None
        return total

    async def chat(self, body: ChatBody):
        self.check_model(body)
        try:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        except ValueError as err:
            raise ApiError(400, str(err), "messages") from None
        ids = self.prompt_ids(messages, "messages")
        max_tokens = self.max_tokens(body, len(ids), "messages")
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            def chunk(delta, reason, req, first=False, last=False):
                out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                       "choices": [{"index": 0, "delta": ({"role": "assistant", "content": ""} if first else
                                                         ({"content": delta} if delta else {})),
                                    "finish_reason": reason, "logprobs": None}]}
                if last:
                    out.update(usage=self.usage([req]), spec_decode=self.spec_decode([req]))
                return out

            return self.stream(ids, body, max_tokens, chunk)
        req, text, reason = await self.run_to_end(ids, body, max_tokens)
        return {"id": rid, "object": "chat.completion", "created": created, "model": self.model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": reason, "logprobs": None}],
                "usage": self.usage([req]), "spec_decode": self.spec_decode([req])}

    async def completions(self, body: CompletionBody):
        self.check_model(body)
        prompts = body.prompts()
        if len(prompts) > self.cfg.api.max_prompts:
            raise ApiError(400, f"{len(prompts)} prompts in one request; at most {self.cfg.api.max_prompts}", "prompt")
        if body.stream and len(prompts) > 1:
            raise ApiError(400, "streaming takes a single prompt", "prompt")
        ids_list = [self.prompt_ids(p, "prompt") for p in prompts]
        limits = [self.max_tokens(body, len(ids), "prompt") for ids in ids_list]
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            def chunk(delta, reason, req, first=False, last=False):
                out = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                       "choices": [{"index": 0, "text": delta, "finish_reason": reason, "logprobs": None}]}
                if last:
                    out.update(usage=self.usage([req]), spec_decode=self.spec_decode([req]))
                return out

            return self.stream(ids_list[0], body, limits[0], chunk)
        results = await asyncio.gather(*(self.run_to_end(ids, body, n) for ids, n in zip(ids_list, limits)))
        reqs = [r for r, _, _ in results]
        return {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                "choices": [{"index": i, "text": text, "finish_reason": reason, "logprobs": None,
                             "token_ids": list(req.tokens)}  # extension: the generated token ids
                            for i, (req, text, reason) in enumerate(results)],
                "usage": self.usage(reqs), "spec_decode": self.spec_decode(reqs)}

    def models(self) -> dict:
        drafter = self.cfg.model.drafter if self.engine.drafting else None
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "dspark", "root": self.target.name, "drafter": drafter,
                                            "scheduler": self.engine.mode, "max_model_len": self.engine.max_model_len}]}

    def health(self) -> tuple[int, dict]:
        stats = self.engine.stats()
        ok = stats["healthy"] and stats["loop_alive"]
        return (200 if ok else 503), {"status": "ok" if ok else "unhealthy", "model": self.model_name, **stats}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


# ---- the FastAPI app --------------------------------------------------------------------------------------
def make_app(service: OpenAIService):
    """FastAPI app exposing `service`; used as the Serve ingress and directly in tests."""
    app = FastAPI(title="dspark", description="OpenAI-compatible speculative decoding server")

    @app.exception_handler(ApiError)
    async def _api_error(_, err: ApiError):
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_, err: RequestValidationError):
        return JSONResponse(_validation_body(err.errors()).body(), status_code=400)

    def authorize(request: HttpRequest) -> None:
        key = service.api_key
        if key is None:
            return
        header = request.headers.get("authorization", "")
        given = header[7:] if header.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(given.encode(), key.encode()):
            raise ApiError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'", None,
                           "authentication_error")

    def respond(result):
        if isinstance(result, dict):
            return result
        return StreamingResponse(result, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat(body: ChatBody):
        return respond(await service.chat(body))

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(body: CompletionBody):
        return respond(await service.completions(body))

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models():
        return service.models()

    @app.get("/v1/stats", dependencies=[Depends(authorize)])
    async def stats():
        return service.engine.stats()

    @app.get("/healthz")
    async def healthz():
        status, body = service.health()
        return JSONResponse(body, status_code=status)

    return app


def _validation_body(errors: list[dict]) -> ApiError:
    """First pydantic error -> ApiError naming the field (or the bad JSON)."""
    err = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [str(p) for p in err.get("loc", ()) if p not in ("body",)]
    if err.get("type") == "json_invalid":
        return ApiError(400, f"request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}")
    if err.get("type") == "model_attributes_type" or not loc:
        return ApiError(400, f"request body must be a JSON object (Content-Type: application/json): {err.get('msg')}")
    # union members add their type name to loc (e.g. prompt.str); keep the field path only
    field = ".".join(p for p in loc if not p.startswith(("str", "list[", "int", "dict", "function-")))
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    return ApiError(400, f"invalid '{field}': {msg}", field or None)


# ---- Ray Serve --------------------------------------------------------------------------------------------
class ServeMetrics:
    """Per-replica counters/gauges (Ray Serve adds deployment/replica/application tags; scraped by
    Ray's Prometheus endpoint)."""

    def __init__(self, engine: Engine):
        from ray.serve import metrics

        gamma = max(engine.gamma, 1)
        self.requests = metrics.Counter("dspark_requests", "Finished requests by outcome", tag_keys=("outcome",))
        self.tokens = metrics.Counter("dspark_generated_tokens", "Tokens generated")
        self.prompt_tokens = metrics.Counter("dspark_prompt_tokens", "Prompt tokens prefilled")
        self.rounds = metrics.Counter("dspark_verify_rounds", "Request-rounds verified (one per request per step)")
        self.verified = metrics.Counter("dspark_draft_tokens_verified", "Draft tokens sent to the target")
        self.accepted = metrics.Counter("dspark_draft_tokens_accepted", "Draft tokens accepted")
        self.budget = metrics.Histogram("dspark_verify_budget", "Drafts verified per request per round",
                                        boundaries=[i + 0.5 for i in range(gamma)])
        self.queue = metrics.Gauge("dspark_queue_length", "Requests waiting for a slot")
        self.active = metrics.Gauge("dspark_active_requests", "Requests in the running batch")
        self.batch_tokens = metrics.Gauge("dspark_batch_tokens", "Tokens in the last verify forward (B)")
        self.engine = engine
        engine.step_listeners.append(self.on_step)

    def on_step(self, report: StepReport) -> None:
        if report.emitted:
            self.tokens.inc(report.emitted)
        if report.prefill_tokens:
            self.prompt_tokens.inc(report.prefill_tokens)
        if report.rows:
            self.rounds.inc(report.rows)
            self.batch_tokens.set(report.batch_tokens)
        if report.verified:
            self.verified.inc(report.verified)
        if report.accepted:
            self.accepted.inc(report.accepted)
        for n in report.verify_lens:
            self.budget.observe(n)
        self.queue.set(len(self.engine.waiting))
        self.active.set(len(self.engine.active))

    def request_done(self, req: Request) -> None:
        self.requests.inc(tags={"outcome": req.finish_reason or "unknown"})

    def rejected(self) -> None:
        self.requests.inc(tags={"outcome": "rejected"})


@functools.lru_cache(maxsize=1)
def _deployment_class():
    from ray import serve

    @serve.deployment
    @serve.ingress()
    class DSparkServer:
        """One engine per replica, its loop in a background thread; FastAPI routes from make_app."""

        def __init__(self, config: dict):
            import torch

            logging.basicConfig(level=logging.INFO)
            self.cfg = ServeConfig.model_validate(config)
            threads = self.cfg.deployment.torch_threads or max(1, round(self.cfg.deployment.num_cpus))
            torch.set_num_threads(threads)
            self.engine = build_engine(self.cfg)
            self.service = OpenAIService(self.engine, self.cfg, ServeMetrics(self.engine))
            self.engine.start()
            log.info("dspark replica ready: model %s on %s, mode %s, %d torch threads", self.service.model_name,
                     self.engine.target.device, self.engine.mode, threads)

        def __serve_build_asgi_app__(self):
            return make_app(self.service)

        def check_health(self) -> None:
            status, body = self.service.health()
            if status != 200:
                raise RuntimeError(f"engine unhealthy: {body.get('health_error') or 'loop stopped'}")

        def __del__(self):
            engine = getattr(self, "engine", None)
            if engine is not None:
                engine.stop(timeout=2.0)

    return DSparkServer


def deployment_for(cfg: ServeConfig, forward_api_key: bool = True):
    """The bound Serve application for `cfg` (pass to serve.run). With `forward_api_key` (jobs.serve
    on one machine), the API key env var, when set in the deploying process, is forwarded to the
    replicas through runtime_env. `serve deploy`/RayService (build_app) never do that — the runtime
    env is shown by `serve status` and the dashboard: there the replicas' containers hold the key
    (a Kubernetes Secret through env/valueFrom, infra/kuberay/rayservice.yaml)."""
    d = cfg.deployment
    actor_options: dict[str, Any] = {"num_cpus": d.num_cpus}
    if d.num_gpus > 0:
        actor_options["num_gpus"] = d.num_gpus
    key = os.environ.get(cfg.api.api_key_env) if forward_api_key else None
    if key:
        actor_options["runtime_env"] = {"env_vars": {cfg.api.api_key_env: key}}
    return _deployment_class().options(
        name="DSparkServer", num_replicas=d.num_replicas, max_ongoing_requests=d.max_ongoing_requests,
        max_queued_requests=d.max_queued_requests, ray_actor_options=actor_options,
        health_check_period_s=d.health_check_period_s, health_check_timeout_s=d.health_check_timeout_s,
    ).bind({k: v for k, v in config_to_dict(cfg).items() if k in ServeConfig.model_fields})


def build_app(args: dict):
    """Application builder for `serve deploy infra/serve/serve_config.yaml` (import_path
    dspark.serve_app:build_app). args: {"config": a configs/serve/*.yaml path or an inline mapping,
    "set": ["engine.max_batch=16", ...]}. A `ray:` section (used by jobs/serve.py) is ignored here:
    `serve deploy` targets a running cluster."""
    from dspark.config import apply_overrides, read_yaml, validate_config

    args = dict(args or {})
    overrides = args.pop("set", None) or []
    source = args.pop("config", None)
    if args:
        raise ValueError(f"unknown application args {sorted(args)}; use 'config' (path or mapping) and 'set'")
    data = dict(source) if isinstance(source, dict) else (read_yaml(source) if source else {})
    data.pop("ray", None)
    data = apply_overrides(data, [overrides] if isinstance(overrides, str) else list(overrides))
    return deployment_for(validate_config(ServeConfig, data, source=str(source or "<args>")), forward_api_key=False)
