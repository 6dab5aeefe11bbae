"""The HTTP routes (FastAPI): OpenAI's chat and text completions (JSON or server-sent events), the model list,
health and Prometheus metrics. Routes only: every decision is the engine's (`engine.py`)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import kvhandoff
from kvhandoff.serving.engine import Engine, Generation, GenerationRequest, RequestError
from kvhandoff.serving.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionChoice,
    CompletionRequest,
    Delta,
    ErrorBody,
    ErrorResponse,
    GuardInfo,
    HandoffInfo,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    SamplingRequest,
    Usage,
    dump,
)

#: HTTP status and OpenAI error type of each `engine.ERROR_KINDS`
ERROR_STATUS = {
    "invalid_request": (400, "invalid_request_error"),
    "not_found": (404, "not_found_error"),
    "too_long": (413, "invalid_request_error"),
    "too_many_sessions": (429, "rate_limit_error"),
    "overloaded": (503, "server_error"),
    "cancelled": (499, "invalid_request_error"),
    "internal": (500, "server_error"),
}
#: header naming the session (before the body's prompt_cache_key and user)
SESSION_HEADER = "X-Session-ID"
#: response header saying what happened to the cache: applied | fallback | reprefill | none
HANDOFF_HEADER = "X-KV-Handoff"
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict"}


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


def session_of(header: str | None, body: SamplingRequest) -> str | None:
    """The session a request belongs to: header X-Session-ID, else the body's prompt_cache_key, else its user
    (None: stateless)."""
    return header or body.prompt_cache_key or body.user or None


def handoff_info(generation: Generation) -> HandoffInfo:
    report = generation.report
    guard = GuardInfo(**report.guard) if report.guard else None
    return HandoffInfo(status=report.status, from_=report.source, to=report.target, mapped_tokens=report.mapped_tokens,
                       read_tokens=report.read_tokens, guard=guard, milliseconds=report.milliseconds)


def usage_of(generation: Generation) -> Usage:
    prompt, answer = generation.prompt_tokens, generation.completion_tokens
    return Usage(prompt_tokens=prompt, completion_tokens=answer, total_tokens=prompt + answer,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=generation.report.cached_tokens))


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def install_error_handlers(app: FastAPI, requests) -> None:
    """Every failure as an OpenAI-style error object: invalid bodies 400 naming the field, the engine's refusals
    with their status (`ERROR_STATUS`), unknown routes 404, anything else 500 — counted in ``requests``."""

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request", "type": ""}
        requests.labels(request.url.path, "400").inc()
        if first.get("type") == "json_invalid" or tuple(first.get("loc", ())) == ("body",):
            return error_response(400, f"the request body is not a valid JSON object ({first['msg']})",
                                  "invalid_request_error", None, "invalid_json")
        param = field_path(first.get("loc", ()))
        message = f"{param}: {first['msg']}" if param else f"invalid request: {first['msg']}"
        return error_response(400, message, "invalid_request_error", param, "invalid_value")

    @app.exception_handler(RequestError)
    async def refused(request: Request, exc: RequestError):
        status, kind = ERROR_STATUS[exc.kind]
        requests.labels(request.url.path, str(status)).inc()
        return error_response(status, exc.message, kind, exc.param, exc.code)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), kind)

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception):
        return error_response(500, f"internal error: {type(exc).__name__}", "server_error", None, "internal")


async def respond(engine: Engine, request: GenerationRequest, body: SamplingRequest, chat: bool):
    """Run ``request`` on ``engine`` and answer it: a JSON completion, or with ``body.stream`` server-sent events;
    the handoff status and session in the headers either way."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    requests = engine.metrics.requests
    generation = await engine.start(request)
    headers = {HANDOFF_HEADER: generation.report.status}
    if request.session_id:
        headers[SESSION_HEADER] = request.session_id
    ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    if body.stream:
        requests.labels(path, "200").inc()
        return StreamingResponse(stream_events(generation, request, body, chat, ident, created),
                                 media_type="text/event-stream", headers=headers)
    try:
        text = await generation.text()
    except asyncio.CancelledError:
        generation.cancel()
        raise
    usage, info = usage_of(generation), handoff_info(generation)
    if chat:
        choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=generation.finish_reason)
        result = ChatCompletion(id=ident, created=created, model=request.model, choices=[choice], usage=usage,
                                kv_handoff=info)
    else:
        choice = CompletionChoice(text=text, finish_reason=generation.finish_reason)
        result = Completion(id=ident, created=created, model=request.model, choices=[choice], usage=usage,
                            kv_handoff=info)
    requests.labels(path, "200").inc()
    return JSONResponse(dump(result), headers=headers)


