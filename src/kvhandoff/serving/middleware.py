"""The HTTP server's outer layer: errors as OpenAI-shaped bodies with their status (`ERROR_STATUS`), the request
counter and body limit middlewares, the API key and its tenants, and the OpenAPI document's error responses."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from kvhandoff.serving.engine import Engine
from kvhandoff.serving.protocol import LONE_SURROGATE
from kvhandoff.serving.requests import RequestError
from kvhandoff.serving.response_models import ErrorBody, ErrorResponse, dump

logger = logging.getLogger(__name__)

_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict"}

#: HTTP status and OpenAI error type of each `engine.ERROR_KINDS`
ERROR_STATUS = {
    "invalid_request": (400, "invalid_request_error"),
    "not_found": (404, "not_found_error"),
    "too_long": (400, "invalid_request_error"),
    "too_many_sessions": (429, "rate_limit_error"),
    "overloaded": (503, "server_error"),
    "cancelled": (499, "invalid_request_error"),
    "internal": (500, "server_error"),
    "shutting_down": (503, "server_error"),
}


#: seconds a client is told to wait before retrying a 429 or 503 (Retry-After)
RETRY_AFTER_S = 1
#: routes that answer without the API key when the server opens its probes (`ServeConfig.open_probes`)
PROBE_PATHS = ("/health", "/metrics")
#: the ASGI scope key set on a request that carried a valid API key
KEYED_SCOPE = "kvhandoff.keyed"
#: what each error status of the API means (the OpenAPI document's responses; every body an `ErrorResponse`)
ERROR_MEANINGS = {
    400: "an invalid request: a body that is not JSON, a field that is invalid or unsupported (named in `param`), "
         "a prompt past the context window (code context_length_exceeded)",
    401: "no valid API key (the server was started with --api-key)",
    404: "no such model",
    408: "the request body did not arrive whole within --read-timeout seconds (the connection is closed)",
    413: "the request body is larger than --max-body-bytes",
    429: "every session is busy (retry after Retry-After seconds)",
    499: "the client went away",
    500: "an internal error",
    503: "the model's queue is full, or the server is draining (retry after Retry-After seconds)",
}


RETRY_HEADER = {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer"}}}


def documented(*statuses: int) -> dict:
    """The OpenAPI responses of ``statuses``: an `ErrorResponse` each, with Retry-After on 429 and 503."""
    return {status: {"model": ErrorResponse, "description": ERROR_MEANINGS[status],
                     **({"headers": RETRY_HEADER} if status in (429, 503) else {})} for status in statuses}


#: the headers of every answer of the completion routes (`respond.headers_of`)
ANSWER_HEADERS = {
    "X-KV-Handoff": {"description": "what happened to the conversation's cache", "required": True,
                     "schema": {"enum": ["applied", "escalated", "fallback", "reprefill", "none"]}},
    "X-KV-Reuse": {"description": "how the cached positions were found: the prompt's prefix, or its history at "
                                  "another offset", "required": True,
                   "schema": {"enum": ["prefix", "offset", "none"]}},
    "x-vsr-kv-transfer-status": {"description": "the same in the router vocabulary", "required": True,
                                 "schema": {"enum": ["applied", "fallback_reprefill", "unsupported"]}},
    "x-vsr-kv-mapper-id": {"description": "the mapper that ran (its manifest checksum)", "schema": {"type": "string"}},
    "x-vsr-kv-cache-id": {"description": "the conversation's cache: the one a router named, else the session's",
                          "schema": {"type": "string"}},
    "X-Session-ID": {"description": "the session the request belongs to", "schema": {"type": "string"}},
}


def generation_responses(answer) -> dict:
    """The OpenAPI responses of a completion route answering ``answer`` (a pydantic model) as JSON, or server-sent
    events with ``stream``; and every error it may answer."""
    return {200: {"model": answer, "headers": ANSWER_HEADERS,
                  "content": {"text/event-stream": {"schema": {
                      "type": "object", "required": ["data"], "properties": {"data": {
                          "type": "string", "description": "a JSON chunk, an error object, or [DONE]"}}}}},
                  "description": "the answer: JSON, or server-sent events with stream"},
            **documented(400, 401, 404, 408, 413, 429, 500, 503)}


def openapi_of(app: FastAPI) -> dict:
    """``app``'s OpenAPI document without FastAPI's 422 (an invalid body is a 400 here: `install_error_handlers`),
    the bounds of its integers written as integers (FastAPI writes every bound as a float: ``"minimum": 1.0``); on a
    server with an API key, the key as a bearer security scheme of every route (`install_api_key`)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for operations in schema["paths"].values():
            for operation in operations.values():
                operation["responses"].pop("422", None)
        _integer_bounds(schema)
        config = app.state.engine.config
        if config.api_key:
            _secured(schema, PROBE_PATHS if config.open_probes else ())
        app.openapi_schema = schema
    return app.openapi_schema


