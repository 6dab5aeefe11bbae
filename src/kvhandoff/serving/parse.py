"""Reading a request: the body and headers of a route become a `GenerationRequest` (its session, its tenant, its
sampling, its tools and grammar), checked before any work; ignored fields are noted in the log, boundedly."""

from __future__ import annotations

import contextlib
import logging
import threading

from fastapi import Request

from kvhandoff.errors import ConfigError
from kvhandoff.serving.decoding import GenerationDefaults, SamplingParams
from kvhandoff.serving.engine import Engine
from kvhandoff.serving.grammar import GrammarSpec, JsonObject, JsonSchema, ToolCalls
from kvhandoff.serving.prefix_tree import DEFAULT_NAMESPACE, namespace_of
from kvhandoff.serving.prompts import surely_longer, tokenize, too_long
from kvhandoff.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
    TokenizeRequest,
    session_key_problem,
    unknown_fields,
)
from kvhandoff.serving.requests import GenerationRequest, RequestError
from kvhandoff.serving.tools import ToolSettings, parse_tools

logger = logging.getLogger(__name__)

#: headers naming the session, in the order they are read (before the body's prompt_cache_key)
SESSION_HEADER = "X-Session-ID"
LITELLM_SESSION_HEADER = "x-litellm-session-id"
#: the conversation cache a router names (vLLM semantic-router), echoed on the response
CACHE_ID_HEADER = "x-vsr-kv-cache-id"
#: ignored field names logged at most (each once; later ones are not), and the characters of a name shown
MAX_LOGGED_FIELDS = 100
MAX_LOGGED_NAME_CHARS = 64


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
    hosted = engine.hosted(body.model)
    if surely_longer(hosted.tokenizer, text, engine.max_context, add_special_tokens=False):
        raise too_long(field, engine.max_context)
    messages = None if body.messages is None else [message.template_message() for message in body.messages]
    return tokenize(hosted, engine.chat_template, body.prompt, messages, body.tools, body.add_generation_prompt,
                    body.add_special_tokens)


def sampling_of(body: SamplingRequest, defaults: GenerationDefaults | None = None) -> SamplingParams:
    """The request's sampling settings: the fields it gives, else ``defaults``' (the model's generation config's,
    `Engine.generation_defaults`), else `SamplingParams`' own."""
    with refused_as(None):
        return SamplingParams(**{**(defaults.sampling if defaults else {}), **body.sampling_fields()})


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


def chat_request(body: ChatCompletionRequest, session_id: str | None, namespace: str = DEFAULT_NAMESPACE,
                 defaults: GenerationDefaults | None = None) -> tuple[GenerationRequest, ToolSettings]:
    with refused_as(None):
        tools = parse_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
    template_tools = tools.template_tools()
    request = GenerationRequest(
        model=body.model, messages=tuple(message.template_message() for message in body.messages),
        tools=tuple(template_tools) if template_tools else None, max_tokens=body.answer_limit(),
        sampling=sampling_of(body, defaults), stop=body.stop_strings(), grammar=grammar_of(body, tools),
        choices=body.choices(), logprobs=body.logprob_alternatives(), session_id=session_id, namespace=namespace,
        handoff_mode=body.handoff_mode())
    return request, tools


def completion_request(body: CompletionRequest, session_id: str | None, namespace: str = DEFAULT_NAMESPACE,
                       defaults: GenerationDefaults | None = None) -> GenerationRequest:
    prompt = body.prompt if isinstance(body.prompt, str) else tuple(body.prompt)
    return GenerationRequest(
        model=body.model, prompt=prompt, max_tokens=body.answer_limit(), sampling=sampling_of(body, defaults),
        stop=body.stop_strings(), choices=body.choices(), logprobs=body.logprob_alternatives(),
        echo=bool(body.echo), session_id=session_id, namespace=namespace, handoff_mode=body.handoff_mode())
