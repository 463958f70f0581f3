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

Errors follow OpenAI's shape {"error": {"message", "type", "param", "code"}}: invalid JSON, bad
fields and unimplemented OpenAI fields -> 400 naming the field, missing/wrong API key -> 401,
unknown model or path -> 404, wrong method -> 405, body over api.max_body_bytes -> 413, full queue
-> 429, engine unhealthy -> 503 (Ray Serve itself answers 503 when its own request queue is full).
Request and response models live in dspark/serve_protocol.py.
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
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import Depends, FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from openai.types import CompletionUsage
from openai.types.chat import ChatCompletionMessage
from openai.types.chat.chat_completion import Choice as ChatChoice
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta
from pydantic import BaseModel, Field
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from dspark.config import StrictModel, config_to_dict
from dspark.engine import Engine, EngineConfig, EngineUnavailableError, QueueFullError, Request, StepReport
from dspark.serve_protocol import (ApiError, ChatBody, CompletionBody, DSparkChatCompletion, DSparkChatCompletionChunk,
                                   DSparkCompletion, DSparkCompletionChoice, ModelList, RequestBody, ServedModel,
                                   SpecDecode, dump, usage, validation_error)

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


PROMPT_CHARS_PER_TOKEN = 32  # default api.max_prompt_chars = this × engine.max_model_len


class ApiSection(StrictModel):
    api_key_env: str = "DSPARK_API_KEY"  # when this env var is set on the replica, Bearer auth is required
    max_tokens_limit: int = 1024  # largest max_tokens a request may ask for
    default_max_tokens: int = 256  # when a request gives none (capped by the room left in the context)
    max_prompts: int = 16  # prompts per /v1/completions request
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, description=(
        "largest request body in bytes; larger ones get 413 before they are read (by Content-Length) or "
        "as soon as they pass the limit, and are never parsed"))
    max_prompt_chars: int | None = Field(None, ge=1, description=(
        f"largest prompt (all messages' text, or all prompts) in characters, checked before tokenizing; "
        f"None: {PROMPT_CHARS_PER_TOKEN} × engine.max_model_len"))


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


# ---- text assembly (incremental detokenization + stop strings) -----------------------------------------
class TextAssembler:
    """Token stream -> text deltas. Each new token is detokenized once, incrementally, with `tokenizers`'
    DecodeStream (which holds back an incomplete UTF-8 sequence until it completes); stop strings are
    searched only in the text the new token could have completed, and any tail that could still grow
    into a stop string is held back. `update(tokens, final)` -> (delta, stopped); after it, `text` is
    the answer so far (cut before a stop string) and `n_tokens` the tokens it took, i.e. up to the one
    that completed the stop string (what `usage.completion_tokens` counts)."""

    def __init__(self, tokenizer, stops: list[str] | None):
        from tokenizers.decoders import DecodeStream

        self.backend = getattr(tokenizer, "backend_tokenizer", None) if tokenizer is not None else None
        if tokenizer is not None and self.backend is None:
            raise ValueError(f"tokenizer {type(tokenizer).__name__} has no `tokenizers` backend (a fast tokenizer "
                             "is needed for incremental detokenization)")
        self.decoder = DecodeStream(skip_special_tokens=True)
        self.stops = list(stops or [])
        self.full = ""  # detokenized text of every token fed
        self.ids: list[int] = []  # tokens fed
        self.pending = 0  # tokens fed since the decoder last produced text (an incomplete UTF-8 tail)
        self.n_tokens = 0
        self.cut: int | None = None  # where a stop string starts (the answer ends there)
        self.sent = 0  # characters already returned as deltas

    @property
    def stopped(self) -> bool:
        return self.cut is not None

    @property
    def text(self) -> str:
        return self.full if self.cut is None else self.full[: self.cut]

    @property
    def fed(self) -> int:
        return len(self.ids)

    def update(self, tokens: list[int], final: bool) -> tuple[str, bool]:
        for token in tokens[self.fed:]:
            if self.stopped:
                break
            self._feed(int(token))
        if final and self.pending and not self.stopped:  # an incomplete tail decodes as U+FFFD, as in decode()
            self._flush()
        visible = len(self.text) if (final or self.stopped) else len(self.full) - self._held_back()
        delta = self.full[self.sent: visible] if visible > self.sent else ""
        self.sent = max(self.sent, visible)
        return delta, self.stopped

    def _feed(self, token: int) -> None:
        self.ids.append(token)
        self.n_tokens = self.fed
        piece = self.decoder.step(self.backend, token) if self.backend is not None else None
        if not piece:
            self.pending += 1
            return
        self.pending = 0
        self._extend(piece)

    def _flush(self) -> None:
        whole = self.backend.decode(self.ids, skip_special_tokens=True)
        if whole.startswith(self.full) and len(whole) > len(self.full):
            self._extend(whole[len(self.full):])
        self.pending = 0

    def _extend(self, piece: str) -> None:
        before = len(self.full)
        self.full += piece
        # a stop string completed by this piece ends somewhere in it: search from len(stop)-1 before it
        hits = [at for stop in self.stops if (at := self.full.find(stop, max(0, before - len(stop) + 1))) >= 0]
        if hits:
            self.cut = min(hits)

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self.full)), longest, -1):
                if self.full.endswith(stop[:k]):
                    longest = k
                    break
        return longest


