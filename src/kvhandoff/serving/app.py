"""The HTTP routes (FastAPI): OpenAI's chat and text completions (JSON or server-sent events) with function calling
and structured output, the model list, vLLM's tokenizer routes, version, health and Prometheus metrics. Routes
parse and answer; every decision about caches and decoding is the engine's (`engine.py`)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import threading
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

import kvhandoff
from kvhandoff.errors import ConfigError
from kvhandoff.serving.decoding import SamplingParams
from kvhandoff.serving.engine import Engine
from kvhandoff.serving.grammar import GrammarSpec, JsonObject, JsonSchema, ToolCalls
from kvhandoff.serving.prefix_tree import DEFAULT_NAMESPACE, namespace_of
from kvhandoff.serving.prompts import surely_longer, too_long
from kvhandoff.serving.protocol import (
    LONE_SURROGATE,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    Delta,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorBody,
    ErrorResponse,
    FunctionCallDelta,
    FunctionCallOut,
    GuardInfo,
    HandoffInfo,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    SamplingRequest,
    TokenizeRequest,
    TokenizeResponse,
    TokenLogprob,
    ToolCallDelta,
    ToolCallOut,
    TopLogprob,
    Usage,
    dump,
    session_key_problem,
    unknown_fields,
)
from kvhandoff.serving.requests import Choice, Generation, GenerationRequest, RequestError, TokenEntry
from kvhandoff.serving.tools import ContentDelta, ToolSettings, parse_tools, validate_arguments
from kvhandoff.serving.tools import ToolCallDelta as ParsedCallDelta

logger = logging.getLogger(__name__)

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
#: headers naming the session, in the order they are read (before the body's prompt_cache_key)
SESSION_HEADER = "X-Session-ID"
LITELLM_SESSION_HEADER = "x-litellm-session-id"
#: response header saying what happened to the cache: applied | escalated | fallback | reprefill | none
HANDOFF_HEADER = "X-KV-Handoff"
#: the router vocabulary (vLLM semantic-router): whether a KV transfer served the request, the mapper that did it
#: (its manifest checksum), and the conversation cache it went into
TRANSFER_STATUS_HEADER = "x-vsr-kv-transfer-status"
MAPPER_ID_HEADER = "x-vsr-kv-mapper-id"
CACHE_ID_HEADER = "x-vsr-kv-cache-id"
#: the router status of each handoff status: "unsupported" where no transfer took part (no switch)
TRANSFER_STATUS = {"applied": "applied", "escalated": "applied", "fallback": "fallback_reprefill",
                   "reprefill": "fallback_reprefill", "none": "unsupported"}
#: seconds a client is told to wait before retrying a 429 or 503 (Retry-After)
RETRY_AFTER_S = 1
#: routes that answer without the API key when the server opens its probes
PROBE_PATHS = ("/health", "/metrics")
#: ignored field names logged at most (each once; later ones are not), and the characters of a name shown
MAX_LOGGED_FIELDS = 100
MAX_LOGGED_NAME_CHARS = 64
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict"}


#: what each error status of the API means (the OpenAPI document's responses; every body an `ErrorResponse`)
ERROR_MEANINGS = {
    400: "an invalid request: a body that is not JSON, a field that is invalid or unsupported (named in `param`), "
         "a prompt past the context window (code context_length_exceeded)",
    401: "no valid API key (the server was started with --api-key)",
    404: "no such model",
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


#: the completion routes: a JSON body, or server-sent events with ``stream``; and every error they may answer
GENERATION_RESPONSES = {200: {"content": {"text/event-stream": {"schema": {
                                  "type": "object", "required": ["data"], "properties": {"data": {
                                      "type": "string", "description": "a JSON chunk, an error object, or [DONE]"}}}}},
                              "description": "the answer: JSON, or server-sent events with stream"},
                        **documented(400, 401, 404, 413, 429, 500, 503)}


def openapi_of(app: FastAPI) -> dict:
    """``app``'s OpenAPI document without FastAPI's 422: an invalid body is a 400 here (`install_error_handlers`)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for operations in schema["paths"].values():
            for operation in operations.values():
                operation["responses"].pop("422", None)
        app.openapi_schema = schema
    return app.openapi_schema


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


