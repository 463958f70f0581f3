"""The OpenAI wire protocol of the serving endpoint: typed request bodies, typed responses, errors.

Requests (`ChatBody`, `CompletionBody`) are pydantic models whose constraints live in `Field(...)`.
Nothing is silently ignored: an unknown key answers 400 naming it ("unrecognized request argument",
as OpenAI's own API does); every OpenAI field this server does not implement is declared and answers
400 naming it as soon as a request asks for it (`tools`, a non-zero penalty, `echo`, ...); neutral
values (`n: 1`, `frequency_penalty: 0`, `tool_choice: "none"`) are accepted, as generic clients send
them. The only fields accepted without effect are identifiers (`user`, `metadata`).

Responses are the `openai` package's own types (ChatCompletion, ChatCompletionChunk, Completion,
Model), subclassed only to add this server's extensions: `spec_decode` (speculative-decoding
statistics) and, on completions, the generated `token_ids`.

Errors have OpenAI's shape {"error": {"message", "type", "param", "code"}} (`ApiError.response`).
"""
from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from openai.types import Completion, CompletionChoice, CompletionUsage, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.shared import ErrorObject
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from dspark.decoding.sampling import MinP, SamplingParams, Temperature, TopK, TopP

# ---- errors ---------------------------------------------------------------------------------------------
_ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
                413: "invalid_request_error", 422: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 429: "rate_limit_error", 503: "service_unavailable"}


class ErrorResponse(BaseModel):
    error: ErrorObject


REQUEST_ID_HEADER = "x-request-id"
DRAFTER_HEADER = "X-DSpark-Drafter"  # on every response: the pinned drafter version serving it (mode != off)
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def client_request_id(value: str | None) -> str | None:
    """The client's `X-Request-Id` (vLLM and OpenAI's header): it names the engine request in logs and is
    the row id of a captured request (so its train/holdout split is the client's choice, reproducibly).
    None when absent; 1-128 characters of [A-Za-z0-9._:-], else a 400."""
    if value is None:
        return None
    if not _REQUEST_ID.fullmatch(value):
        raise ApiError(400, f"X-Request-Id must be 1-128 characters of letters, digits and . _ : - "
                            f"(got {len(value)} characters)", REQUEST_ID_HEADER)
    return value


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
    if err.get("type") == "extra_forbidden":
        return ApiError(400, f"unrecognized request argument '{field}': this server does not implement it",
                        field, code="unrecognized_argument")
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    return ApiError(400, f"invalid '{field}': {msg}", field, code=err.get("type"))


def _field_path(err: dict) -> list[str]:
    loc = list(err.get("loc", ()))
    if loc and loc[0] == "body":
        loc = loc[1:]
    return [str(p) for p in loc if isinstance(p, int) or not _NOT_A_FIELD.search(str(p))]


# ---- requests ---------------------------------------------------------------------------------------------
_NEUTRAL = {"repetition_penalty": 1.0, "tool_choice": "none", "modalities": ["text"],
            "response_format": {"type": "text"}, "best_of": 1, "parallel_tool_calls": True}
MAX_LOGPROBS = 20  # top alternatives per token at most (OpenAI's chat limit; vLLM's default max_logprobs)


def _asks_for(field: str, value: Any) -> bool:
    """Whether an unimplemented field's value asks for behaviour (False for null/false/0/empty and the
    field's documented no-op value)."""
    if value is None or value is False or value == 0 or value in ("", [], {}):
        return False
    return value != _NEUTRAL.get(field, object())


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = Field(False, description="send a last chunk with `usage` (and empty choices)")