@dataclass
class Outcome:
    """A finished (or stopped) request as the API reports it."""

    req: Request
    text: str
    finish_reason: str
    completion_tokens: int


class ChatStream:
    """SSE chunks of /v1/chat/completions (a first chunk with the role, content deltas, a finish chunk)."""

    def __init__(self, rid: str, created: int, model: str, include_usage: bool):
        self.base = {"id": rid, "created": created, "model": model, "object": "chat.completion.chunk",
                     **({"usage": None} if include_usage else {})}

    def first(self) -> BaseModel | None:
        return self._chunk(ChoiceDelta(role="assistant", content=""), None)

    def delta(self, text: str) -> BaseModel:
        return self._chunk(ChoiceDelta(content=text), None)

    def finish(self, reason: str, spec: SpecDecode) -> BaseModel:
        return self._chunk(ChoiceDelta(), reason, spec_decode=spec)

    def usage(self, u: CompletionUsage) -> BaseModel:
        return DSparkChatCompletionChunk(**{**self.base, "usage": u}, choices=[])

    def _chunk(self, delta: ChoiceDelta, reason: str | None, **extra) -> BaseModel:
        choice = ChunkChoice(index=0, delta=delta, finish_reason=reason, logprobs=None)
        return DSparkChatCompletionChunk(**self.base, choices=[choice], **extra)


class CompletionStream:
    """SSE chunks of /v1/completions (text deltas, a finish chunk)."""

    def __init__(self, rid: str, created: int, model: str, include_usage: bool):
        self.base = {"id": rid, "created": created, "model": model, "object": "text_completion",
                     **({"usage": None} if include_usage else {})}

    def first(self) -> BaseModel | None:
        return None

    def delta(self, text: str) -> BaseModel:
        return self._chunk(text, None)

    def finish(self, reason: str, spec: SpecDecode) -> BaseModel:
        return self._chunk("", reason, spec_decode=spec)

    def usage(self, u: CompletionUsage) -> BaseModel:
        return DSparkCompletion.model_construct(**{**self.base, "usage": u}, choices=[])

    def _chunk(self, text: str, reason: str | None, **extra) -> BaseModel:
        # a streamed completion chunk has finish_reason null until the last one: build without validation
        choice = DSparkCompletionChoice.model_construct(index=0, text=text, finish_reason=reason, logprobs=None)
        return DSparkCompletion.model_construct(**self.base, choices=[choice], **extra)


