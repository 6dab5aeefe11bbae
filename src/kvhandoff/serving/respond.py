"""Answering a request: a `Generation` becomes an OpenAI-shaped JSON body or a stream of server-sent events, with
the handoff's report (`kv_handoff`), usage and the router headers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvhandoff.serving.engine import Engine
from kvhandoff.serving.middleware import ERROR_STATUS
from kvhandoff.serving.parse import CACHE_ID_HEADER, SESSION_HEADER
from kvhandoff.serving.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from kvhandoff.serving.requests import Choice, Generation, GenerationRequest, RequestError, TokenEntry
from kvhandoff.serving.response_models import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    Delta,
    ErrorBody,
    ErrorResponse,
    FunctionCallDelta,
    FunctionCallOut,
    GuardInfo,
    HandoffInfo,
    PromptTokensDetails,
    TokenLogprob,
    ToolCallDelta,
    ToolCallOut,
    TopLogprob,
    Usage,
    dump,
)
from kvhandoff.serving.tools import ContentDelta, ToolSettings, validate_arguments
from kvhandoff.serving.tools import ToolCallDelta as ParsedCallDelta

logger = logging.getLogger(__name__)

#: response header saying what happened to the cache: applied | escalated | fallback | reprefill | none
HANDOFF_HEADER = "X-KV-Handoff"
#: response header saying how the cached positions were found: prefix | offset | none
REUSE_HEADER = "X-KV-Reuse"
#: the router vocabulary (vLLM semantic-router): whether a KV transfer served the request, the mapper that did it
#: (its manifest checksum); the conversation cache it went into is `parse.CACHE_ID_HEADER`
TRANSFER_STATUS_HEADER = "x-vsr-kv-transfer-status"
MAPPER_ID_HEADER = "x-vsr-kv-mapper-id"
#: the router status of each handoff status: "unsupported" where no transfer took part (no switch)
TRANSFER_STATUS = {"applied": "applied", "escalated": "applied", "fallback": "fallback_reprefill",
                   "reprefill": "fallback_reprefill", "none": "unsupported"}


def handoff_info(generation: Generation) -> HandoffInfo:
    report = generation.report
    guard = GuardInfo(**report.guard) if report.guard else None
    return HandoffInfo(status=report.status, from_=report.source, to=report.target, mapped_tokens=report.mapped_tokens,
                       read_tokens=report.read_tokens, approximate_tokens=report.approximate_tokens, guard=guard,
                       milliseconds=report.milliseconds, reuse=report.reuse)


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
    headers = {HANDOFF_HEADER: report.status, TRANSFER_STATUS_HEADER: TRANSFER_STATUS[report.status],
               REUSE_HEADER: report.reuse}
    if report.source is not None and report.status != "reprefill":  # a mapper ran
        headers[MAPPER_ID_HEADER] = engine.mapper_id(report.source, report.target)
    if router_cache or generation.cache_id is not None:
        headers[CACHE_ID_HEADER] = router_cache or generation.cache_id
    if request.session_id:
        headers[SESSION_HEADER] = request.session_id
    return headers


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


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
    else the JSON of ``whole(generation, choices, ident, created)``, built and written off the event loop (an
    answer with log-probs may be megabytes); the handoff status, the router vocabulary and the session in the
    headers either way."""
    generation = await engine.start(request)
    headers = headers_of(engine, request, generation, router_cache)
    ident, created = f"{prefix}-{uuid.uuid4().hex}", int(time.time())
    if body.streams():
        return StreamingResponse(stream(generation, ident, created), media_type="text/event-stream",
                                 headers=headers)
    choices = await complete(generation)
    return await asyncio.to_thread(
        lambda: JSONResponse(dump(whole(generation, choices, ident, created)), headers=headers))


async def until_gone(request: Request, answer):
    """Await ``answer`` (a coroutine: a request's `respond`) while watching the client's connection: when the client
    goes away first, the answer is cancelled — its generation stops at its next token (`Generation.cancel`, counted
    in kvhandoff_cancelled_total) — and the request ends with 499. A streamed answer is watched until its response
    starts; the stream then notices a client that goes away itself (`framed`)."""
    task = asyncio.ensure_future(answer)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()  # the client went away: `engine.start` and `complete` cancel the generation
        with contextlib.suppress(asyncio.CancelledError, RequestError):
            await task
        raise RequestError("cancelled", "the client went away before the answer was finished")
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


async def _disconnect(request: Request) -> None:
    """Return when the client goes away (ASGI ``http.disconnect``; the body has been read). A receive channel that
    refuses further reads cannot be watched: then this never returns (the answer decides)."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:
        await asyncio.Event().wait()  # never set


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
