"""The OpenAI wire protocol of the serving endpoint: typed request bodies, typed responses, errors.

Requests (`ChatBody`, `CompletionBody`) are pydantic models whose constraints live in `Field(...)`;
unknown keys are ignored (clients send many), but every OpenAI field this server does not implement
is declared and answers 400 naming it as soon as a request asks for it (`logprobs: true`, `tools`,
`n: 2`, a non-zero penalty, ...); neutral values (`logprobs: false`, `n: 1`, `frequency_penalty: 0`)
are accepted, as generic clients send them.

Responses are the `openai` package's own types (ChatCompletion, ChatCompletionChunk, Completion,
Model), subclassed only to add this server's extensions: `spec_decode` (speculative-decoding
statistics) and, on completions, the generated `token_ids`.

Errors have OpenAI's shape {"error": {"message", "type", "param", "code"}} (`ApiError.response`).
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from openai.types import Completion, CompletionChoice, CompletionUsage, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.shared import ErrorObject
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from dspark.decoding.sampling import SamplingParams, Temperature, TopK, TopP

# ---- errors ---------------------------------------------------------------------------------------------
_ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
                413: "invalid_request_error", 422: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 429: "rate_limit_error", 503: "service_unavailable"}


class ErrorResponse(BaseModel):
    error: ErrorObject


class ApiError(Exception):
    """An HTTP error in OpenAI's shape: status, message, the request field at fault (param), a short
    machine-readable code (e.g. "model_not_found")."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    @property
    def type(self) -> str:
        return _ERROR_TYPES.get(self.status, "server_error")

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorObject(message=self.message, type=self.type, param=self.param,
                                               code=self.code))

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(mode="json", exclude_unset=True), status_code=self.status,
                            headers=self.headers)


# union members and wrappers that pydantic adds to an error's loc ("list[constrained-str]", "TextPart")
_NOT_A_FIELD = re.compile(r"[\[\]\-]|^(str|int|float|bool|dict|list|none)$|^[A-Z]")
_TYPE_MISMATCH = re.compile(r"_type$|^(int|float|bool)_parsing$")


def _specificity(err: dict) -> int:
    """A union alternative's error: a violated constraint says most, a wrong literal (e.g. a content
    part's type) more than a missing key, a type mismatch (just the wrong alternative) least."""
    kind = err.get("type", "")
    return 0 if _TYPE_MISMATCH.search(kind) else 1 if kind == "missing" else 2 if kind == "literal_error" else 3


def validation_error(errors: list[dict]) -> ApiError:
    """pydantic errors of a request body -> one 400 naming the field. Among a union's alternatives the
    most specific error wins: the deepest location, a constraint over a mere type mismatch."""
    if not errors:
        return ApiError(400, "invalid request body")
    if any(e.get("type") == "json_invalid" for e in errors):
        err = next(e for e in errors if e.get("type") == "json_invalid")
        return ApiError(400, f"request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}",
                        code="invalid_json")
    err = max(errors, key=lambda e: (len(_field_path(e)), _specificity(e)))
    path = _field_path(err)
    if not path:
        return ApiError(400, f"request body must be a JSON object (Content-Type: application/json): "
                             f"{err.get('msg')}")
    field = ".".join(path)
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    return ApiError(400, f"invalid '{field}': {msg}", field, code=err.get("type"))


def _field_path(err: dict) -> list[str]:
    loc = list(err.get("loc", ()))
    if loc and loc[0] == "body":
        loc = loc[1:]
    return [str(p) for p in loc if isinstance(p, int) or not _NOT_A_FIELD.search(str(p))]


# ---- requests ---------------------------------------------------------------------------------------------
_NEUTRAL = {"n": 1, "repetition_penalty": 1.0, "tool_choice": "none", "modalities": ["text"],
            "response_format": {"type": "text"}, "best_of": 1}


def _asks_for(field: str, value: Any) -> bool:
    """Whether an unimplemented field's value asks for behaviour (False for null/false/0/empty and the
    field's documented no-op value)."""
    if value is None or value is False or value == 0 or value in ("", [], {}):
        return False
    return value != _NEUTRAL.get(field, object())


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = Field(False, description="send a last chunk with `usage` (and empty choices)")