# ---- the service -----------------------------------------------------------------------------------------
class OpenAIService:
    """OpenAI protocol over an engine running in a background thread (`engine.start()`)."""

    def __init__(self, engine: Engine, cfg: ServeConfig, metrics: "ServeMetrics | None" = None):
        self.engine, self.cfg, self.metrics = engine, cfg, metrics
        self.target = engine.target
        self.model_name = served_name(cfg)
        self.created = int(time.time())
        self.max_prompt_chars = cfg.api.max_prompt_chars or PROMPT_CHARS_PER_TOKEN * engine.max_model_len

    @property
    def api_key(self) -> str | None:
        return os.environ.get(self.cfg.api.api_key_env) or None

    # ---- validation --------------------------------------------------------------------------------
    def check_request(self, body: RequestBody, param: str) -> None:
        """What can be checked before tokenizing: the model, stream_options, the prompt's length in
        characters (bounds the tokenizer's work)."""
        if body.model is not None and body.model != self.model_name:
            raise ApiError(404, f"the model {body.model!r} does not exist; this server serves {self.model_name!r} "
                                f"(see GET /v1/models)", "model", "model_not_found")
        body.check_stream_options()
        chars = body.prompt_chars()
        if chars > self.max_prompt_chars:
            raise ApiError(400, f"'{param}' has {chars} characters; this server accepts at most "
                                f"{self.max_prompt_chars} (the context holds {self.engine.max_model_len} tokens); "
                                f"shorten the prompt", param, "context_length_exceeded")

    def prompt_ids(self, prompt: str | list[int] | list[dict], param: str) -> list[int]:
        """Tokenize one prompt (blocking: call through `tokenize`)."""
        tok = self.target.tokenizer
        if isinstance(prompt, str):
            if tok is None:
                raise ApiError(400, f"target {self.target.name} has no tokenizer; send token ids", param)
            return tok(prompt)["input_ids"]
        if prompt and isinstance(prompt[0], dict):
            if tok is None or tok.chat_template is None:
                raise ApiError(400, f"target {self.target.name} has no chat template; use /v1/completions", param)
            try:
                return self.target.chat_ids(prompt)
            except Exception as err:  # the template raised on these messages (e.g. a role order it forbids)
                raise ApiError(400, f"the chat template of {self.target.name} rejects these messages: {err}",
                               param) from None
        ids = list(prompt)
        if min(ids) < 0 or max(ids) >= self.target.vocab_size:
            raise ApiError(400, f"prompt token ids must be in [0, {self.target.vocab_size})", param)
        return ids

    async def tokenize(self, prompts: list, param: str) -> list[list[int]]:
        """Tokenize off the event loop, so a long prompt never delays the other requests' I/O."""
        return await asyncio.to_thread(lambda: [self.prompt_ids(p, param) for p in prompts])

    def max_tokens(self, body: RequestBody, prompt_len: int, param: str) -> int:
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
    def submit(self, ids: list[int], body: RequestBody, max_tokens: int, queue: asyncio.Queue) -> Request:
        loop = asyncio.get_running_loop()

        def listener(req: Request, new: list[int], final: bool) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (req, final))

        try:
            return self.engine.submit(ids, body.sampling(), max_tokens, stop_ids=[] if body.ignore_eos else None,
                                      listener=listener, seed=body.seed)
        except QueueFullError as err:
            if self.metrics:
                self.metrics.rejected()
            raise ApiError(429, str(err), None, "rate_limit_exceeded", {"Retry-After": "1"}) from None
        except EngineUnavailableError as err:
            raise ApiError(503, str(err), None, "service_unavailable") from None
        except ValueError as err:
            raise ApiError(400, str(err), "prompt") from None

    async def run_to_end(self, ids: list[int], body: RequestBody, max_tokens: int) -> Outcome:
        """Non-streaming: generate until the engine finishes the request or a stop string appears."""
        queue: asyncio.Queue = asyncio.Queue()
        req = self.submit(ids, body, max_tokens, queue)
        assembler = TextAssembler(self.target.tokenizer, body.stops)
        try:
            while True:
                _, final = await queue.get()
                if body.stops or final:
                    assembler.update(list(req.tokens), final)
                if assembler.stopped and not final:
                    self.engine.cancel(req)
                if assembler.stopped or final:
                    break
        except asyncio.CancelledError:  # the client went away
            self.engine.cancel(req)
            raise
        self._done(req)
        if not assembler.stopped and req.finish_reason not in ("stop", "length"):
            raise _not_generated(req)
        reason = "stop" if assembler.stopped else req.finish_reason
        return Outcome(req, assembler.text, reason, assembler.n_tokens)

    def _done(self, req: Request) -> Request:
        if self.metrics:
            self.metrics.request_done(req)
        return req

    def stream(self, ids: list[int], body: RequestBody, max_tokens: int, fmt: ChatStream | CompletionStream):
        """Submit now (so queue-full / bad input still become HTTP errors), then return the SSE event
        generator."""
        queue: asyncio.Queue = asyncio.Queue()
        req = self.submit(ids, body, max_tokens, queue)
        return self._events(req, queue, body, fmt)

    async def _events(self, req: Request, queue: asyncio.Queue, body: RequestBody, fmt: ChatStream | CompletionStream):
        assembler = TextAssembler(self.target.tokenizer, body.stops)
        finished = False
        try:
            if (first := fmt.first()) is not None:
                yield _sse(first)
            while not finished:
                _, final = await queue.get()
                while not final and not queue.empty():  # coalesce updates that arrived meanwhile
                    _, final = queue.get_nowait()
                if req.finish_reason in ("error", "cancelled"):
                    finished = True
                    self._done(req)
                    yield _sse(_not_generated(req).body())
                    break
                delta, stopped = assembler.update(list(req.tokens), final)
                if delta:
                    yield _sse(fmt.delta(delta))
                if stopped or final:
                    finished = True
                    if stopped and not final:
                        self.engine.cancel(req)
                    self._done(req)
                    yield _sse(fmt.finish("stop" if stopped else req.finish_reason, self.spec_decode([req])))
                    if body.include_usage:
                        yield _sse(fmt.usage(usage(len(req.prompt_ids), assembler.n_tokens)))
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client disconnected mid-stream
                self.engine.cancel(req)

    # ---- responses ---------------------------------------------------------------------------------------
    @staticmethod
    def usage(outcomes: list[Outcome]) -> CompletionUsage:
        return usage(sum(len(o.req.prompt_ids) for o in outcomes), sum(o.completion_tokens for o in outcomes))

    @staticmethod
    def spec_decode(reqs: list[Request]) -> SpecDecode:
        total = SpecDecode()
        for r in reqs:
            s = r.stats
            total.rounds += s.rounds
            total.draft_tokens_proposed += s.proposed
            total.draft_tokens_verified += s.verified
            total.draft_tokens_accepted += s.accepted
        rounds = total.rounds
        total.mean_accepted_length = (total.draft_tokens_accepted + rounds) / rounds if rounds else None
        return total

    async def chat(self, body: ChatBody):
        self.check_request(body, "messages")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        (ids,) = await self.tokenize([messages], "messages")
        max_tokens = self.max_tokens(body, len(ids), "messages")
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            return self.stream(ids, body, max_tokens, ChatStream(rid, created, self.model_name, body.include_usage))
        out = await self.run_to_end(ids, body, max_tokens)
        choice = ChatChoice(index=0, message=ChatCompletionMessage(role="assistant", content=out.text),
                            finish_reason=out.finish_reason, logprobs=None)
        return DSparkChatCompletion(id=rid, object="chat.completion", created=created, model=self.model_name,
                                    choices=[choice], usage=self.usage([out]), spec_decode=self.spec_decode([out.req]))

    async def completions(self, body: CompletionBody):
        self.check_request(body, "prompt")
        prompts = body.prompts()
        if len(prompts) > self.cfg.api.max_prompts:
            raise ApiError(400, f"{len(prompts)} prompts in one request; at most {self.cfg.api.max_prompts}", "prompt")
        if body.stream and len(prompts) > 1:
            raise ApiError(400, "streaming takes a single prompt", "prompt")
        ids_list = await self.tokenize(prompts, "prompt")
        limits = [self.max_tokens(body, len(ids), "prompt") for ids in ids_list]
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            fmt = CompletionStream(rid, created, self.model_name, body.include_usage)
            return self.stream(ids_list[0], body, limits[0], fmt)
        outs = await asyncio.gather(*(self.run_to_end(ids, body, n) for ids, n in zip(ids_list, limits)))
        choices = [DSparkCompletionChoice(index=i, text=o.text, finish_reason=o.finish_reason, logprobs=None,
                                          token_ids=list(o.req.tokens[: o.completion_tokens]))
                   for i, o in enumerate(outs)]
        return DSparkCompletion(id=rid, object="text_completion", created=created, model=self.model_name,
                                choices=choices, usage=self.usage(outs),
                                spec_decode=self.spec_decode([o.req for o in outs]))

    def model_card(self) -> ServedModel:
        drafter = self.cfg.model.drafter if self.engine.drafting else None
        return ServedModel(id=self.model_name, object="model", created=self.created, owned_by="dspark",
                           root=self.target.name, drafter=drafter, scheduler=self.engine.mode,
                           max_model_len=self.engine.max_model_len)

    def models(self) -> ModelList:
        return ModelList(data=[self.model_card()])

    def health(self) -> tuple[int, dict]:
        stats = self.engine.stats()
        ok = stats["healthy"] and stats["loop_alive"]
        return (200 if ok else 503), {"status": "ok" if ok else "unhealthy", "model": self.model_name, **stats}