def session_of(request: Request, body: SamplingRequest) -> str | None:
    """The session a request belongs to: header X-Session-ID, else x-litellm-session-id, else the cache a router
    names (x-vsr-kv-cache-id), else the body's prompt_cache_key (None: the conversation is found by its tokens in
    the prefix cache). A session key is looked up within the request's tenant (`tenant_of`) only; a header key is
    checked as prompt_cache_key is (`protocol.session_key_problem`: it is echoed)."""
    for name in (SESSION_HEADER, LITELLM_SESSION_HEADER, CACHE_ID_HEADER):
        key = request.headers.get(name)
        if key:
            problem = session_key_problem(key, f"the header {name}")
            if problem is not None:
                raise RequestError("invalid_request", problem, param=name)
            return key
    return body.prompt_cache_key or None


def tenant_of(request: Request, body: SamplingRequest, keyed: bool) -> str:
    """The namespace whose caches and sessions may serve a request (`prefix_tree.namespace_of`): its API key
    (``keyed``: the server checks keys, so the Bearer token is one of them), its ``user`` and its ``cache_salt``,
    joined."""
    api_key = request.headers.get("authorization", "").removeprefix("Bearer ") if keyed else None
    return namespace_of(api_key, body.user, body.cache_salt)


@contextlib.contextmanager
def refused_as(param: str | None):
    """A `ConfigError` raised while parsing a request field becomes a 400 naming ``param`` (None: the field its
    message begins with, as in ``tools[1].function.name: ...``)."""
    try:
        yield
    except ConfigError as exc:
        message = str(exc)
        if param is None:
            head = message.split(":", 1)[0]
            param = head if head and " " not in head else None
        raise RequestError("invalid_request", message, param=param) from exc


class UnknownFieldLog:
    """Names each request field the server ignores once in its log: the first `MAX_LOGGED_FIELDS` names, each cut to
    `MAX_LOGGED_NAME_CHARS` characters (a client inventing names cannot fill the memory or the log)."""

    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def note(self, body: SamplingRequest) -> None:
        for name in unknown_fields(body):
            name = name[:MAX_LOGGED_NAME_CHARS]
            with self._lock:
                if name in self._seen or len(self._seen) > MAX_LOGGED_FIELDS:
                    continue
                self._seen.add(name)
                full = len(self._seen) > MAX_LOGGED_FIELDS
            if full:
                logger.warning("requests carry more than %d fields this server does not read; they are ignored, and "
                               "not logged any more", MAX_LOGGED_FIELDS)
                return
            logger.warning("requests carry the field %r, which this server does not read; it is ignored", name)


def tokenize_request(engine: Engine, body: TokenizeRequest) -> list[int]:
    """/tokenize's answer, its input bounded as a completion's is: tools checked as a chat request's (`parse_tools`),
    and a text surely past the context window refused (`prompts.surely_longer`: context_length_exceeded) before it
    is tokenized whole; a shorter one is counted exactly, even past the window."""
    with refused_as(None):
        parse_tools(body.tools)
    field = "prompt" if body.prompt is not None else "messages"
    text = body.prompt if body.prompt is not None else "\n".join(message.text() or "" for message in body.messages)
    if surely_longer(engine.hosted(body.model).tokenizer, text, engine.max_context, add_special_tokens=False):
        raise too_long(field, engine.max_context)
    messages = None if body.messages is None else [message.template_message() for message in body.messages]
    return engine.tokenize(body.model, body.prompt, messages, body.tools, body.add_generation_prompt,
                           body.add_special_tokens)


def sampling_of(body: SamplingRequest) -> SamplingParams:
    with refused_as(None):
        return SamplingParams(**body.sampling_fields())


def grammar_of(body: ChatCompletionRequest, tools: ToolSettings | None) -> GrammarSpec | None:
    """The constraint the answers follow: a forced tool call (tool_choice required or named), or the
    response_format's JSON."""
    response_format = body.response_format
    wants_json = response_format is not None and response_format.type != "text"
    if tools is not None and tools.choice.mode in ("required", "named"):
        if wants_json:
            raise RequestError("invalid_request", "response_format cannot be combined with a forced tool call "
                               f"(tool_choice {tools.choice.mode!r}); send one of them", param="response_format")
        with refused_as("tool_choice"):
            return ToolCalls(tuple((tool.name, tool.parameters) for tool in tools.tools), tools.choice.name,
                             tools.parallel_tool_calls)
    if not wants_json:
        return None
    with refused_as("response_format"):
        if response_format.type == "json_object":
            return JsonObject()
        spec = response_format.json_schema
        return JsonSchema(spec.schema_, spec.name, bool(spec.strict))


