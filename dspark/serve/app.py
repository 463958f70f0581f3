"""OpenAI-compatible HTTP app (FastAPI, no Ray) around the draft-plus-verify engine.

Pieces, top to bottom:
- `ServeConfig`: what to serve (target, drafter reference, device, engine + scheduler), the HTTP API
  limits and auth, and the Ray Serve deployment shape (replicas, max ongoing/queued requests, CPUs,
  GPUs). `resolve_device` turns model.device ("auto" | "cpu" | "cuda") into the replica's device.
- `OpenAIService`: protocol logic without Ray — request validation, chat template / tokenization,
  submission to the engine (which runs in its own thread), non-streaming and SSE responses with
  `usage` and `spec_decode`. `make_app(service)` wraps it in a FastAPI app:
      POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /v1/stats,
      GET /health (vLLM's probe: 200 empty / 503), GET /healthz (JSON status), GET /metrics (Prometheus)
- `DSparkServer`: the Ray Serve deployment (FastAPI ingress) hosting one engine per replica, with
  per-replica metrics exported through `ray.serve.metrics`.
- `deployment_for(cfg)` / `build_app(args)`: the bound application, for `jobs/serve.py` and for
  `serve deploy infra/serve/serve_config.yaml`.

Errors follow OpenAI's shape {"error": {"message", "type", "param", "code"}}: invalid JSON, bad
fields and unimplemented OpenAI fields -> 400 naming the field, missing/wrong API key -> 401,
unknown model or path -> 404, wrong method -> 405, body over api.max_body_bytes -> 413, full queue
-> 429, engine unhealthy -> 503 (Ray Serve itself answers 503 when its own request queue is full).
Request and response models: dspark/serve/protocol.py; config: dspark/serve/config.py; the Ray Serve
deployment: dspark/serve/deployment.py (the only file here that imports Ray).
"""
from __future__ import annotations

import asyncio
import hmac
import logging

from fastapi import Depends, FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from dspark.serve.prometheus import HttpMetrics
from dspark.serve.protocol import (DRAFTER_HEADER, REQUEST_ID_HEADER, ApiError, ChatBody, CompletionBody, client_request_id, dump,
                                   validation_error)
from dspark.serve.service import OpenAIService

log = logging.getLogger("dspark.serve")


ROUTES = ("POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /v1/stats, GET /health, "
          "GET /healthz, GET /metrics")


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
    app.add_middleware(HttpMetrics, metrics=service.prometheus)  # outermost: counts 413s too

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

    def respond(result, request_id: str | None = None):
        echo = {"X-Request-Id": request_id} if request_id else {}  # echoed back, as vLLM does
        if service.drafter_ref:
            echo[DRAFTER_HEADER] = service.drafter_ref  # the pinned version that verified this answer's drafts
        if isinstance(result, BaseModel):
            return JSONResponse(dump(result), headers=echo)
        return StreamingResponse(result, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **echo})

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat(body: ChatBody, request: HttpRequest):
        request_id = client_request_id(request.headers.get(REQUEST_ID_HEADER))
        return respond(await service.chat(body, request_id), request_id)

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(body: CompletionBody, request: HttpRequest):
        request_id = client_request_id(request.headers.get(REQUEST_ID_HEADER))
        return respond(await service.completions(body, request_id), request_id)

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
        return service.stats()

    @app.get("/healthz")
    async def healthz():
        status, body = service.health()
        return JSONResponse(body, status_code=status)

    @app.get("/health")
    async def health():
        """vLLM's liveness/readiness probe: 200 with an empty body, 503 (OpenAI error shape) when not."""
        status, body = service.health()
        if status == 200:
            return Response(status_code=200)
        raise ApiError(status, f"engine unhealthy: {body.get('health_error') or 'engine loop not running'}", None,
                       "service_unavailable")

    @app.get("/metrics")
    async def metrics():
        """Prometheus text format (no API key, as vLLM: keep the port private or scrape through a proxy)."""
        payload, content_type = service.prometheus.render()
        return Response(payload, media_type=content_type)

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