def _not_generated(req: Request) -> ApiError:
    if req.finish_reason == "cancelled":  # the engine stopped under it
        return ApiError(503, "the request was cancelled: the engine is stopping", None, "service_unavailable")
    return ApiError(500, f"generation failed: {req.error}", None, "generation_failed")


def _sse(obj: BaseModel) -> str:
    return f"data: {json.dumps(dump(obj))}\n\n"


# ---- the FastAPI app --------------------------------------------------------------------------------------
ROUTES = "POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /v1/stats, GET /healthz"


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` gets 413 in OpenAI's shape, by its Content-Length
    before a byte is read, or (chunked uploads) as soon as the bytes received pass the limit; it is
    never parsed. (Starlette's RequestBodyLimitMiddleware answers the Content-Length case in plain text.)
    Before that 413 the upload is read and dropped (never stored) for up to `linger_s`, as nginx's
    lingering close does, so a client still sending gets the answer instead of a connection reset."""

    def __init__(self, app, max_bytes: int, linger_s: float = 2.0):
        self.app, self.max_bytes, self.linger_s = app, max_bytes, linger_s

    def too_large(self) -> ApiError:
        return ApiError(413, f"request body exceeds this server's limit of {self.max_bytes} bytes "
                             f"(api.max_body_bytes)", None, "request_too_large", {"Connection": "close"})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            await self._drain(receive)
            return await self.too_large().response()(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:  # FastAPI re-raises an HTTPException met while reading the body
                    if message.get("more_body", False):
                        await self._drain(receive)
                    raise StarletteHTTPException(413)
            return message

        await self.app(scope, limited_receive, send)

    async def _drain(self, receive) -> None:
        async def drop() -> None:
            while (await receive()).get("more_body", False):
                pass

        try:
            await asyncio.wait_for(drop(), self.linger_s)
        except asyncio.TimeoutError:
            pass


def make_app(service: OpenAIService):
    """FastAPI app exposing `service`; used as the Serve ingress and directly in tests. Bodies above
    api.max_body_bytes are refused with 413 (`BodyLimit`); every error, FastAPI's own included,
    answers in OpenAI's shape."""
    limit = service.cfg.api.max_body_bytes
    app = FastAPI(title="dspark", description="OpenAI-compatible speculative decoding server")
    app.add_middleware(BodyLimit, max_bytes=limit)

    @app.exception_handler(ApiError)
    async def _api_error(_, err: ApiError):
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_, err: RequestValidationError):
        return validation_error(list(err.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: HttpRequest, err: StarletteHTTPException):
        return _http_api_error(request, err, limit).response()

    @app.exception_handler(Exception)
    async def _internal_error(_, err: Exception):
        log.exception("unhandled error")
        return ApiError(500, f"internal server error: {type(err).__name__}", None, "internal_error").response()

    def authorize(request: HttpRequest) -> None:
        key = service.api_key
        if key is None:
            return
        header = request.headers.get("authorization", "")
        given = header[7:] if header.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(given.encode(), key.encode()):
            raise ApiError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'", None,
                           "invalid_api_key")

    def respond(result):
        if isinstance(result, BaseModel):
            return JSONResponse(dump(result))
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
        return respond(service.models())

    @app.get("/v1/models/{model:path}", dependencies=[Depends(authorize)])
    async def model(model: str):
        if model != service.model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {service.model_name!r}",
                           "model", "model_not_found")
        return respond(service.model_card())

    @app.get("/v1/stats", dependencies=[Depends(authorize)])
    async def stats():
        return service.engine.stats()

    @app.get("/healthz")
    async def healthz():
        status, body = service.health()
        return JSONResponse(body, status_code=status)

    return app


def _http_api_error(request: HttpRequest, err: StarletteHTTPException, body_limit: int) -> ApiError:
    """Starlette/FastAPI's own HTTP errors (unknown path, wrong method, body too large) in OpenAI's shape."""
    where = f"{request.method} {request.url.path}"
    if err.status_code == 404:
        return ApiError(404, f"no route {where}; this server answers {ROUTES}", None, "not_found")
    if err.status_code == 405:
        return ApiError(405, f"method not allowed: {where}; this server answers {ROUTES}", None,
                        "method_not_allowed", err.headers)
    if err.status_code == 413:
        return BodyLimit(None, body_limit).too_large()
    return ApiError(err.status_code, str(err.detail), None, None, err.headers)


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


def deployment_for(cfg: ServeConfig):
    """The bound Serve application for `cfg` (pass to serve.run). The API key env var, when set in
    the deploying process, is forwarded to the replicas through runtime_env."""
    d = cfg.deployment
    actor_options: dict[str, Any] = {"num_cpus": d.num_cpus}
    if d.num_gpus > 0:
        actor_options["num_gpus"] = d.num_gpus
    key = os.environ.get(cfg.api.api_key_env)
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
    return deployment_for(validate_config(ServeConfig, data, source=str(source or "<args>")))
