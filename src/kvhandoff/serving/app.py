"""The HTTP routes (FastAPI): OpenAI's chat and text completions (JSON or server-sent events) with function calling
and structured output, the model list, vLLM's tokenizer routes, version, health and Prometheus metrics.

`ROUTES` is the flat table of them; each handler is a module-level function that reads the engine from
``request.app.state`` and is callable on its own. Handlers parse (`parse.py`) and answer (`respond.py`); every
decision about caches and decoding is the engine's (`engine.py`); errors, limits and keys are `middleware.py`'s.
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

import kvhandoff
from kvhandoff.serving import prompts
from kvhandoff.serving.engine import Engine
from kvhandoff.serving.middleware import (
    BodyLimit,
    RequestCount,
    documented,
    generation_responses,
    install_api_key,
    install_error_handlers,
    keyed,
    openapi_of,
)
from kvhandoff.serving.parse import (
    CACHE_ID_HEADER,
    UnknownFieldLog,
    chat_request,
    completion_request,
    session_of,
    tenant_of,
    tokenize_request,
)
from kvhandoff.serving.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from kvhandoff.serving.respond import respond_chat, respond_completion, until_gone
from kvhandoff.serving.response_models import (
    ChatCompletion,
    Completion,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
    dump,
)


def engine_of(request: Request) -> Engine:
    return request.app.state.engine


def card(engine: Engine, name: str) -> ModelCard:
    return ModelCard(id=name, created=engine.created, max_model_len=engine.max_context)


async def health(request: Request):
    # (no docstring: it would become the OpenAPI document's description of the route)
    # `Engine.health`; a caller without a key on a keyed server with open probes gets `Engine.liveness` only (no
    # figure of what the tenants' caches hold). HEAD: the same status, without the body.
    engine = engine_of(request)
    return JSONResponse(engine.health() if keyed(request) else engine.liveness(),
                        status_code=503 if engine.draining else 200)


async def metrics(request: Request):
    body, content_type = engine_of(request).metrics.render()
    return Response(body, media_type=content_type)


async def version():
    return {"version": kvhandoff.__version__}


async def models(request: Request):
    engine = engine_of(request)
    return dump(ModelList(data=[card(engine, name) for name in engine.model_names()]))


async def model(model_id: str, request: Request):
    engine = engine_of(request)
    engine.hosted(model_id)
    return dump(card(engine, model_id))


async def tokenize(body: TokenizeRequest, request: Request):
    engine = engine_of(request)
    request.app.state.ignored.note(body)
    tokens = await asyncio.to_thread(tokenize_request, engine, body)
    return dump(TokenizeResponse(count=len(tokens), max_model_len=engine.max_context, tokens=tokens))


async def detokenize(body: DetokenizeRequest, request: Request):
    return dump(DetokenizeResponse(prompt=prompts.detokenize(engine_of(request).hosted(body.model), body.tokens)))


async def chat_completions(body: ChatCompletionRequest, request: Request):
    engine = engine_of(request)
    request.app.state.ignored.note(body)
    generation_request, tools = await asyncio.to_thread(  # tools and grammars are checked off the event loop
        chat_request, body, session_of(request, body), tenant_of(request, body, bool(engine.config.api_key)),
        engine.generation_defaults(body.model))
    return await until_gone(request, respond_chat(engine, generation_request, tools, body,
                                                  request.headers.get(CACHE_ID_HEADER)))


async def completions(body: CompletionRequest, request: Request):
    engine = engine_of(request)
    request.app.state.ignored.note(body)
    generation_request = completion_request(body, session_of(request, body),
                                            tenant_of(request, body, bool(engine.config.api_key)),
                                            engine.generation_defaults(body.model))
    return await until_gone(request, respond_completion(engine, generation_request, body,
                                                        request.headers.get(CACHE_ID_HEADER)))


@dataclass(frozen=True)
class Route:
    """One route: its method and path, its handler, and what the OpenAPI document says of it."""

    method: str
    path: str
    handler: Any
    responses: dict | None = None
    response_class: type | None = None
    include_in_schema: bool = True


#: /health's body: `Engine.liveness` (a caller without a key on a keyed server with open probes), else `Engine.health`
HEALTH = {"type": "object", "required": ["status", "models", "running", "cancelling"], "properties": {
    "status": {"enum": ["ok", "draining"]}, "running": {"type": "integer"}, "cancelling": {"type": "integer"},
    "models": {"type": "object", "additionalProperties": {"type": "object", "required": ["queued"],
                                                          "properties": {"queued": {"type": "integer"}}}}}}
#: the links between routes (schemathesis' stateful phase follows them): a listed model looked up by its id, and
#: the ids /tokenize answers read back by /detokenize with the same model
MODEL_LINK = {"listed": {"operationRef": "#/paths/~1v1~1models~1{model_id}/get",
                         "parameters": {"model_id": "$response.body#/data/0/id"},
                         "description": "the first listed model"}}
DETOKENIZE_LINK = {"detokenize": {"operationRef": "#/paths/~1detokenize/post",
                                  "requestBody": {"model": "$request.body#/model", "tokens": "$response.body#/tokens"},
                                  "description": "the ids read back as text by the same model"}}


def answers(model, **more) -> dict:
    """The OpenAPI response of a 200 whose JSON body is ``model`` (a pydantic model, or a JSON schema)."""
    if isinstance(model, dict):
        return {200: {"content": {"application/json": {"schema": model}}, **more}}
    return {200: {"model": model, **more}}


#: every route the server answers, in the order the OpenAPI document lists them
ROUTES = (
    Route("GET", "/health", health, {**answers(HEALTH), 503: {
        "description": "the server is draining (shutting down)", "content": {"application/json": {"schema": HEALTH}}}}),
    Route("HEAD", "/health", health, include_in_schema=False),  # a balancer's probe; the document keeps GET's
    Route("GET", "/metrics", metrics, response_class=PlainTextResponse),
    Route("GET", "/version", version, answers({"type": "object", "required": ["version"],
                                               "properties": {"version": {"type": "string"}}})),
    Route("GET", "/v1/models", models, answers(ModelList, links=MODEL_LINK)),
    Route("GET", "/v1/models/{model_id:path}", model, {**answers(ModelCard), **documented(404)}),
    Route("POST", "/tokenize", tokenize, {**answers(TokenizeResponse, links=DETOKENIZE_LINK),
                                          **documented(400, 404, 408, 413)}),
    Route("POST", "/detokenize", detokenize, {**answers(DetokenizeResponse), **documented(400, 404, 408, 413)}),
    Route("POST", "/v1/chat/completions", chat_completions, generation_responses(ChatCompletion)),
    Route("POST", "/v1/completions", completions, generation_responses(Completion)),
)


def create_app(engine: Engine) -> FastAPI:
    """The FastAPI application serving ``engine``: the routes of `ROUTES`, behind the error handlers, the API key,
    the body limit and the request counter."""
    app = FastAPI(title="kvhandoff", version=kvhandoff.__version__)
    app.openapi = functools.partial(openapi_of, app)
    app.state.engine = engine
    app.state.ignored = UnknownFieldLog()
    install_error_handlers(app)
    install_api_key(app, engine)
    app.add_middleware(BodyLimit, limit=engine.config.max_body_bytes, read_timeout_s=engine.config.read_timeout_s)
    app.add_middleware(RequestCount, requests=engine.metrics.requests, routes=app.router.routes)  # outermost
    for route in ROUTES:
        options = {} if route.response_class is None else {"response_class": route.response_class}
        app.add_api_route(route.path, route.handler, methods=[route.method], responses=route.responses,
                          include_in_schema=route.include_in_schema, **options)
    return app