#: the name of the API key's security scheme in the OpenAPI document
API_KEY_SCHEME = "apiKey"


def _secured(document: dict, open_paths) -> None:
    """Declare the API key in ``document`` (in place): every operation needs it (401 without), those of
    ``open_paths`` take it optionally (a caller without one gets `Engine.liveness`)."""
    document.setdefault("components", {})["securitySchemes"] = {API_KEY_SCHEME: {
        "type": "http", "scheme": "bearer", "description": "one of the keys the server was started with (--api-key)"}}
    unauthorized = {"description": ERROR_MEANINGS[401],
                    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    for path, operations in document["paths"].items():
        for operation in operations.values():
            if path in open_paths:
                operation["security"] = [{}, {API_KEY_SCHEME: []}]
            else:
                operation["security"] = [{API_KEY_SCHEME: []}]
                operation["responses"].setdefault("401", unauthorized)


_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _integer_bounds(document) -> None:
    """Write the bounds of every ``"type": "integer"`` schema in ``document`` as integers (in place)."""
    pending = [document]
    while pending:
        node = pending.pop()
        if isinstance(node, dict):
            if node.get("type") == "integer":
                for bound in _BOUNDS:
                    if isinstance(node.get(bound), float) and node[bound].is_integer():
                        node[bound] = int(node[bound])
            pending.extend(node.values())
        elif isinstance(node, list):
            pending.extend(node)


def error_response(status: int, message: str, kind: str, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    """An OpenAI-style error object {"error": {message, type, param, code}}."""
    body = ErrorResponse(error=ErrorBody(message=message, type=kind, param=param, code=code))
    return JSONResponse(dump(body), status_code=status)


def field_path(location) -> str | None:
    """The request field a validation error is about, e.g. ``messages[0].content`` (pydantic's union-member tags
    left out)."""
    path = ""
    for part in location[1:] if location and location[0] == "body" else location:
        if isinstance(part, int):
            path += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier() and part not in _TYPE_TAGS and not part[:1].isupper():
            path += f".{part}" if path else part
    return path or None


def install_error_handlers(app: FastAPI) -> None:
    """Every failure as an OpenAI-style error object: invalid bodies 400 naming the field, the engine's refusals
    with their status (`ERROR_STATUS`; a 429 or 503 with Retry-After), unknown routes 404, anything else 500."""

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request", "type": ""}
        kind = first.get("type")
        if kind == "json_invalid" or (tuple(first.get("loc", ())) == ("body",) and kind != LONE_SURROGATE):
            return error_response(400, f"the request body is not a valid JSON object ({first['msg']})",
                                  "invalid_request_error", None, "invalid_json")
        if kind == LONE_SURROGATE:
            return error_response(400, first["msg"], "invalid_request_error", first["ctx"]["path"], "invalid_value")
        param = field_path(first.get("loc", ()))
        message = f"{param}: {first['msg']}" if param else f"invalid request: {first['msg']}"
        return error_response(400, message, "invalid_request_error", param, "invalid_value")

    @app.exception_handler(RequestError)
    async def refused(request: Request, exc: RequestError):
        status, kind = ERROR_STATUS[exc.kind]
        response = error_response(status, exc.message, kind, exc.param, exc.code)
        if status in (429, 503):
            response.headers["Retry-After"] = str(RETRY_AFTER_S)
        return response

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        code = HTTP_ERROR_CODES.get(exc.status_code)
        message = str(exc.detail)
        if exc.status_code == 400:  # FastAPI's: a body json could not read past its decoder (not UTF-8, too deep)
            message = f"the request body is not a valid JSON object ({unreadable_body(exc.__cause__)})"
        response = error_response(exc.status_code, message, kind, None, code)
        response.headers.update(exc.headers or {})  # e.g. a 405's Allow
        return response

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception):
        return error_response(500, f"internal error: {type(exc).__name__}", "server_error", None, "internal")


#: the error code of each status the HTTP layer answers by itself (a 400: a body FastAPI could not parse)
HTTP_ERROR_CODES = {400: "invalid_json", 408: "request_timeout", 413: "request_too_large"}


def unreadable_body(cause: BaseException | None) -> str:
    """Why a request body could not be parsed as JSON, in words (``cause``: what the parser raised)."""
    if isinstance(cause, UnicodeDecodeError):
        return "it is not UTF-8 text"
    if isinstance(cause, RecursionError):
        return "it is nested too deeply"
    return "it could not be parsed"


class RequestCount:
    """Count every response in ``requests`` by route (its path template, whether or not the request reached it;
    "unmatched" for unknown paths) and status, whatever answered it: a route, an error handler, the API key's
    check, the body limit, or a crash (500). A plain ASGI wrapper of ``send``: streams pass through untouched."""

    def __init__(self, app, requests, routes) -> None:
        self.app, self.requests, self.routes = app, requests, routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = None

        async def counted(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except Exception:
            self.requests.labels(self._route(scope), str(status or 500)).inc()
            raise
        self.requests.labels(self._route(scope), str(status or 500)).inc()

    def _route(self, scope) -> str:
        route = scope.get("route")
        if route is None:
            route = next((r for r in self.routes if r.matches(scope)[0] == Match.FULL), None)
        return getattr(route, "path", None) or "unmatched"


class BodyLimit:
    """Refuse a request body past ``limit`` bytes with 413 before it is read whole: at once by its Content-Length,
    else as it arrives (a chunked body is cut off at the limit). A body that has not arrived whole ``read_timeout_s``
    seconds after the request's headers is answered 408, and the connection closed (a slow client holds no
    connection open for longer)."""

    def __init__(self, app, limit: int, read_timeout_s: float | None = None) -> None:
        self.app, self.limit, self.read_timeout_s = app, limit, read_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(scope, receive, send)
        received, whole = 0, False
        deadline = None if self.read_timeout_s is None else time.monotonic() + self.read_timeout_s

        async def limited():
            nonlocal received, whole
            if whole or deadline is None:  # the body is in (later messages: the client going away)
                message = await receive()
            else:
                try:
                    message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    raise StarletteHTTPException(408, self._too_slow(), headers={"Connection": "close"}) from None
            whole = whole or message["type"] != "http.request" or not message.get("more_body", False)
            received += len(message.get("body", b""))
            if received > self.limit:
                raise StarletteHTTPException(413, self._message())
            return message

        return await self.app(scope, limited, send)

    def _too_slow(self) -> str:
        return (f"the request body did not arrive whole within {self.read_timeout_s:g} seconds (--read-timeout); "
                "the connection is closed")

    def _message(self) -> str:
        return (f"the request body is larger than this server takes ({self.limit} bytes); send a shorter "
                "conversation, or start the server with a larger --max-body-bytes")

    async def _refuse(self, scope, receive, send):
        response = error_response(413, self._message(), "invalid_request_error", None, "request_too_large")
        await response(scope, receive, send)


def install_api_key(app: FastAPI, engine: Engine) -> None:
    """With ``config.api_key`` set, every route needs ``Authorization: Bearer <key>`` with one of its keys — but the
    probes (`PROBE_PATHS`) when ``config.open_probes``. A request that carried a valid key is marked in its scope
    (`keyed`), so an open probe can tell a tenant from a stranger."""
    keys = engine.config.api_key
    if not keys:
        return
    expected = [f"Bearer {key}".encode() for key in keys]
    open_paths = PROBE_PATHS if engine.config.open_probes else ()

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        given = request.headers.get("authorization", "").encode()
        matches = [hmac.compare_digest(given, key) for key in expected]  # every key compared: no timing by position
        if any(matches):
            request.scope[KEYED_SCOPE] = True
            return await call_next(request)
        if request.url.path in open_paths:
            return await call_next(request)
        return error_response(401, "a valid API key is needed: send the header 'Authorization: Bearer <key>' with "
                              "the key the server was started with (--api-key)", "invalid_request_error", None,
                              "invalid_api_key")


def keyed(request: Request) -> bool:
    """Whether ``request`` may see what the server's tenants share: it carried a valid API key, or the server has
    none."""
    return not request.app.state.engine.config.api_key or bool(request.scope.get(KEYED_SCOPE))
