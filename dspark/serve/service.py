"""The OpenAI protocol logic without Ray or HTTP: request validation, chat template and tokenization (off
the event loop), submission to the engine (which runs in its own thread), and running each choice to
its end, non-streaming or as SSE. The answers themselves are built by dspark.serve.responses."""
from __future__ import annotations

import asyncio
import os
import time
import uuid
from dataclasses import dataclass
from typing import Protocol

from dspark.decoding.constraint import TokenConstraint, response_format_constraint
from dspark.decoding.engine import Engine, EngineUnavailableError, QueueFullError, Request, TokenLogprob
from dspark.decoding.counter_random import derive_seed
from dspark.serve.config import PROMPT_CHARS_PER_TOKEN, ServeConfig, served_name
from dspark.serve.protocol import ApiError, ChatBody, CompletionBody, ModelList, RequestBody, ServedModel
from dspark.serve.prometheus import PrometheusMetrics
from dspark.serve.responses import (ChatStream, CompletionStream, Logprobs, Outcome, ToolCallStream, chat_completion,
                                    not_generated, request_usage, spec_decode, sse, text_completion)
from dspark.serve.templates import RESERVED_TEMPLATE_VARIABLES, template_variables
from dspark.serve.text import TextAssembler
from dspark.serve.tools import active_tools, call_schema, tool_plan, tools_message


class MetricsSink(Protocol):
    """Where finished and rejected requests are counted (the Ray Serve deployment's ServeMetrics)."""

    def request_done(self, req: Request) -> None: ...

    def rejected(self) -> None: ...


@dataclass
class Choice:
    """One choice in flight (a request of the engine) while its answer is assembled."""

    index: int
    req: Request
    assembler: TextAssembler
    logprobs_sent: int = 0
    done: bool = False

    def new_logprobs(self) -> list[TokenLogprob]:
        """Logprobs of the tokens counted in the text since the last call (empty without logprobs)."""
        upto = self.assembler.n_tokens
        entries = self.req.token_logprobs[self.logprobs_sent: upto]
        self.logprobs_sent = max(self.logprobs_sent, upto)
        return entries if self.req.logprobs is not None else []