def chat_request(body: ChatCompletionRequest, session_id: str | None,
                 namespace: str = DEFAULT_NAMESPACE) -> tuple[GenerationRequest, ToolSettings]:
    with refused_as(None):
        tools = parse_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
    template_tools = tools.template_tools()
    request = GenerationRequest(
        model=body.model, messages=tuple(message.template_message() for message in body.messages),
        tools=tuple(template_tools) if template_tools else None, max_tokens=body.answer_limit(),
        sampling=sampling_of(body), stop=body.stop_strings(), grammar=grammar_of(body, tools), choices=body.choices(),
        logprobs=body.logprob_alternatives(), session_id=session_id, namespace=namespace,
        handoff_mode=body.handoff_mode())
    return request, tools


def completion_request(body: CompletionRequest, session_id: str | None,
                       namespace: str = DEFAULT_NAMESPACE) -> GenerationRequest:
    prompt = body.prompt if isinstance(body.prompt, str) else tuple(body.prompt)
    return GenerationRequest(
        model=body.model, prompt=prompt, max_tokens=body.answer_limit(), sampling=sampling_of(body),
        stop=body.stop_strings(), choices=body.choices(), logprobs=body.logprob_alternatives(),
        echo=bool(body.echo), session_id=session_id, namespace=namespace, handoff_mode=body.handoff_mode())


def handoff_info(generation: Generation) -> HandoffInfo:
    report = generation.report
    guard = GuardInfo(**report.guard) if report.guard else None
    return HandoffInfo(status=report.status, from_=report.source, to=report.target, mapped_tokens=report.mapped_tokens,
                       read_tokens=report.read_tokens, approximate_tokens=report.approximate_tokens, guard=guard,
                       milliseconds=report.milliseconds)


def usage_of(generation: Generation) -> Usage:
    prompt, answer = generation.prompt_tokens, generation.completion_tokens
    return Usage(prompt_tokens=prompt, completion_tokens=answer, total_tokens=prompt + answer,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=generation.report.cached_tokens))


def chat_logprobs(entries: list[TokenEntry]) -> ChoiceLogprobs:
    return ChoiceLogprobs(content=[
        TokenLogprob(token=e.token, logprob=e.logprob, bytes=list(e.bytes),
                     top_logprobs=[TopLogprob(token=t, logprob=lp, bytes=list(b)) for t, lp, b in e.top])
        for e in entries])


def completion_logprobs(entries: list[TokenEntry], start: int = 0) -> CompletionLogprobs:
    """The legacy log-probs of ``entries``, their text offsets counted from ``start``."""
    offsets = []
    for entry in entries:
        offsets.append(start)
        start += len(entry.token)
    return CompletionLogprobs(tokens=[e.token for e in entries], token_logprobs=[e.logprob for e in entries],
                              top_logprobs=[{t: lp for t, lp, _ in e.top} if e.logprob is not None else None
                                            for e in entries],
                              text_offset=offsets)


def headers_of(engine: Engine, request: GenerationRequest, generation: Generation,
               router_cache: str | None = None) -> dict[str, str]:
    """What happened to the cache, in kvhandoff's header and the router vocabulary's (the cache id the router named,
    ``router_cache``, else the session's own), and the session."""
    report = generation.report
    headers = {HANDOFF_HEADER: report.status, TRANSFER_STATUS_HEADER: TRANSFER_STATUS[report.status]}
    if report.source is not None and report.status != "reprefill":  # a mapper ran
        headers[MAPPER_ID_HEADER] = engine.mapper_id(report.source, report.target)
    if router_cache or generation.cache_id is not None:
        headers[CACHE_ID_HEADER] = router_cache or generation.cache_id
    if request.session_id:
        headers[SESSION_HEADER] = request.session_id
    return headers


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


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
        code = "request_too_large" if exc.status_code == 413 else None
        response = error_response(exc.status_code, str(exc.detail), kind, None, code)
        response.headers.update(exc.headers or {})  # e.g. a 405's Allow
        return response

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception):
        return error_response(500, f"internal error: {type(exc).__name__}", "server_error", None, "internal")


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
    else as it arrives (a chunked body is cut off at the limit)."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(scope, receive, send)
        received = 0

        async def limited():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:
                raise StarletteHTTPException(413, self._message())
            return message

        return await self.app(scope, limited, send)

    def _message(self) -> str:
        return (f"the request body is larger than this server takes ({self.limit} bytes); send a shorter "
                "conversation, or start the server with a larger --max-body-bytes")

    async def _refuse(self, scope, receive, send):
        response = error_response(413, self._message(), "invalid_request_error", None, "request_too_large")
        await response(scope, receive, send)