class RequestBody(BaseModel):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="the served model name (GET /v1/models); None: the served one")
    max_tokens: int | None = Field(None, ge=1, description="tokens to generate at most (capped by the server)")
    temperature: Annotated[Temperature, Field(le=2)] | None = Field(None, description="in [0, 2]; None: 1")
    top_p: TopP | None = Field(None, description="None: 1")
    top_k: TopK | None = Field(None, description="an extension, as in vLLM; None or 0: off")
    min_p: MinP | None = Field(None, description="an extension, as in vLLM: drop tokens below min_p × the top "
                                                 "probability (after temperature); None or 0: off")
    seed: int | None = Field(None, ge=-2**63, le=2**64 - 1,
                             description="the request's own seed (each of its prompts uses it; choice i > 0 of n "
                                         "a seed derived from it): same seed, prompt and settings, same output, "
                                         "whatever else the server is doing (engine.seeded_sampling=keyed)")
    n: int = Field(1, ge=1, description="independent choices per prompt (each sampled losslessly)")
    stream: bool = Field(False, description="answer with server-sent events")
    stream_options: StreamOptions | None = Field(None, description="only with stream=true")
    stop: (Annotated[str, Field(min_length=1)]
           | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=4)] | None) = Field(
        None, description="up to 4 non-empty strings; the text ends before the first one generated")
    ignore_eos: bool = Field(False, description="extension (as in vLLM): do not stop at the target's EOS")
    stop_token_ids: list[int] | None = Field(None, max_length=64, description=(
        "extension (as in vLLM): token ids that also end the answer (finish_reason 'stop'; the id stays in "
        "token_ids and usage, its text only with include_stop_str_in_output)"))
    include_stop_str_in_output: bool = Field(False, description=(
        "extension (as in vLLM): keep the stop string (or the stop token's text) at the end of the text"))
    skip_special_tokens: bool = Field(True, description="extension (as in vLLM): drop special tokens from the text")
    user: str | None = Field(None, description="an end-user id; the flywheel reads a domain from it when "
                                                "metadata.domain is absent (dspark/flywheel/domain.py)")
    metadata: dict[str, str] | None = Field(None, description="OpenAI's key-value tags; `domain` labels the "
                                                              "request's acceptance metrics and capture")
    # OpenAI fields this server does not implement: 400 naming the field when a request asks for them
    frequency_penalty: float | None = Field(None, description="not supported (only 0)")
    presence_penalty: float | None = Field(None, description="not supported (only 0)")
    repetition_penalty: float | None = Field(None, description="not supported (only 1)")
    logit_bias: dict | None = Field(None, description="not supported (only empty)")

    store: bool | None = Field(None, description="not supported (only false: nothing is stored)")

    @field_validator("frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias", "store",
                     "functions", "function_call", "parallel_tool_calls",
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
                              top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
                              min_p=self.min_p or 0.0)

    def top_logprobs_count(self) -> int | None:
        """None: no logprobs; k: each token's logprob and its k most likely alternatives."""
        raise NotImplementedError


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"] = Field(description="only text parts are supported")
    text: str


class CalledFunction(BaseModel):
    name: str = Field(description="the function called")
    arguments: str = Field(description="its arguments: a JSON object, as a string (OpenAI's shape)")

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value: str) -> str:
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            raise ValueError("arguments must be a JSON object written as a string")
        return value


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str | None = Field(None, description="the call's id (a later `tool` message names it)")
    type: Literal["function"] = Field("function", description="only function calls")
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")  # e.g. `name`: rendered only where the chat template reads it
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = Field(None, description="a string or a list of text parts")
    tool_calls: list[ToolCall] | None = Field(None, description=(
        "an assistant's earlier calls: shown to the model as the call JSON it writes ({\"name\", \"arguments\"})"))
    tool_call_id: str | None = Field(None, description="a `tool` message: the call whose result it holds")

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        calls = [json.dumps({"name": c.function.name, "arguments": json.loads(c.function.arguments)})
                 for c in self.tool_calls or []]
        return "\n".join(([self.content] if self.content else []) + calls)


