"""A request as the server's scheduler sees it, and its generation in flight: `GenerationRequest` (what the routes
build from a request body), `Generation` (the events a model's worker posts to the event loop: the turn's report,
then each answer's pieces), `RequestError` (what the routes turn into an HTTP status)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass, field

import torch

from kvhandoff.errors import KVHandoffError
from kvhandoff.runtime.switch.turn import TurnReport
from kvhandoff.serving.decoding import SamplingParams
from kvhandoff.serving.grammar import GrammarSpec
from kvhandoff.serving.prefix_tree import DEFAULT_NAMESPACE

#: what went wrong with a request (`RequestError.kind`); app.py gives each its HTTP status
ERROR_KINDS = ("invalid_request", "not_found", "too_long", "too_many_sessions", "overloaded", "cancelled", "internal",
               "shutting_down")


#: log-prob entries one response may hold: each reported position counts 1 + its alternatives, in every choice
#: (``n × max_tokens × (1 + top_logprobs)``; an echoed prompt's positions count as the answer's)
MAX_LOGPROB_ENTRIES = 2**18


class RequestError(KVHandoffError):
    """A request the engine refuses or could not serve: kind (one of `ERROR_KINDS`), message, the request field it
    is about (param) and a machine-readable code."""

    def __init__(self, kind: str, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        if kind not in ERROR_KINDS:
            raise ValueError(f"unknown request error kind {kind!r}")
        self.kind, self.message, self.param, self.code = kind, message, param, code or kind


@dataclass(frozen=True)
class GenerationRequest:
    """One request: chat ``messages`` (OpenAI-shaped dicts, rendered by the model's chat template with ``tools``) or
    a completion ``prompt`` (text or token ids). ``sampling``: how tokens are chosen; ``grammar``: a constraint every
    answer follows (`grammar.GrammarSpec`); ``choices``: answers to generate (each from the same prompt);
    ``logprobs``: alternatives per position to report (None: no log-probs); ``echo``: a completion's answer
    starts with its prompt (log-probs included). ``namespace``: the tenant whose caches may serve it
    (`prefix_tree.namespace_of`); ``session_id`` (within the namespace) None: the conversation is found by its
    tokens in the prefix cache; ``handoff_mode`` (`protocol.TURN_MODES`) "auto", "reprefill" (at a switch the
    receiving model re-prefills the conversation instead of mapping it: the path without handoff, for comparisons)
    or "exact" (only the model's own exact cache serves)."""

    model: str
    messages: tuple[dict, ...] | None = None
    tools: tuple[dict, ...] | None = None
    prompt: str | tuple[int, ...] | None = None
    max_tokens: int | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    grammar: GrammarSpec | None = None
    choices: int = 1
    logprobs: int | None = None
    echo: bool = False
    session_id: str | None = None
    namespace: str = DEFAULT_NAMESPACE
    handoff_mode: str = "auto"

    @property
    def prompt_field(self) -> str:
        return "messages" if self.messages is not None else "prompt"


def refuse_large_logprobs(request: GenerationRequest, answer_tokens: int, echoed: int = 0) -> None:
    """A 400 naming the fields when ``request``'s log-probs could pass `MAX_LOGPROB_ENTRIES`: its choices, each of
    up to ``answer_tokens`` tokens (and ``echoed`` prompt tokens), each with 1 + its alternatives."""
    if request.logprobs is None:
        return
    entries = request.choices * (answer_tokens + echoed) * (1 + request.logprobs)
    if entries <= MAX_LOGPROB_ENTRIES:
        return
    alternatives = "top_logprobs" if request.messages is not None else "logprobs"
    tokens, given = ("max_tokens", f"{answer_tokens}") if not echoed else (
        "(max_tokens + the echoed prompt's tokens)", f"({answer_tokens} + {echoed})")
    raise RequestError("invalid_request", f"n × {tokens} × (1 + {alternatives}) = {request.choices} × {given} × "
                       f"{1 + request.logprobs} = {entries:,} log-prob entries, past the {MAX_LOGPROB_ENTRIES:,} one "
                       f"response may hold; lower n, max_tokens or {alternatives}", param=alternatives,
                       code="response_too_large")


@dataclass
class Choice:
    """One answer of a request as it is produced: its text so far, tokens, log-prob entries and finish reason."""

    index: int
    text: str = ""
    tokens: int = 0
    logprobs: list[TokenEntry] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass(frozen=True)
class TokenEntry:
    """One position's log-probs as reported: the token's text, its log-prob under the model (before any sampling
    setting; None for a prompt's first token), its UTF-8 bytes, and the most likely alternatives (text, log-prob,
    bytes)."""

    token: str
    logprob: float | None
    bytes: tuple[int, ...]
    top: tuple[tuple[str, float, tuple[int, ...]], ...] = ()


def token_entry(tokenizer, logprobs: torch.Tensor | None, token: int, alternatives: int) -> TokenEntry:
    """The `TokenEntry` of ``token`` under ``logprobs`` [vocab] (None: no distribution, the prompt's first token)."""
    def piece(token_id: int) -> tuple[str, tuple[int, ...]]:
        text = tokenizer.decode([token_id])
        return text, tuple(text.encode("utf-8"))

    text, raw = piece(token)
    if logprobs is None:
        return TokenEntry(text, None, raw)
    top = []
    if alternatives:
        values, ids = logprobs.float().topk(alternatives)
        for value, token_id in zip(values.tolist(), ids.tolist(), strict=True):
            alternative, alternative_bytes = piece(token_id)
            top.append((alternative, value, alternative_bytes))
    return TokenEntry(text, float(logprobs[token]), raw, tuple(top))


class Generation:
    """A request in flight: its handoff report once the first token's distribution is known, then its choices.

    The worker thread posts events; the event loop consumes them (`wait_ready`, then `events()` or `complete()`).
    `cancel()` (the client went away) stops the worker at its next token and rolls the session back to what was
    delivered.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, prompt_tokens: int, choices: int = 1,
                 cache_id: str | None = None) -> None:
        self._loop = loop
        self.cache_id = cache_id  # the named session's cache serving it (None: the prefix cache)
        self._events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.prompt_tokens = prompt_tokens
        self.choices = [Choice(index) for index in range(choices)]
        self.delivered = [0] * choices  # answer tokens per choice whose text the consumer has taken
        self.report: TurnReport | None = None
        self.echo: tuple[str, list[TokenEntry]] | None = None  # an echoed prompt: its text and log-prob entries

    @property
    def completion_tokens(self) -> int:
        return sum(choice.tokens for choice in self.choices)

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason

    def post(self, *event) -> None:
        """Hand an event to the event loop (from the worker thread)."""
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody is listening
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)

    def call_soon(self, callback) -> None:
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(callback)

    async def wait_ready(self) -> TurnReport:
        kind, *rest = await self._events.get()
        if kind == "error":
            raise rest[0]
        self.report = rest[0]
        return self.report

    async def events(self):
        """(choice, text, log-prob entries) for each piece of an answer and (choice, None, []) when that answer ends
        (its `Choice.finish_reason` is then set); ends when every answer has."""
        while True:
            kind, *rest = await self._events.get()
            if kind == "delta":
                index, text, tokens, entries = rest
                choice = self.choices[index]
                self.delivered[index] = choice.tokens = tokens
                choice.text += text
                choice.logprobs += entries
                yield choice, text, entries
            elif kind == "done":
                index, finish, tokens, entries = rest
                choice = self.choices[index]
                choice.finish_reason, choice.tokens = finish, tokens
                choice.logprobs += entries
                yield choice, None, entries
            elif kind == "end":
                return
            else:
                raise rest[0]

    async def complete(self) -> list[Choice]:
        """Every answer, whole."""
        async for _ in self.events():
            pass
        return self.choices

    async def text(self) -> str:
        """The first answer's text, whole."""
        return (await self.complete())[0].text

    def cancel(self) -> None:
        self.cancelled.set()

    def abort(self, error: RequestError) -> None:
        """End the request now with ``error`` (its consumer raises it: a stream ends with an error event) and stop
        the worker at its next token."""
        self.cancelled.set()
        self.post("error", error)