def install_api_key(app: FastAPI, engine: Engine) -> None:
    """With ``config.api_key`` set, every route but the open probes needs ``Authorization: Bearer <key>`` with one
    of its keys."""
    keys = engine.config.api_key
    if not keys:
        return
    expected = [f"Bearer {key}".encode() for key in keys]
    open_paths = PROBE_PATHS if engine.config.open_probes else ()

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        given = request.headers.get("authorization", "").encode()
        matches = [hmac.compare_digest(given, key) for key in expected]  # every key compared: no timing by position
        if request.url.path in open_paths or any(matches):
            return await call_next(request)
        return error_response(401, "a valid API key is needed: send the header 'Authorization: Bearer <key>' with "
                              "the key the server was started with (--api-key)", "invalid_request_error", None,
                              "invalid_api_key")


async def complete(generation: Generation) -> list[Choice]:
    try:
        return await generation.complete()
    except asyncio.CancelledError:
        generation.cancel()
        raise


def chat_choice(choice: Choice, request: GenerationRequest, tools: ToolSettings, parser) -> ChatChoice:
    """An answer as OpenAI's chat choice: tool calls parsed out of its text by ``parser`` when the request has
    tools."""
    content, calls, finish = choice.text, None, choice.finish_reason
    if tools.parses_calls:
        parsed = parser.parse(choice.text)
        content = parsed.content
        if parsed.tool_calls:
            for call in parsed.tool_calls:
                problem = validate_arguments(call, tools.tools)
                if problem is not None:  # returned as the model wrote it
                    logger.info("a tool call of model %s does not fit its tool: %s", request.model, problem)
            calls = [ToolCallOut(id=call.id, function=FunctionCallOut(name=call.name, arguments=call.arguments))
                     for call in parsed.tool_calls]
            finish = "tool_calls" if finish == "stop" else finish
    logprobs = chat_logprobs(choice.logprobs) if request.logprobs is not None else None
    return ChatChoice(index=choice.index, message=AssistantMessage(content=content, tool_calls=calls),
                      finish_reason=finish, logprobs=logprobs)


async def respond(engine: Engine, request: GenerationRequest, body: SamplingRequest, prefix: str,
                  stream, whole, router_cache: str | None = None):
    """Run ``request`` and answer it: with ``body.stream`` the events of ``stream(generation, ident, created)``,
    else the JSON of ``whole(generation, choices, ident, created)``; the handoff status, the router vocabulary and
    the session in the headers either way."""
    generation = await engine.start(request)
    headers = headers_of(engine, request, generation, router_cache)
    ident, created = f"{prefix}-{uuid.uuid4().hex}", int(time.time())
    if body.streams():
        return StreamingResponse(stream(generation, ident, created), media_type="text/event-stream",
                                 headers=headers)
    result = whole(generation, await complete(generation), ident, created)
    return JSONResponse(dump(result), headers=headers)


async def respond_chat(engine: Engine, request: GenerationRequest, tools: ToolSettings, body: ChatCompletionRequest,
                       router_cache: str | None = None):
    parser = engine.tool_parser

    def whole(generation, choices, ident, created):
        return ChatCompletion(id=ident, created=created, model=request.model,
                              choices=[chat_choice(choice, request, tools, parser) for choice in choices],
                              usage=usage_of(generation), kv_handoff=handoff_info(generation))

    return await respond(engine, request, body, "chatcmpl",
                         lambda g, i, c: stream_chat(g, request, tools, parser, body, i, c), whole, router_cache)