class FunctionSpec(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$", description="the function's name")
    description: str | None = Field(None, description="what it does (shown to the model)")
    parameters: dict | None = Field(None, description="JSON schema of its arguments (the call is decoded under it)")
    strict: bool | None = Field(None, description="accepted; the arguments always follow the schema here")


class ToolSpec(BaseModel):
    type: Literal["function"] = Field(description="only function tools")
    function: FunctionSpec


class ChatBody(RequestBody):
    messages: list[ChatMessage] = Field(min_length=1, description="the conversation, rendered with the chat template")
    max_completion_tokens: int | None = Field(None, ge=1, description="preferred over max_tokens when given")
    logprobs: bool | None = Field(None, description="return each output token's log-probability under the target")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description=(
        "with logprobs=true: the most likely alternatives per token (0-20)"))
    chat_template_kwargs: dict[str, Any] | None = Field(None, description=(
        "extension (as in vLLM): extra variables for the chat template (e.g. enable_thinking); each must be "
        "one the template reads, else 400"))
    reasoning_effort: str | None = Field(None, description=(
        "passed to the chat template as the variable `reasoning_effort` where it reads one, else 400"))
    parallel_tool_calls: bool | None = Field(None, description="only true (the default): one call is made")
    tools: list[ToolSpec] | None = Field(None, description="functions the model may call (dspark/serve/tools.py)")
    tool_choice: Any = Field(None, description=(
        "'none', 'required' or {'type': 'function', 'function': {'name': ...}}: the answer is one call, decoded "
        "under its arguments' JSON schema; 'auto' (the default with tools) is not supported yet: 400"))
    functions: list | None = Field(None, description="not supported (deprecated function calling)")
    function_call: Any = Field(None, description="not supported (deprecated function calling)")
    response_format: dict | None = Field(None, description=(
        "structured output: {'type': 'text'} (default), {'type': 'json_object'} (any JSON object) or {'type': "
        "'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}; decoded exactly from the target's "
        "distribution restricted to the grammar, speculative decoding included (dspark/decoding/constraint.py)"))

    @property
    def tools_dicts(self) -> list[dict] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, value: dict | None) -> dict | None:
        kind = (value or {}).get("type", "text")
        if kind not in ("text", "json_object", "json_schema"):
            raise ValueError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
        if kind == "json_schema" and not isinstance((value.get("json_schema") or {}).get("schema"), dict):
            raise ValueError("response_format.json_schema.schema must be a JSON schema object")
        return value
    modalities: list | None = Field(None, description="only ['text']")
    audio: Any = Field(None, description="not supported")
    prediction: Any = Field(None, description="not supported (predicted outputs)")
    web_search_options: Any = Field(None, description="not supported")

    def prompt_chars(self) -> int:
        return sum(len(m.text()) for m in self.messages)

    def top_logprobs_count(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise ApiError(400, "'top_logprobs' needs logprobs=true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_kwargs(self) -> dict[str, Any]:
        return {**(self.chat_template_kwargs or {}),
                **({"reasoning_effort": self.reasoning_effort} if self.reasoning_effort is not None else {})}


class CompletionBody(RequestBody):
    prompt: (Annotated[str, Field(min_length=1)]
             | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
             | Annotated[list[int], Field(min_length=1)]
             | Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1)]) = Field(
        description="a string, a list of strings, token ids, or a list of token-id lists")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description=(
        "return each output token's log-probability under the target and this many alternatives (0-20)"))
    best_of: int | None = Field(None, description="not supported (only 1)")
    echo: bool | None = Field(None, description="not supported (only false)")
    suffix: str | None = Field(None, description="not supported")

    def prompts(self) -> list[str | list[int]]:
        v = self.prompt
        return [v] if isinstance(v, str) or isinstance(v[0], int) else list(v)

    def prompt_chars(self) -> int:
        return sum(len(p) for p in self.prompts() if isinstance(p, str))

    def top_logprobs_count(self) -> int | None:
        return self.logprobs


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
