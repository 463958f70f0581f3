"""The OpenAI protocol logic without Ray or HTTP: request validation, chat template and tokenization (off
the event loop), submission to the engine (which runs in its own thread), non-streaming and SSE
responses with `usage` and `spec_decode`."""
from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from dataclasses import dataclass
from typing import Protocol

from openai.types import CompletionUsage
from openai.types.chat import ChatCompletionMessage
from openai.types.chat.chat_completion import Choice as ChatChoice
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta
from pydantic import BaseModel

from dspark.decoding.engine import Engine, EngineUnavailableError, QueueFullError, Request
from dspark.serve.config import PROMPT_CHARS_PER_TOKEN, ServeConfig, served_name
from dspark.serve.protocol import (ApiError, ChatBody, CompletionBody, DSparkChatCompletion, DSparkChatCompletionChunk,
                                   DSparkCompletion, DSparkCompletionChoice, ModelList, RequestBody, ServedModel,
                                   SpecDecode, dump, usage)
from dspark.serve.text import TextAssembler


class MetricsSink(Protocol):
    """Where finished and rejected requests are counted (the Ray Serve deployment's ServeMetrics)."""

    def request_done(self, req: Request) -> None: ...

    def rejected(self) -> None: ...


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

    def __init__(self, engine: Engine, cfg: ServeConfig, metrics: MetricsSink | None = None):
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