class RequestBody(BaseModel):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="the served model name (GET /v1/models); None: the served one")
    max_tokens: int | None = Field(None, ge=1, description="tokens to generate at most (capped by the server)")
    temperature: Temperature | None = None  # None: 1
    top_p: TopP | None = None  # None: 1
    top_k: TopK | None = None  # an extension, as in vLLM; None: off
    seed: int | None = Field(None, ge=-2**63, le=2**64 - 1,
                             description="the request's own RNG seed (each of its prompts uses it): same seed "
                                         "and settings, same output (under the same load with the dynamic scheduler)")
    stream: bool = Field(False, description="answer with server-sent events")
    stream_options: StreamOptions | None = Field(None, description="only with stream=true")
    stop: (Annotated[str, Field(min_length=1)]
           | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=4)] | None) = Field(
        None, description="up to 4 non-empty strings; the text ends before the first one generated")
    ignore_eos: bool = Field(False, description="extension (as in vLLM): do not stop at the target's EOS")
    user: str | None = Field(None, description="accepted and ignored")
    # OpenAI fields this server does not implement: 400 naming the field when a request asks for them
    n: int = Field(1, ge=1, description="choices per prompt; only 1 is supported")
    frequency_penalty: float | None = Field(None, description="not supported (only 0)")
    presence_penalty: float | None = Field(None, description="not supported (only 0)")
    repetition_penalty: float | None = Field(None, description="not supported (only 1)")
    logit_bias: dict | None = Field(None, description="not supported (only empty)")

    @field_validator("n", "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias", "logprobs",
                     "top_logprobs", "tools", "tool_choice", "functions", "function_call", "response_format",
                     "modalities", "audio", "prediction", "web_search_options", "best_of", "echo", "suffix",
                     check_fields=False)
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        if _asks_for(info.field_name, value):
            note = cls.model_fields[info.field_name].description
            raise ValueError(f"'{info.field_name}' is not supported by this server ({note}); got {value!r}")
        return value

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "'stream_options' is only allowed with stream=true", "stream_options")

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=1.0 if self.temperature is None else self.temperature,
                              top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"] = Field(description="only text parts are supported")
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = Field(None, description="a string or a list of text parts")
    tool_calls: list | None = Field(None, description="not supported (tool calling)")

    @field_validator("tool_calls")
    @classmethod
    def _no_tool_calls(cls, value):
        if value:
            raise ValueError("tool calls are not supported by this server")
        return value

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatBody(RequestBody):
    messages: list[ChatMessage] = Field(min_length=1, description="the conversation, rendered with the chat template")
    max_completion_tokens: int | None = Field(None, ge=1, description="preferred over max_tokens when given")
    logprobs: bool | None = Field(None, description="not supported (only false)")
    top_logprobs: int | None = Field(None, description="not supported (only 0)")
    tools: list | None = Field(None, description="not supported (tool calling)")
    tool_choice: Any = Field(None, description="not supported (only 'none')")
    functions: list | None = Field(None, description="not supported (deprecated function calling)")
    function_call: Any = Field(None, description="not supported (deprecated function calling)")
    response_format: dict | None = Field(None, description="not supported (only {'type': 'text'})")
    modalities: list | None = Field(None, description="only ['text']")
    audio: Any = Field(None, description="not supported")
    prediction: Any = Field(None, description="not supported (predicted outputs)")
    web_search_options: Any = Field(None, description="not supported")

    def prompt_chars(self) -> int:
        return sum(len(m.text()) for m in self.messages)


class CompletionBody(RequestBody):
    prompt: (Annotated[str, Field(min_length=1)]
             | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
             | Annotated[list[int], Field(min_length=1)]
             | Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1)]) = Field(
        description="a string, a list of strings, token ids, or a list of token-id lists")
    logprobs: int | None = Field(None, description="not supported")
    best_of: int | None = Field(None, description="not supported (only 1)")
    echo: bool | None = Field(None, description="not supported (only false)")
    suffix: str | None = Field(None, description="not supported")

    def prompts(self) -> list[str | list[int]]:
        v = self.prompt
        return [v] if isinstance(v, str) or isinstance(v[0], int) else list(v)

    def prompt_chars(self) -> int:
        return sum(len(p) for p in self.prompts() if isinstance(p, str))


# ---- responses --------------------------------------------------------------------------------------------
class SpecDecode(BaseModel):
    """Extension: speculative-decoding statistics of the request(s)."""

    rounds: int = Field(0, description="verify rounds (the prefill is not one)")
    draft_tokens_proposed: int = 0
    draft_tokens_verified: int = Field(0, description="drafts sent to the target")
    draft_tokens_accepted: int = 0
    mean_accepted_length: float | None = Field(None, description="τ = (accepted + rounds) / rounds")


class DSparkChatCompletion(ChatCompletion):
    spec_decode: SpecDecode | None = None


class DSparkChatCompletionChunk(ChatCompletionChunk):
    spec_decode: SpecDecode | None = None


class DSparkCompletionChoice(CompletionChoice):
    token_ids: list[int] | None = Field(None, description="extension: the generated token ids")


class DSparkCompletion(Completion):
    choices: list[DSparkCompletionChoice]
    spec_decode: SpecDecode | None = None


class ServedModel(Model):
    root: str = Field(description="the target model")
    drafter: str | None = Field(None, description="the drafter reference (None: no speculation)")
    scheduler: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ServedModel]


def usage(prompt_tokens: int, completion_tokens: int) -> CompletionUsage:
    return CompletionUsage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                           total_tokens=prompt_tokens + completion_tokens)


def dump(model: BaseModel) -> dict:
    """Wire JSON of a response: the fields that were set (explicit nulls included)."""
    return model.model_dump(mode="json", exclude_unset=True)