async def stream_events(generation: Generation, request: GenerationRequest, body: SamplingRequest, chat: bool,
                        ident: str, created: int):
    """The answer as OpenAI chunks (the handoff report in the first), optionally a usage chunk, then [DONE]; an
    error mid-stream as an error object. A client that goes away cancels the generation."""
    info = handoff_info(generation)

    def chunk(content: str | None, finish: str | None = None, first: bool = False) -> str:
        if chat:
            delta = Delta(role="assistant", content="") if first else Delta(content=content)
            return sse(dump(ChatCompletionChunk(
                id=ident, created=created, model=request.model, kv_handoff=info if first else None,
                choices=[ChatChunkChoice(delta=delta, finish_reason=finish)])))
        return sse(dump(Completion(id=ident, created=created, model=request.model,
                                   kv_handoff=info if first else None,
                                   choices=[CompletionChoice(text=content or "", finish_reason=finish)])))

    try:
        if chat:
            yield chunk(None, first=True)
        first = not chat
        async for piece in generation.deltas():
            yield chunk(piece, first=first)
            first = False
        yield chunk(None if chat else "", generation.finish_reason, first=first)
        if body.include_usage():
            kind = ChatCompletionChunk if chat else Completion
            yield sse(dump(kind(id=ident, created=created, model=request.model, choices=[],
                                usage=usage_of(generation))))
        yield sse("[DONE]")
    except RequestError as exc:
        kind = ERROR_STATUS[exc.kind][1]
        yield sse(dump(ErrorResponse(error=ErrorBody(message=exc.message, type=kind, param=exc.param,
                                                     code=exc.code))))
        yield sse("[DONE]")
    finally:
        generation.cancel()  # a no-op once the answer is complete; otherwise the client went away


def create_app(engine: Engine) -> FastAPI:
    """The FastAPI application serving ``engine`` (routes: POST /v1/chat/completions, POST /v1/completions,
    GET /v1/models, GET /health, GET /metrics)."""
    app = FastAPI(title="kvhandoff", version=kvhandoff.__version__)
    app.state.engine = engine
    install_error_handlers(app, engine.metrics.requests)

    @app.get("/health")
    async def health():
        return engine.health()

    @app.get("/metrics")
    async def metrics():
        body, content_type = engine.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models():
        return dump(ModelList(data=[ModelCard(id=name, created=engine.created) for name in engine.model_names()]))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest,
                               x_session_id: str | None = Header(default=None, alias=SESSION_HEADER)):
        request = GenerationRequest(
            model=body.model, messages=tuple((m.template_role(), m.text()) for m in body.messages),
            max_tokens=body.answer_limit(), temperature=body.temperature, top_p=body.top_p, seed=body.seed,
            stop=body.stop_strings(), session_id=session_of(x_session_id, body), handoff_mode=body.handoff_mode(),
        )
        return await respond(engine, request, body, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest,
                          x_session_id: str | None = Header(default=None, alias=SESSION_HEADER)):
        prompt = body.prompt if isinstance(body.prompt, str) else tuple(body.prompt)
        request = GenerationRequest(
            model=body.model, prompt=prompt, max_tokens=body.answer_limit(), temperature=body.temperature,
            top_p=body.top_p, seed=body.seed, stop=body.stop_strings(), session_id=session_of(x_session_id, body),
            handoff_mode=body.handoff_mode(),
        )
        return await respond(engine, request, body, chat=False)

    return app
