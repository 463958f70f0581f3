"""Building the OpenAI answers from finished or running engine requests: logprobs objects
(`Logprobs`), the SSE chunks of a streamed chat / text completion (`ChatStream`, `CompletionStream`,
`sse`), the non-streaming responses (`chat_completion`, `text_completion`) with `usage` and this
server's `spec_decode`, and the error of a request the engine did not generate (`not_generated`).
No engine, no HTTP: dspark.serve.service runs the requests and calls these."""
from __future__ import annotations

import json
from dataclasses import dataclass

from openai.types import CompletionUsage
from openai.types.chat import ChatCompletionMessage, ChatCompletionTokenLogprob
from openai.types.chat.chat_completion import Choice as ChatChoice
from openai.types.chat.chat_completion import ChoiceLogprobs as ChatChoiceLogprobs
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta, ChoiceDeltaToolCall, ChoiceDeltaToolCallFunction
from openai.types.chat.chat_completion_chunk import ChoiceLogprobs as ChunkChoiceLogprobs
from openai.types.chat.chat_completion_token_logprob import TopLogprob
from openai.types.completion_choice import Logprobs as CompletionLogprobs
from pydantic import BaseModel

from dspark.decoding.request import Request, TokenLogprob
from dspark.serve.tools import tool_calls_of
from dspark.serve.protocol import (ApiError, DSparkChatCompletion, DSparkChatCompletionChunk, DSparkCompletion,
                                   DSparkCompletionChoice, SpecDecode, dump, usage)


@dataclass
class Outcome:
    """A finished (or stopped) choice as the API reports it."""

    req: Request
    text: str
    finish_reason: str
    completion_tokens: int
    index: int = 0

    @property
    def logprobs(self) -> list[TokenLogprob]:
        return self.req.token_logprobs[: self.completion_tokens]


LOGPROB_FLOOR = -9999.0  # -inf (a token the processed distribution excludes) is not JSON: vLLM's floor


class Logprobs:
    """Engine TokenLogprobs -> OpenAI's logprobs objects (chat: ChoiceLogprobs; completions: Logprobs).
    A token's string is its own decode (a piece of a multi-byte character shows as U+FFFD)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._strings: dict[int, str] = {}

    def token(self, tid: int) -> str:
        if tid not in self._strings:
            self._strings[tid] = (self.tokenizer.decode([tid], skip_special_tokens=False)
                                  if self.tokenizer is not None else f"token_id:{tid}")
        return self._strings[tid]

    @staticmethod
    def value(lp: float) -> float:
        return max(lp, LOGPROB_FLOOR)

    def chat(self, entries: list[TokenLogprob], cls=ChatChoiceLogprobs):
        """-> cls: the non-streaming ChoiceLogprobs, or the chunk's (ChunkChoiceLogprobs)."""
        def item(tid: int, lp: float, cls):
            text = self.token(tid)
            return cls(token=text, bytes=list(text.encode("utf-8")), logprob=self.value(lp))

        return cls(content=[
            ChatCompletionTokenLogprob(**item(e.token, e.logprob, TopLogprob).model_dump(),
                                       top_logprobs=[item(t, lp, TopLogprob) for t, lp in e.top])
            for e in entries])

    def completion(self, entries: list[TokenLogprob], offset: int = 0) -> CompletionLogprobs:
        tokens = [self.token(e.token) for e in entries]
        offsets = []
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        return CompletionLogprobs(tokens=tokens, token_logprobs=[self.value(e.logprob) for e in entries],
                                  top_logprobs=[{self.token(t): self.value(lp) for t, lp in e.top} for e in entries],
                                  text_offset=offsets)


class ChatStream:
    """SSE chunks of /v1/chat/completions: per choice a first chunk with the role, content deltas (with
    their tokens' logprobs when asked), a finish chunk."""

    def __init__(self, rid: str, created: int, model: str, include_usage: bool, logprobs: Logprobs):
        self.base = {"id": rid, "created": created, "model": model, "object": "chat.completion.chunk",
                     **({"usage": None} if include_usage else {})}
        self.logprobs = logprobs

    def first(self, index: int) -> BaseModel | None:
        return self._chunk(index, ChoiceDelta(role="assistant", content=""), None)

    def delta(self, index: int, text: str, entries: list[TokenLogprob] | None) -> BaseModel:
        return self._chunk(index, ChoiceDelta(content=text), None, entries)

    def finish(self, index: int, reason: str, spec: SpecDecode, entries: list[TokenLogprob] | None) -> BaseModel:
        return self._chunk(index, ChoiceDelta(), reason, entries, spec_decode=spec)

    def usage(self, u: CompletionUsage) -> BaseModel:
        return DSparkChatCompletionChunk(**{**self.base, "usage": u}, choices=[])

    def _chunk(self, index: int, delta: ChoiceDelta, reason: str | None, entries=None, **extra) -> BaseModel:
        logprobs = self.logprobs.chat(entries, ChunkChoiceLogprobs) if entries else None
        choice = ChunkChoice(index=index, delta=delta, finish_reason=reason, logprobs=logprobs)
        return DSparkChatCompletionChunk(**self.base, choices=[choice], **extra)