def completion_choice(choice: Choice, request: GenerationRequest, generation: Generation) -> CompletionChoice:
    text, entries = choice.text, list(choice.logprobs)
    if generation.echo is not None:
        prompt_text, prompt_entries = generation.echo
        text, entries = prompt_text + text, prompt_entries + entries
    logprobs = completion_logprobs(entries) if request.logprobs is not None else None
    return CompletionChoice(index=choice.index, text=text, finish_reason=choice.finish_reason, logprobs=logprobs)


async def respond_completion(engine: Engine, request: GenerationRequest, body: CompletionRequest,
                             router_cache: str | None = None):
    def whole(generation, choices, ident, created):
        return Completion(id=ident, created=created, model=request.model,
                          choices=[completion_choice(choice, request, generation) for choice in choices],
                          usage=usage_of(generation), kv_handoff=handoff_info(generation))

    return await respond(engine, request, body, "cmpl",
                         lambda g, i, c: stream_completion(g, request, body, i, c), whole, router_cache)


def stream_error(exc: RequestError) -> str:
    kind = ERROR_STATUS[exc.kind][1]
    return sse(dump(ErrorResponse(error=ErrorBody(message=exc.message, type=kind, param=exc.param, code=exc.code))))


async def framed(generation: Generation, chunks, usage):
    """Server-sent events: ``chunks`` (an async generator of answer chunks), then ``usage`` (a usage chunk, built
    when the answers are done) when given, then [DONE]. An error mid-stream is an error object; a client that goes
    away cancels the generation."""
    try:
        async for piece in chunks:
            yield piece
        if usage is not None:
            yield sse(dump(usage(usage_of(generation))))
        yield sse("[DONE]")
    except RequestError as exc:
        yield stream_error(exc)
        yield sse("[DONE]")
    finally:
        generation.cancel()  # a no-op once the answers are complete; otherwise the client went away


def stream_chat(generation: Generation, request: GenerationRequest, tools: ToolSettings, parser,
                body: ChatCompletionRequest, ident: str, created: int):
    """The answers as OpenAI chunks: per choice a first chunk with the role (the very first one carries the handoff
    report), its content or tool-call deltas, its finish reason; optionally a usage chunk, then [DONE]."""
    info = handoff_info(generation)
    parsers = {}
    calls = {}  # choice → tool calls streamed

    def chunk(index: int, delta: Delta, finish: str | None = None, entries=None, first: bool = False) -> str:
        logprobs = chat_logprobs(entries) if request.logprobs is not None and entries else None
        return sse(dump(ChatCompletionChunk(
            id=ident, created=created, model=request.model, kv_handoff=info if first else None,
            choices=[ChatChunkChoice(index=index, delta=delta, finish_reason=finish, logprobs=logprobs)])))

    def pieces(index: int, events, entries) -> list[str]:
        out = []
        for event in events:
            if isinstance(event, ContentDelta):
                out.append(chunk(index, Delta(content=event.text), entries=entries))
            elif isinstance(event, ParsedCallDelta):
                calls[index] = calls.get(index, 0) + (event.id is not None)
                call = ToolCallDelta(index=event.index, id=event.id, type="function" if event.id else None,
                                     function=FunctionCallDelta(name=event.name, arguments=event.arguments))
                out.append(chunk(index, Delta(tool_calls=[call]), entries=entries))
            entries = None
        if entries:  # log-probs of text the parser holds back
            out.append(chunk(index, Delta(content=""), entries=entries))
        return out

    async def chunks():
        for index in range(request.choices):
            yield chunk(index, Delta(role="assistant", content=""), first=index == 0)
            parsers[index] = parser.stream() if tools.parses_calls else None
        async for choice, text, entries in generation.events():
            stream = parsers[choice.index]
            if text is not None:
                events = stream.feed(text) if stream is not None else [ContentDelta(text)]
                for piece in pieces(choice.index, events, entries):
                    yield piece
                continue
            for piece in pieces(choice.index, stream.finish() if stream is not None else [], entries):
                yield piece
            finish = choice.finish_reason
            if calls.get(choice.index) and finish == "stop":
                finish = "tool_calls"
            yield chunk(choice.index, Delta(), finish)

    def usage(totals: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=ident, created=created, model=request.model, choices=[], usage=totals)

    return framed(generation, chunks(), usage if body.include_usage() else None)