# ---- the service -----------------------------------------------------------------------------------------
class OpenAIService:
    """OpenAI protocol over an engine running in a background thread (`engine.start()`)."""

    def __init__(self, engine: Engine, cfg: ServeConfig, metrics: MetricsSink | None = None, flywheel=None):
        self.engine, self.cfg, self.metrics = engine, cfg, metrics
        self.flywheel = flywheel  # dspark.flywheel.observer.Flywheel: per-domain acceptance and capture
        self.target = engine.target
        self.model_name = served_name(cfg)
        self.created = int(time.time())
        self.max_prompt_chars = cfg.api.max_prompt_chars or PROMPT_CHARS_PER_TOKEN * engine.max_model_len
        self.prometheus = PrometheusMetrics(engine, self.model_name)  # GET /metrics; more collectors register here
        if flywheel is not None:
            flywheel.listeners.append(self.prometheus.spec_decode.record_domain)

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

    def template_kwargs(self, body: ChatBody) -> dict:
        """chat_template_kwargs (and reasoning_effort) -> template variables; 400 naming any that the
        chat template does not read (it would be ignored) or that the server sets itself."""
        kwargs = body.template_kwargs()
        if not kwargs:
            return {}
        tok = self.target.tokenizer
        if tok is None or tok.chat_template is None:
            raise ApiError(400, f"target {self.target.name} has no chat template", "chat_template_kwargs")
        reads = template_variables(tok.chat_template)
        for name in kwargs:
            param = "reasoning_effort" if name == "reasoning_effort" and body.reasoning_effort is not None \
                else f"chat_template_kwargs.{name}"
            if name in RESERVED_TEMPLATE_VARIABLES:
                raise ApiError(400, f"'{param}' is set by the server and cannot be overridden", param)
            if reads is not None and name not in reads:
                raise ApiError(400, f"'{param}': the chat template of {self.target.name} has no variable {name!r} "
                                    f"(it reads: {', '.join(sorted(reads - RESERVED_TEMPLATE_VARIABLES)) or 'none'})",
                               param)
        return kwargs

    def prompt_ids(self, prompt: str | list[int] | tuple[list[dict], dict], param: str) -> list[int]:
        """Tokenize one prompt: text, token ids, or (chat messages, template kwargs) (blocking: call
        through `tokenize`)."""
        tok = self.target.tokenizer
        if isinstance(prompt, str):
            if tok is None:
                raise ApiError(400, f"target {self.target.name} has no tokenizer; send token ids", param)
            return tok(prompt)["input_ids"]
        if isinstance(prompt, tuple):
            messages, kwargs = prompt
            if tok is None or tok.chat_template is None:
                raise ApiError(400, f"target {self.target.name} has no chat template; use /v1/completions", param)
            try:
                return self.target.chat_ids(messages, template_kwargs=kwargs)
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
    def stop_ids(self, body: RequestBody) -> frozenset[int]:
        """Token ids that end an answer: the target's EOS (unless ignore_eos) and stop_token_ids."""
        extra = list(body.stop_token_ids or [])
        bad = [t for t in extra if not 0 <= t < self.target.vocab_size]
        if bad:
            raise ApiError(400, f"stop_token_ids must be in [0, {self.target.vocab_size}), got {bad}", "stop_token_ids")
        return frozenset(([] if body.ignore_eos else self.target.eos_token_ids) + extra)

    def assembler(self, body: RequestBody, stop_ids: frozenset[int]) -> TextAssembler:
        hidden = frozenset() if body.include_stop_str_in_output else stop_ids
        return TextAssembler(self.target.tokenizer, body.stops, include_stop=body.include_stop_str_in_output,
                             skip_special_tokens=body.skip_special_tokens, hidden_ids=hidden)

    @staticmethod
    def choice_seed(body: RequestBody, index: int) -> int | None:
        """Choice 0 uses the request's seed (n=1 and n>1 agree on it); choice i > 0 a seed derived from
        (seed, i), so the n choices are independent samples, each reproducible."""
        if body.seed is None or index == 0:
            return body.seed
        return derive_seed(body.seed, index)

    def submit(self, ids: list[int], body: RequestBody, max_tokens: int, index: int, on_update,
               request_id: str | None = None) -> Request:
        loop = asyncio.get_running_loop()

        def listener(req: Request, new: list[int], final: bool) -> None:
            try:
                loop.call_soon_threadsafe(on_update, index, final)
            except RuntimeError:  # the event loop is closed: nobody is waiting for this answer any more
                pass

        tools = active_tools(getattr(body, "tools_dicts", None), getattr(body, "tool_choice", None))
        try:  # each choice its own grammar state (structured output; a tool call is one)
            constraint = (TokenConstraint.json(self.target, call_schema(tools)) if tools else
                          response_format_constraint(self.target, getattr(body, "response_format", None)))
        except ValueError as err:
            raise ApiError(400, str(err), "tools" if tools else "response_format") from None
        try:
            req = self.engine.submit(ids, body.sampling(), max_tokens, stop_ids=sorted(self.stop_ids(body)),
                                     listener=listener, seed=self.choice_seed(body, index),
                                     logprobs=body.top_logprobs_count(), request_id=request_id, constraint=constraint)
            if self.flywheel is not None:
                self.flywheel.submitted(req, body)
            return req
        except QueueFullError as err:
            if self.metrics:
                self.metrics.rejected()
            raise ApiError(429, str(err), None, "rate_limit_exceeded", {"Retry-After": "1"}) from None
        except EngineUnavailableError as err:
            raise ApiError(503, str(err), None, "service_unavailable", {"Retry-After": "5"}) from None
        except ValueError as err:
            raise ApiError(400, str(err), "prompt") from None

    def start(self, jobs: list[tuple[list[int], int]], body: RequestBody,
              request_id: str | None = None) -> tuple[list[Choice], asyncio.Queue]:
        """Submit one engine request per choice (jobs: (prompt ids, max_tokens), in choice order); their
        updates arrive on the returned queue as (choice index, final). If a submission fails, the
        choices already submitted are cancelled. request_id: the client's X-Request-Id, the engine id
        of a single choice (`<id>-<index>` for several); None = random ids."""
        queue: asyncio.Queue = asyncio.Queue()
        choices: list[Choice] = []
        try:
            for index, (ids, max_tokens) in enumerate(jobs):
                rid = request_id if request_id is None or len(jobs) == 1 else f"{request_id}-{index}"
                req = self.submit(ids, body, max_tokens, index, lambda i, final: queue.put_nowait((i, final)), rid)
                choices.append(Choice(index, req, self.assembler(body, req.stop_ids)))
        except Exception:
            for c in choices:
                self.engine.cancel(c.req)
            raise
        return choices, queue

    def advance(self, choice: Choice, final: bool) -> tuple[str, bool]:
        """Feed the choice's new tokens to its assembler -> (text delta, whether the answer is complete);
        a stop string met before the engine finished cancels the request."""
        req = choice.req
        delta, stopped = choice.assembler.update(list(req.tokens), final)
        if stopped and not final:
            self.engine.cancel(req)
        if (stopped or final) and not choice.done:
            choice.done = True
            self._done(req)
        return delta, stopped or final

    async def run_to_end(self, jobs: list[tuple[list[int], int]], body: RequestBody,
                         request_id: str | None = None) -> list[Outcome]:
        """Non-streaming: generate every choice until the engine finishes it or a stop string appears."""
        choices, queue = self.start(jobs, body, request_id)
        try:
            while not all(c.done for c in choices):
                index, final = await queue.get()
                choice = choices[index]
                if not choice.done and (body.stops or final):
                    self.advance(choice, final)
        except asyncio.CancelledError:  # the client went away
            for c in choices:
                self.engine.cancel(c.req)
            raise
        outcomes = []
        for c in choices:
            if not c.assembler.stopped and c.req.finish_reason not in ("stop", "length"):
                raise not_generated(c.req)
            reason = "stop" if c.assembler.stopped else c.req.finish_reason
            outcomes.append(Outcome(c.req, c.assembler.text, reason, c.assembler.n_tokens, c.index))
        return outcomes

    def _done(self, req: Request) -> Request:
        if self.metrics:
            self.metrics.request_done(req)
        if req.finish_reason != "error":
            self.prometheus.spec_decode.record(req.stats)
        if self.flywheel is not None:
            self.flywheel.finished(req)
        return req

    def stream(self, jobs: list[tuple[list[int], int]], body: RequestBody, fmt: ChatStream | CompletionStream,
               request_id: str | None = None):
        """Submit now (so queue-full / bad input still become HTTP errors), then return the SSE event
        generator."""
        choices, queue = self.start(jobs, body, request_id)
        return self._events(choices, queue, body, fmt)

    async def _events(self, choices: list[Choice], queue: asyncio.Queue, body: RequestBody,
                      fmt: ChatStream | CompletionStream):
        try:
            for c in choices:
                if (first := fmt.first(c.index)) is not None:
                    yield sse(first)
            while not all(c.done for c in choices):
                updates = {}
                index, final = await queue.get()
                updates[index] = final
                while not queue.empty():  # coalesce updates that arrived meanwhile
                    index, final = queue.get_nowait()
                    updates[index] = updates.get(index, False) or final
                for index, final in updates.items():
                    choice = choices[index]
                    if choice.done:
                        continue
                    if choice.req.finish_reason in ("error", "cancelled"):
                        yield sse(not_generated(choice.req).body())
                        return
                    delta, complete = self.advance(choice, final)
                    entries = choice.new_logprobs()
                    if complete:
                        if delta and (chunk := fmt.delta(index, delta, None)) is not None:
                            yield sse(chunk)
                        reason = "stop" if choice.assembler.stopped else choice.req.finish_reason
                        yield sse(fmt.finish(index, reason, spec_decode([choice.req]), entries))
                    elif (delta or entries) and (chunk := fmt.delta(index, delta, entries)) is not None:
                        yield sse(chunk)
            if body.include_usage:
                yield sse(fmt.usage(request_usage([c.req for c in choices],
                                                  sum(c.assembler.n_tokens for c in choices), body.n)))
            yield "data: [DONE]\n\n"
        finally:
            for c in choices:
                if not c.done:  # the client disconnected mid-stream (or another choice failed)
                    self.engine.cancel(c.req)
                    c.done = True
                    self._done(c.req)

    # ---- endpoints ---------------------------------------------------------------------------------------
    def check_choices(self, body: RequestBody, prompts: int) -> None:
        limit = self.cfg.api.max_choices
        if body.n * prompts > limit:
            raise ApiError(400, f"n={body.n} × {prompts} prompt(s) = {body.n * prompts} choices; this server "
                                f"generates at most {limit} per request (api.max_choices)", "n")

    async def chat(self, body: ChatBody, request_id: str | None = None):
        self.check_request(body, "messages")
        self.check_choices(body, 1)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            tools, constrained = tool_plan(body.tools_dicts, body.tool_choice)
        except ValueError as err:
            raise ApiError(400, str(err), "tool_choice") from None
        if tools and (body.response_format or {}).get("type", "text") != "text":
            raise ApiError(400, "tools and a response_format cannot be combined here", "response_format")
        messages = ([tools_message(tools, constrained)] if tools else []) + messages
        names = [t["function"]["name"] for t in tools] or None  # answers that call one become tool_calls
        kwargs = self.template_kwargs(body)
        (ids,) = await self.tokenize([(messages, kwargs)], "messages")
        jobs = [(ids, self.max_tokens(body, len(ids), "messages"))] * body.n
        rid, created = f"chatcmpl-{request_id or uuid.uuid4().hex}", int(time.time())
        logprobs = Logprobs(self.target.tokenizer)
        if body.stream:
            args = (rid, created, self.model_name, body.include_usage, logprobs)
            fmt = ToolCallStream(*args, names) if names else ChatStream(*args)  # tools: answers held until whole
            return self.stream(jobs, body, fmt, request_id)
        outs = await self.run_to_end(jobs, body, request_id)
        want = body.top_logprobs_count() is not None
        return chat_completion(rid, created, self.model_name, outs, body.n, logprobs if want else None, names)

    async def completions(self, body: CompletionBody, request_id: str | None = None):
        self.check_request(body, "prompt")
        prompts = body.prompts()
        if len(prompts) > self.cfg.api.max_prompts:
            raise ApiError(400, f"{len(prompts)} prompts in one request; at most {self.cfg.api.max_prompts}", "prompt")
        if body.stream and len(prompts) > 1:
            raise ApiError(400, "streaming takes a single prompt", "prompt")
        self.check_choices(body, len(prompts))
        ids_list = await self.tokenize(prompts, "prompt")
        limits = [self.max_tokens(body, len(ids), "prompt") for ids in ids_list]
        jobs = [(ids, limit) for ids, limit in zip(ids_list, limits) for _ in range(body.n)]  # prompt-major
        rid, created = f"cmpl-{request_id or uuid.uuid4().hex}", int(time.time())
        logprobs = Logprobs(self.target.tokenizer)
        if body.stream:
            return self.stream(jobs, body, CompletionStream(rid, created, self.model_name, body.include_usage,
                                                            logprobs), request_id)
        outs = await self.run_to_end(jobs, body, request_id)
        want = body.logprobs is not None
        return text_completion(rid, created, self.model_name, outs, body.n, logprobs if want else None)

    @property
    def drafter_ref(self) -> str | None:
        """The drafter reference this replica serves (pinned to a version at deployment), None in mode off."""
        return self.cfg.model.drafter if self.engine.drafting else None

    def model_card(self) -> ServedModel:
        return ServedModel(id=self.model_name, object="model", created=self.created, owned_by="dspark",
                           root=self.target.name, drafter=self.drafter_ref, scheduler=self.engine.mode,
                           max_model_len=self.engine.max_model_len)

    def models(self) -> ModelList:
        return ModelList(data=[self.model_card()])

    def stats(self) -> dict:
        """GET /v1/stats: the engine's snapshot, plus per-domain acceptance and capture counts."""
        stats = self.engine.stats()
        if self.flywheel is not None:
            stats["acceptance_by_domain"] = self.flywheel.stats.snapshot()
            stats["capture"] = self.flywheel.capture_counts()
        return stats

    def health(self) -> tuple[int, dict]:
        stats = self.engine.stats()
        ok = stats["healthy"] and stats["loop_alive"]
        return (200 if ok else 503), {"status": "ok" if ok else "unhealthy", "model": self.model_name, **stats}