class ToolCallStream(ChatStream):
    """A streamed answer when tools are offered: each choice's text is held until it finishes (a call is only
    known to be one when it is whole), then sent in its finish chunk as `delta.tool_calls` (finish_reason
    "tool_calls") when it is exactly a call of an offered tool, else as `delta.content`."""

    def __init__(self, rid: str, created: int, model: str, include_usage: bool, logprobs: Logprobs,
                 tool_names: list[str]):
        super().__init__(rid, created, model, include_usage, logprobs)
        self.names, self.held = tool_names, {}

    def delta(self, index: int, text: str, entries: list[TokenLogprob] | None) -> None:
        self.held[index] = self.held.get(index, "") + text
        return None

    def finish(self, index: int, reason: str, spec: SpecDecode, entries: list[TokenLogprob] | None) -> BaseModel:
        text = self.held.pop(index, "")
        calls = tool_calls_of(text, self.names) if reason == "stop" else None
        if calls is None:
            return self._chunk(index, ChoiceDelta(content=text), reason, spec_decode=spec)
        deltas = [ChoiceDeltaToolCall(index=i, id=c["id"], type="function",
                                      function=ChoiceDeltaToolCallFunction(**c["function"]))
                  for i, c in enumerate(calls)]
        return self._chunk(index, ChoiceDelta(tool_calls=deltas), "tool_calls", spec_decode=spec)


class CompletionStream:
    """SSE chunks of /v1/completions (per choice text deltas, with logprobs when asked, and a finish chunk)."""

    def __init__(self, rid: str, created: int, model: str, include_usage: bool, logprobs: Logprobs):
        self.base = {"id": rid, "created": created, "model": model, "object": "text_completion",
                     **({"usage": None} if include_usage else {})}
        self.logprobs = logprobs
        self.offsets: dict[int, int] = {}  # text sent per choice (text_offset of the next token)

    def first(self, index: int) -> BaseModel | None:
        return None

    def delta(self, index: int, text: str, entries: list[TokenLogprob] | None) -> BaseModel:
        return self._chunk(index, text, None, entries)

    def finish(self, index: int, reason: str, spec: SpecDecode, entries: list[TokenLogprob] | None) -> BaseModel:
        return self._chunk(index, "", reason, entries, spec_decode=spec)

    def usage(self, u: CompletionUsage) -> BaseModel:
        return DSparkCompletion.model_construct(**{**self.base, "usage": u}, choices=[])

    def _chunk(self, index: int, text: str, reason: str | None, entries=None, **extra) -> BaseModel:
        logprobs = None
        if entries:
            logprobs = self.logprobs.completion(entries, self.offsets.get(index, 0))
            self.offsets[index] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
        # a streamed completion chunk has finish_reason null until the last one: build without validation
        choice = DSparkCompletionChoice.model_construct(index=index, text=text, finish_reason=reason,
                                                        logprobs=logprobs)
        return DSparkCompletion.model_construct(**self.base, choices=[choice], **extra)


# ---- whole responses -----------------------------------------------------------------------------------
def request_usage(reqs: list[Request], completion_tokens: int, n: int) -> CompletionUsage:
    """Each prompt's tokens count once, however many (n) choices were sampled from it."""
    return usage(sum(len(r.prompt_ids) for r in reqs) // n, completion_tokens)


def spec_decode(reqs: list[Request]) -> SpecDecode:
    """The requests' speculative-decoding statistics, summed; τ = (accepted + rounds) / rounds."""
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


def chat_completion(rid: str, created: int, model: str, outs: list[Outcome], n: int,
                    logprobs: Logprobs | None, tool_names: list[str] | None = None) -> DSparkChatCompletion:
    """The non-streaming /v1/chat/completions answer (logprobs None: not asked for; tool_names: the tools
    offered: an answer that is exactly a call of one of them is returned as `tool_calls`)."""
    choices = []
    for o in outs:
        calls = tool_calls_of(o.text, tool_names) if tool_names and o.finish_reason == "stop" else None
        message = (ChatCompletionMessage(role="assistant", content=None, tool_calls=calls) if calls else
                   ChatCompletionMessage(role="assistant", content=o.text))
        choices.append(ChatChoice(index=o.index, message=message, finish_reason="tool_calls" if calls else o.finish_reason,
                                  logprobs=logprobs.chat(o.logprobs) if logprobs is not None else None))
    reqs = [o.req for o in outs]
    return DSparkChatCompletion(id=rid, object="chat.completion", created=created, model=model, choices=choices,
                                usage=request_usage(reqs, sum(o.completion_tokens for o in outs), n),
                                spec_decode=spec_decode(reqs))


def text_completion(rid: str, created: int, model: str, outs: list[Outcome], n: int,
                    logprobs: Logprobs | None) -> DSparkCompletion:
    """The non-streaming /v1/completions answer, with each choice's generated token_ids."""
    choices = [DSparkCompletionChoice(index=o.index, text=o.text, finish_reason=o.finish_reason,
                                      logprobs=logprobs.completion(o.logprobs) if logprobs is not None else None,
                                      token_ids=list(o.req.tokens[: o.completion_tokens]))
               for o in outs]
    reqs = [o.req for o in outs]
    return DSparkCompletion(id=rid, object="text_completion", created=created, model=model, choices=choices,
                            usage=request_usage(reqs, sum(o.completion_tokens for o in outs), n),
                            spec_decode=spec_decode(reqs))


def not_generated(req: Request) -> ApiError:
    """The error of a request the engine cancelled (stopping: 503) or failed (500)."""
    if req.finish_reason == "cancelled":  # the engine stopped under it
        return ApiError(503, "the request was cancelled: the engine is stopping", None, "service_unavailable",
                        {"Retry-After": "5"})  # another replica (or this one, restarted) will take it
    return ApiError(500, f"generation failed: {req.error}", None, "generation_failed")


def sse(obj: BaseModel) -> str:
    """One server-sent event carrying obj as JSON."""
    return f"data: {json.dumps(dump(obj))}\n\n"