def stream_completion(generation: Generation, request: GenerationRequest, body: CompletionRequest, ident: str,
                      created: int):
    """The answers as text-completion chunks (the first carries the handoff report; an echoed prompt comes first in
    each choice), optionally a usage chunk, then [DONE]."""
    info = handoff_info(generation)
    first = True

    def chunk(index: int, text: str, finish: str | None = None, entries=None) -> str:
        nonlocal first
        logprobs = completion_logprobs(entries) if request.logprobs is not None and entries else None
        body_ = Completion(id=ident, created=created, model=request.model, kv_handoff=info if first else None,
                           choices=[CompletionChoice(index=index, text=text, finish_reason=finish, logprobs=logprobs)])
        first = False
        return sse(dump(body_))

    async def chunks():
        started = set()
        async for choice, text, entries in generation.events():
            if generation.echo is not None and choice.index not in started:
                yield chunk(choice.index, generation.echo[0], entries=generation.echo[1])
            started.add(choice.index)
            yield chunk(choice.index, text or "", None if text is not None else choice.finish_reason, entries)

    def usage(totals: Usage) -> Completion:
        return Completion(id=ident, created=created, model=request.model, choices=[], usage=totals)

    return framed(generation, chunks(), usage if body.include_usage() else None)


def create_app(engine: Engine) -> FastAPI:
    """The FastAPI application serving ``engine`` (routes: POST /v1/chat/completions, POST /v1/completions,
    GET /v1/models, GET /v1/models/{id}, POST /tokenize, POST /detokenize, GET /version, GET /health,
    GET /metrics)."""
    app = FastAPI(title="kvhandoff", version=kvhandoff.__version__)
    app.openapi = functools.partial(openapi_of, app)
    app.state.engine = engine
    install_error_handlers(app)
    install_api_key(app, engine)
    app.add_middleware(BodyLimit, limit=engine.config.max_body_bytes)
    app.add_middleware(RequestCount, requests=engine.metrics.requests, routes=app.router.routes)  # outermost
    ignored = UnknownFieldLog()

    def card(name: str) -> ModelCard:
        return ModelCard(id=name, created=engine.created, max_model_len=engine.max_context)

    @app.get("/health", responses={503: {"description": "the server is draining (shutting down)"}})
    async def health():
        return JSONResponse(engine.health(), status_code=503 if engine.draining else 200)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        body, content_type = engine.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/version")
    async def version():
        return {"version": kvhandoff.__version__}

    @app.get("/v1/models")
    async def models():
        return dump(ModelList(data=[card(name) for name in engine.model_names()]))

    @app.get("/v1/models/{model_id:path}", responses=documented(404))
    async def model(model_id: str):
        engine.hosted(model_id)
        return dump(card(model_id))

    @app.post("/tokenize", responses=documented(400, 404, 413))
    async def tokenize(body: TokenizeRequest):
        ignored.note(body)
        tokens = await asyncio.to_thread(tokenize_request, engine, body)
        return dump(TokenizeResponse(count=len(tokens), max_model_len=engine.max_context, tokens=tokens))

    @app.post("/detokenize", responses=documented(400, 404, 413))
    async def detokenize(body: DetokenizeRequest):
        return dump(DetokenizeResponse(prompt=engine.detokenize(body.model, body.tokens)))

    @app.post("/v1/chat/completions", responses=GENERATION_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        ignored.note(body)
        generation_request, tools = await asyncio.to_thread(  # tools and grammars are checked off the event loop
            chat_request, body, session_of(request, body), tenant_of(request, body, bool(engine.config.api_key)))
        return await respond_chat(engine, generation_request, tools, body, request.headers.get(CACHE_ID_HEADER))

    @app.post("/v1/completions", responses=GENERATION_RESPONSES)
    async def completions(body: CompletionRequest, request: Request):
        ignored.note(body)
        generation_request = completion_request(body, session_of(request, body),
                                                tenant_of(request, body, bool(engine.config.api_key)))
        return await respond_completion(engine, generation_request, body, request.headers.get(CACHE_ID_HEADER))

    return app
