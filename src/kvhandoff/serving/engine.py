"""The serving engine: conversations, one scheduling worker per model, handoff decisions and decoding. No HTTP here:
the routes (`app.py`) turn requests into `GenerationRequest`s and `RequestError`s into status codes.

A conversation is a `SwitchingSession`: its token ids and each model's cache of them. A request names a model and
brings the whole conversation (chat template applied). A request that names a session (within its tenant) is served
on that session: the engine finds the longest common token prefix with what the session has cached, rolls every
cache back to it (an edited or dropped turn is never served from stale KV), and the model reads only the rest. A
request that names none is served from the prefix cache (`prefix_cache.PrefixCache`): a fresh session is filled
with what each model holds of its prompt, and what the request adds is kept there afterwards. Either way, when
another model served the conversation last (or holds more of it), the conversation is handed over: the history is
mapped (incrementally: only what this model has not cached), the new turn is read by the receiving model itself,
and the pair's quality guard (`guard.GuardPolicy`, one per ordered pair, built when the engine starts) may reject
the mapped cache: the model then re-prefills what it does not hold exactly (its own positions of earlier turns are
kept, `SwitchingSession.reprefill`), or, under `config.Escalate`, the handover is taken back and made again with a
larger recompute budget (`SwitchingSession.undo_handover`).

Threads: the event loop only admits requests and relays events; each model's compute runs on that model's worker
thread (`ModelWorker`), which schedules the requests it holds: their decode steps share one forward, their prompts
are read in chunks between the steps. Requests of one named session are serialised in arrival order by the
session's lock, held until its generation ends. The guard's reference pass runs the previous model on the
receiving model's worker (a forward of the new turn only; eval-mode forwards share no state).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import inspect
import logging
import queue
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field, replace

import torch

from kvhandoff.errors import ConfigError, KVHandoffError
from kvhandoff.runtime.llama_cpp.engine import LlamaCppModel, check_recompute, serves_recompute
from kvhandoff.runtime.plan import HandoffPlan
from kvhandoff.runtime.policy import DEFAULT_RECOMPUTE
from kvhandoff.runtime.prefix_store import PrefixStore
from kvhandoff.runtime.seam import new_cache
from kvhandoff.runtime.session import SwitchingSession
from kvhandoff.serving.chat import chat_template_of, render, render_text
from kvhandoff.serving.config import Escalate, Fallback, ServeConfig
from kvhandoff.serving.decoding import Sampler, SamplingParams, end_ids, held_back, stop_index
from kvhandoff.serving.grammar import GrammarSpec, ToolCalls
from kvhandoff.serving.guard import GuardPolicy, guard_policies, guard_score
from kvhandoff.serving.metrics import ServingMetrics
from kvhandoff.serving.prefix_cache import PrefixCache
from kvhandoff.serving.prefix_tree import DEFAULT_NAMESPACE
from kvhandoff.serving.protocol import HANDOFF_MODES
from kvhandoff.serving.recompute import PairRecompute, pair_plans, pair_recomputes
from kvhandoff.serving.tools import tool_parser

logger = logging.getLogger(__name__)

#: what went wrong with a request (`RequestError.kind`); app.py gives each its HTTP status
ERROR_KINDS = ("invalid_request", "not_found", "too_long", "too_many_sessions", "overloaded", "cancelled", "internal",
               "shutting_down")


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
    tokens in the prefix cache; ``handoff_mode`` (`protocol.HANDOFF_MODES`) "auto", "reprefill" (at a switch the
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


@dataclass
class Choice:
    """One answer of a request as it is produced: its text so far, tokens, log-prob entries and finish reason."""

    index: int
    text: str = ""
    tokens: int = 0
    logprobs: list[TokenEntry] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class HandoffReport:
    """What happened to the conversation's cache before the first token (see `protocol.HandoffInfo`)."""

    status: str
    source: str | None
    target: str
    mapped_tokens: int
    read_tokens: int
    cached_tokens: int
    prompt_tokens: int
    guard: dict | None
    milliseconds: float
    approximate_tokens: int = 0

    def to_dict(self) -> dict:
        return {"status": self.status, "from": self.source, "to": self.target, "mapped_tokens": self.mapped_tokens,
                "read_tokens": self.read_tokens, "cached_tokens": self.cached_tokens,
                "approximate_tokens": self.approximate_tokens, "prompt_tokens": self.prompt_tokens,
                "guard": self.guard, "milliseconds": self.milliseconds}


def common_prefix(first, second) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = 0
    for a, b in zip(first, second, strict=False):
        if a != b:
            break
        n += 1
    return n


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


def family_template(models) -> str:
    """The chat template every hosted model renders conversations with: the first model's. A conversation must be
    the same tokens whichever model serves a turn, or a switch can reuse only up to where two renderings part."""
    names = list(models)
    template = chat_template_of(models[names[0]][1])
    differing = [name for name in names[1:] if chat_template_of(models[name][1]) != template]
    if differing:
        logger.warning("the chat templates of %s differ from %s's; every model renders conversations with %s's, so "
                       "that a conversation's tokens are the same whichever model serves", ", ".join(differing),
                       names[0], names[0])
    return template


#: characters tokenized at a time when a long text is checked against the context window
LENGTH_CHUNK_CHARS = 1 << 16
#: tokens a cut between two chunks may add to their count (the tokenizer cannot merge across it)
CHUNK_CUT_TOKENS = 8


def surely_longer(tokenizer, text: str, limit: int, add_special_tokens: bool = True) -> bool:
    """Whether ``text`` is surely more than ``limit`` tokens: counted a chunk at a time (`LENGTH_CHUNK_CHARS`,
    each cut allowed `CHUNK_CUT_TOKENS`), stopping once past the limit, so an over-long text is refused without
    being tokenized whole. False, uncounted, for a text of at most `LENGTH_CHUNK_CHARS` or 8 × ``limit``
    characters: its one exact count decides, at about the cost of this one."""
    if len(text) <= max(LENGTH_CHUNK_CHARS, 8 * limit):
        return False
    count = 0
    for cuts, start in enumerate(range(0, len(text), LENGTH_CHUNK_CHARS)):
        piece = text[start:start + LENGTH_CHUNK_CHARS]
        count += len(tokenizer(piece, add_special_tokens=add_special_tokens and not start)["input_ids"])
        if count - cuts * CHUNK_CUT_TOKENS > limit:
            return True
    return False


def too_long(field: str, window: int, tokens: int | None = None) -> RequestError:
    """The refusal of a prompt of ``tokens`` (None: more than the window) past a context of ``window`` tokens."""
    count = f"{tokens} tokens" if tokens is not None else f"more than {window} tokens"
    return RequestError("too_long", f"This model's maximum context length is {window} tokens, prompt and answer "
                        f"together. However, your {field} resulted in {count}. Please reduce the length of the "
                        f"{field}.", param=field, code="context_length_exceeded")


def prompt_ids(tokenizer, vocab_size: int, messages=None, prompt=None, tools=None, template=None,
               limit: int | None = None) -> list[int]:
    """The token ids a request's model reads: chat ``messages`` (OpenAI-shaped dicts) rendered by the tokenizer's
    chat template with ``tools``, or a completion ``prompt`` (text, or token ids checked against ``vocab_size``).
    A text surely past ``limit`` tokens is refused (`too_long`) before it is tokenized whole."""
    if messages is not None:
        try:
            text = render_text(tokenizer, messages, tools, template=template)
        except ConfigError as exc:
            raise RequestError("invalid_request", str(exc), param="messages") from exc
        if limit is not None and surely_longer(tokenizer, text, limit, add_special_tokens=False):
            raise too_long("messages", limit)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if isinstance(prompt, str):
        if limit is not None and surely_longer(tokenizer, prompt, limit):
            raise too_long("prompt", limit)
        return list(tokenizer(prompt)["input_ids"])
    ids = list(prompt or ())
    if any(not 0 <= token < vocab_size for token in ids):
        raise RequestError("invalid_request", f"token ids must be in 0..{vocab_size - 1}", param="prompt")
    return ids


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
        self.report: HandoffReport | None = None
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

    async def wait_ready(self) -> HandoffReport:
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


@dataclass(frozen=True)
class Read:
    """A running request's next decode step: ``session`` reads ``token`` on the worker's model (what a request's
    job yields; the worker sends back the log-probs of the token after it)."""

    session: SwitchingSession
    token: int


class ModelWorker:
    """One model's compute thread: a scheduler of the requests it serves, fed by a bounded queue.

    A request's job is a callable that returns a generator: it yields a `Read` when it needs a decode step (the
    worker sends back that token's log-probs) and None after each chunk of its prompt (the worker may run others
    meanwhile). Every round the worker takes queued jobs (up to ``max_batch`` held at once), runs one piece of one
    preparing job (its start up to its first chunk, or its next chunk), then one decode step of every job waiting
    for one, all in one forward (``step``: the reads → log-probs [n, vocab]). Concurrent answers so share their
    forwards, and a prompt read in chunks lets running answers step between its chunks (a re-prefill, a guard's
    reference pass and an echo are read whole). A batched step that fails is retried one read at a time, so only a
    request whose own step fails gets the error. Jobs report their own errors; a job that fails past them is
    logged, and the worker goes on. `close` ends the jobs it holds (each generator closed: its cleanup runs).
    """

    def __init__(self, name: str, max_queue: int, step=None, max_batch: int = 16) -> None:
        self.name = name
        self.max_queue, self.max_batch, self._step = max_queue, max_batch, step
        self._jobs: queue.Queue = queue.Queue(maxsize=max_queue)
        self.steps = 0  # decode forwards run
        self.batched_reads = 0  # decode steps they served
        self._thread = threading.Thread(target=self._loop, name=f"kvhandoff-{name}", daemon=True)
        self._thread.start()

    def submit(self, job) -> None:
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            raise RequestError("overloaded", f"model {self.name!r} has {self.max_queue} requests waiting; retry later",
                               code="overloaded") from None

    def queued(self) -> int:
        return self._jobs.qsize()

    @torch.inference_mode()
    def _loop(self) -> None:
        preparing: collections.deque = collections.deque()  # jobs not started, or between two prompt chunks
        decoding: list = []  # (job, Read) waiting for a decode step
        while True:
            while len(preparing) + len(decoding) < self.max_batch:
                try:
                    job = self._jobs.get() if not (preparing or decoding) else self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    for running in [*preparing, *(running for running, _ in decoding)]:
                        if inspect.isgenerator(running):
                            with contextlib.suppress(Exception):
                                running.close()
                    return
                preparing.append(job)
            if preparing:
                self._resume(preparing.popleft(), None, preparing, decoding)
            if decoding:
                batch, decoding[:] = list(decoding), []
                for (running, _), outcome in zip(batch, self._decode_step([read for _, read in batch]), strict=True):
                    self._resume(running, outcome, preparing, decoding)

    def _decode_step(self, reads: list[Read]) -> list:
        """Each read's log-probs from one batched forward; if that fails, from one forward each (an exception in
        place of the log-probs of a read whose own forward fails)."""
        try:
            rows = list(self._step(reads))
            if len(rows) != len(reads):
                raise RuntimeError(f"a decode step returned {len(rows)} rows for {len(reads)} reads")
            self.steps, self.batched_reads = self.steps + 1, self.batched_reads + len(reads)
            return rows
        except Exception as exc:
            if len(reads) == 1:
                return [exc]
            logger.warning("a batched decode step of %d requests failed (%s: %s); they step one by one", len(reads),
                           type(exc).__name__, exc)
        outcomes = []
        for read in reads:
            try:
                outcomes.append(self._step([read])[0])
                self.steps, self.batched_reads = self.steps + 1, self.batched_reads + 1
            except Exception as exc:
                outcomes.append(exc)
        return outcomes

    @staticmethod
    def _resume(job, value, preparing, decoding) -> None:
        """Run ``job`` (started first if it is not yet) to its next yield, sending it ``value`` (thrown into it
        when an exception), and file it by what it yielded; a job that ended is dropped."""
        try:
            if not inspect.isgenerator(job):
                job = job()
            wants = job.throw(value) if isinstance(value, BaseException) else job.send(value)
        except StopIteration:
            return
        except Exception:  # a job that failed past its own error handling: logged, the worker goes on
            logger.exception("a request's job failed past its own error handling")
            return
        if wants is None:
            preparing.append(job)
        else:
            decoding.append((job, wants))

    def close(self, timeout: float = 10.0) -> None:
        self._jobs.put(None)
        self._thread.join(timeout)


@dataclass
class HostedModel:
    name: str
    model: object
    tokenizer: object
    stop_ids: frozenset[int]
    vocab_size: int
    worker: ModelWorker


@dataclass
class SessionState:
    id: tuple[str, str] | None  # (namespace, session key); None: a request served from the prefix cache
    session: SwitchingSession
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_used: float = field(default_factory=time.monotonic)
    pending: int = 0  # requests admitted and not finished (waiting for the lock or running)
    bytes: int = 0
    # an opaque name of this conversation cache for routers, revealing nothing of the session key
    cache_id: str | None = field(default_factory=lambda: uuid.uuid4().hex)

    def idle(self) -> bool:
        return self.pending == 0 and not self.lock.locked()


def _window(model) -> int:
    """The tokens one conversation may reach on ``model``: its context window, and for a llama.cpp model the cells
    its context holds, less room for a handoff's import."""
    window = model.config.max_position_embeddings
    if isinstance(model, LlamaCppModel):
        window = min(window, model.settings.context // 2)
    return window


def _llama_cpp_recomputes(recomputes: dict) -> dict:
    """Each pair's `PairRecompute` as a llama.cpp family serves it: a configured policy it cannot serve is refused
    (`check_recompute`); a recorded one, or one chosen from the recorded trade-off (measured with the transformers
    engine), gives way to `DEFAULT_RECOMPUTE`, said at start-up."""
    served = {}
    for (source, target), recompute in recomputes.items():
        if recompute.source in ("recorded", "tradeoff") and not serves_recompute(recompute.policy):
            how = "recorded" if recompute.source == "recorded" else "chosen from the trade-off recorded"
            logger.warning("llama.cpp: the recompute policy %s for %s → %s (%s) ranks positions with a "
                           "transformers model's layers; this pair is served under %s instead", how, source, target,
                           recompute.policy.spec, DEFAULT_RECOMPUTE.spec)
            recompute = PairRecompute(DEFAULT_RECOMPUTE, "default", recompute.recorded)
        check_recompute(recompute.policy)
        served[source, target] = recompute
    return served


def _llama_cpp_guards(guards: dict) -> dict:
    """Each pair's `GuardPolicy` as a llama.cpp family serves it: a recorded escalation whose recompute rule a
    llama.cpp target cannot serve falls back instead, said at start-up (a configured one is refused before the
    workers start)."""
    served = {}
    for (source, target), guard in guards.items():
        if isinstance(guard.action, Escalate) and not serves_recompute(guard.action.recompute):
            logger.warning("llama.cpp: the guard recorded for %s → %s escalates to %s, which ranks positions with a "
                           "transformers model's layers; its flagged switches re-prefill instead", source, target,
                           guard.action.recompute.spec)
            guard = dataclasses.replace(guard, action=Fallback())
        served[source, target] = guard
    return served


def _fit_llama_cpp(config: ServeConfig, models) -> ServeConfig:
    """``config`` with at most as many sessions as every llama.cpp model's context holds sequences for (less a
    running batch's and the scratch sequences a handoff uses); said when it lowers them."""
    sequences = [model.settings.sequences for model in models if isinstance(model, LlamaCppModel)]
    if not sequences:
        return config
    room = min(sequences) - config.max_batch - 2
    if room < 1:
        raise ConfigError(f"a llama.cpp context of {min(sequences)} sequences cannot serve a batch of "
                          f"{config.max_batch}: lower --max-batch", field="max_batch")
    if config.max_sessions > room:
        logger.warning("llama.cpp: at most %d sessions at once (each context holds %d sequences, a batch of %d "
                       "and two scratch ones); --max-sessions %d lowered", room, min(sequences), config.max_batch,
                       config.max_sessions)
        config = replace(config, max_sessions=room)
    return config


class Engine:
    """Serves a model family: ``models`` name → (model, tokenizer) (one tokenizer's ids), ``mappers`` (from, to) →
    `Mapper` for every ordered pair of names, under ``config``'s limits. Use from one asyncio event loop.

    ``recomputes``: each ordered pair's `PairRecompute` (`recompute.pair_recomputes`: ``config``'s policy for every
    pair, else the one recorded with the pair's mapper, else `DEFAULT_RECOMPUTE`) and ``guards``: each ordered
    pair's `GuardPolicy` (`guard.guard_policies`: ``config``'s threshold for every pair, else the one recorded in
    the pair's mapper manifest, else none), built here once and logged, one line per pair."""

    def __init__(self, models, mappers, config: ServeConfig = ServeConfig(),  # noqa: B008 - frozen
                 metrics: ServingMetrics | None = None) -> None:
        if not models:
            raise ConfigError("models: the server needs at least one model")
        names = list(models)
        for pair in mappers:
            if pair[0] not in models or pair[1] not in models:
                raise ConfigError(
                    f"mappers: {pair[0]} → {pair[1]} names a model that is not hosted ({', '.join(names)})"
                )
        missing = [f"{a} → {b}" for a in names for b in names if a != b and (a, b) not in mappers]
        if missing:
            raise ConfigError(f"mappers: no mapper for {', '.join(missing)} (every ordered pair needs one)")
        hosted = [model for model, _ in models.values()]
        self.recomputes = pair_recomputes(config, mappers)
        llama_cpp = any(isinstance(model, LlamaCppModel) for model in hosted)
        if llama_cpp:
            self.recomputes = _llama_cpp_recomputes(self.recomputes)
            if isinstance(config.guard_action, Escalate):
                check_recompute(config.guard_action.recompute)
        config = _fit_llama_cpp(config, hosted)
        self.config = config
        positions = min(_window(model) for model, _ in models.values())
        if config.max_context is not None and config.max_context > positions:
            raise ConfigError(f"max_context {config.max_context} is past the hosted models' window: the smallest "
                              f"is {positions} (max_position_embeddings, or half a llama.cpp context's cells); "
                              "give at most that (or none)")
        self.max_context = config.max_context or positions
        self.metrics = metrics or ServingMetrics()
        self.created = int(time.time())
        self._mappers = dict(mappers)
        self._models = {
            name: HostedModel(name, model, tokenizer, end_ids(model, tokenizer), model.config.vocab_size,
                              ModelWorker(name, config.max_queue, functools.partial(self._step, name),
                                          config.max_batch))
            for name, (model, tokenizer) in models.items()
        }
        self.chat_template = family_template(models)
        self.tool_parser = tool_parser(config.tool_parser)  # reads tool calls out of every answer
        self._sessions: OrderedDict[tuple[str, str], SessionState] = OrderedDict()  # least recently used first
        self.prefix_cache = PrefixCache()  # the conversations that name no session, found by their tokens
        self.prefix_store = PrefixStore()  # the conversations' openings, shared: a switch copies its exact prefix
        self.plan = config.plan(self.prefix_store)  # every session's handoffs, each pair's recompute its own
        self.plans = pair_plans(self.plan, self.recomputes)
        self.guards: dict[tuple[str, str], GuardPolicy] = guard_policies(
            config, self._mappers, {pair: plan.recompute for pair, plan in self.plans.items()})
        if llama_cpp:
            self.guards = _llama_cpp_guards(self.guards)
        for (source, target), chosen in self.recomputes.items():
            logger.info("%s", chosen.describe(source, target))
        self._announce_guards()
        self._running: set[Generation] = set()  # admitted and not finished
        self._slot_waiters: list[asyncio.Future] = []  # requests waiting for a session slot (at most max_queue)
        self.draining = False  # shutting down: no new request is admitted
        self.metrics.track(lambda: len(self._sessions), self.cache_bytes)
        self.metrics.track_prefix_cache(self.prefix_cache.tree.stats)

    def _announce_guards(self) -> None:
        """Say at start-up how each pair's switches are guarded: a pair without a guard, or whose record was
        measured under other settings, at WARNING; the others at INFO."""
        if not self.config.guard:
            logger.info("the quality guard is off (--guard off): every switch is served mapped")
            return
        for (source, target), policy in self.guards.items():
            level = logging.WARNING if not policy.active or policy.note else logging.INFO
            logger.log(level, "%s", policy.describe(source, target))

    # -- state ----------------------------------------------------------------------------------------------------
    def model_names(self) -> list[str]:
        return list(self._models)

    def session_count(self) -> int:
        return len(self._sessions)

    def session_bytes(self) -> int:
        return sum(state.bytes for state in self._sessions.values())

    def cache_bytes(self) -> int:
        """Bytes of KV cache held: the named sessions' and the prefix cache's."""
        return self.session_bytes() + self.prefix_cache.tree.total_bytes()

    def hosted(self, name: str) -> HostedModel:
        """The hosted model ``name``, or a not-found `RequestError` listing the served names."""
        hosted = self._models.get(name)
        if hosted is None:
            raise RequestError("not_found", f"the model {name!r} does not exist; this server hosts "
                               f"{', '.join(self._models)}", param="model", code="model_not_found")
        return hosted

    def mapper_id(self, source: str, target: str) -> str:
        """The identity of the mapper from ``source`` to ``target``: its manifest's checksum."""
        return self._mappers[source, target].manifest.checksum()

    def tokenize(self, model: str, prompt: str | None = None, messages=None, tools=None,
                 add_generation_prompt: bool = True, add_special_tokens: bool = True) -> list[int]:
        """The token ids ``model`` reads for a ``prompt`` or chat ``messages`` (as a request's would be built)."""
        hosted = self.hosted(model)
        if messages is None:
            return list(hosted.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])
        try:
            return render(hosted.tokenizer, messages, tools, add_generation_prompt, self.chat_template)
        except ConfigError as exc:
            raise RequestError("invalid_request", str(exc), param="messages") from exc

    def detokenize(self, model: str, tokens: list[int]) -> str:
        hosted = self.hosted(model)
        if any(not 0 <= token < hosted.vocab_size for token in tokens):
            raise RequestError("invalid_request", f"token ids must be in 0..{hosted.vocab_size - 1}", param="tokens")
        return hosted.tokenizer.decode(tokens)

    def session_tokens(self, session_id: str, namespace: str = DEFAULT_NAMESPACE) -> list[int] | None:
        """The token ids a session has cached (None: no such session in ``namespace``)."""
        state = self._sessions.get((namespace, session_id))
        return None if state is None else list(state.session.tokens)

    def health(self) -> dict:
        """Liveness and load: status ("ok", or "draining" while shutting down), per model the requests queued, the
        named sessions, cache bytes (sessions and prefix cache), generations running and those of them cancelled
        (their client went away) that have not stopped yet; per ordered pair ("from → to") its quality guard
        (`GuardPolicy.to_dict`: source "recorded" | "configured" | "none", signal, threshold) and its recompute
        policy (`PairRecompute.to_dict`: policy, source "configured" | "recorded" | "default"); the prefix store's
        and the prefix cache's figures (`prefix_tree.TreeStats`)."""
        return {"status": "draining" if self.draining else "ok", "models": {name: {"queued": hosted.worker.queued()}
                                           for name, hosted in self._models.items()},
                "guard": {f"{source} → {target}": policy.to_dict()
                          for (source, target), policy in self.guards.items()},
                "recompute": {f"{source} → {target}": chosen.to_dict()
                              for (source, target), chosen in self.recomputes.items()},
                "sessions": len(self._sessions), "cache_bytes": self.cache_bytes(), "running": len(self._running),
                "prefix_store": {"openings": len(self.prefix_store), "hits": self.prefix_store.hits,
                                 "misses": self.prefix_store.misses},
                "prefix_cache": self.prefix_cache.tree.stats().to_dict(),
                "cancelling": sum(g.cancelled.is_set() for g in self._running)}

    def close(self) -> None:
        """Stop the workers; requests still running end with a shutting-down error."""
        self.abort_running()
        for hosted in self._models.values():
            hosted.worker.close()

    def running(self) -> int:
        """Requests admitted and not finished (safe from any thread)."""
        return len(self._running)

    def abort_running(self) -> None:
        """End every running request with a shutting-down error (a stream ends with an error event); from any
        thread."""
        error = RequestError("shutting_down", "the server shut down before this answer was finished",
                             code="shutting_down")
        for generation in list(self._running):
            generation.abort(error)

    # -- admission (event loop) -----------------------------------------------------------------------------------
    async def start(self, request: GenerationRequest) -> Generation:
        """Admit ``request``; returns its `Generation` once the first token's distribution is known (its report
        set), or raises `RequestError`."""
        arrival = time.perf_counter()
        self._refuse_if_draining()
        hosted = self.hosted(request.model)
        if request.handoff_mode not in HANDOFF_MODES:
            raise RequestError("invalid_request", f"kv_handoff.mode must be one of {', '.join(HANDOFF_MODES)}, got "
                               f"{request.handoff_mode!r}", param="kv_handoff.mode")
        prompt, constraints = await asyncio.to_thread(self._inputs, hosted, request)
        if not prompt:
            raise RequestError("invalid_request", "the prompt is empty", param=request.prompt_field)
        if len(prompt) >= self.max_context:
            raise too_long(request.prompt_field, self.max_context, len(prompt))
        limit = self.config.default_max_tokens if request.max_tokens is None else request.max_tokens
        max_new = min(limit, self.max_context - len(prompt))
        self._refuse_if_draining()  # it may have begun while the prompt was built
        state = await self._admit_waiting(request.session_id, request.namespace)
        state.pending += 1
        try:
            await state.lock.acquire()
        except BaseException:
            state.pending -= 1
            raise
        generation = Generation(asyncio.get_running_loop(), len(prompt), request.choices, state.cache_id)
        job = functools.partial(self._run, state, hosted, prompt, max_new, request, generation, arrival, constraints)
        self._running.add(generation)
        try:
            hosted.worker.submit(job)
        except BaseException:
            self._finish(state, generation)
            raise
        try:
            await generation.wait_ready()
        except asyncio.CancelledError:
            generation.cancel()
            raise
        return generation

    def _refuse_if_draining(self) -> None:
        if self.draining:
            raise RequestError("shutting_down", "the server is shutting down; retry against another instance",
                               code="shutting_down")

    async def _admit_waiting(self, session_id: str | None, namespace: str) -> SessionState:
        """`_admit`; while every session is busy, wait for one to end (up to ``config.admission_wait_s``, at most
        ``config.max_queue`` requests waiting), then refuse (429)."""
        deadline = time.monotonic() + self.config.admission_wait_s
        while True:
            try:
                return self._admit(session_id, namespace)
            except RequestError as exc:
                left = deadline - time.monotonic()
                if exc.kind != "too_many_sessions" or left <= 0 or len(self._slot_waiters) >= self.config.max_queue:
                    raise
            self._refuse_if_draining()
            waiter = asyncio.get_running_loop().create_future()
            self._slot_waiters.append(waiter)
            try:
                await asyncio.wait_for(waiter, left)
            except TimeoutError:
                pass
            finally:
                with contextlib.suppress(ValueError):
                    self._slot_waiters.remove(waiter)

    def _admit(self, session_id: str | None, namespace: str) -> SessionState:
        now = time.monotonic()
        for key, state in list(self._sessions.items()):
            if state.idle() and now - state.last_used > self.config.session_ttl_s:
                self._evict(key, "ttl")
        if session_id is None:  # a session of its own, filled from the prefix cache and kept there afterwards
            return SessionState(None, self._new_session(), cache_id=None)
        session_id = (namespace, session_id)
        state = self._sessions.get(session_id)
        if state is None:
            if len(self._sessions) >= self.config.max_sessions:
                victim = next((key for key, s in self._sessions.items() if s.idle()), None)
                if victim is None:
                    raise RequestError("too_many_sessions", f"all {self.config.max_sessions} sessions are busy; "
                                       "retry later", code="too_many_sessions")
                self._evict(victim, "sessions")
            state = self._sessions[session_id] = SessionState(session_id, self._new_session())
        self._sessions.move_to_end(session_id)
        state.last_used = now
        return state

    def _new_session(self) -> SwitchingSession:
        return SwitchingSession({name: hosted.model for name, hosted in self._models.items()}, self._mappers,
                                self.config.handover, self.plan, pair_plans=self.plans)

    def _evict(self, key: tuple[str, str], reason: str) -> None:
        del self._sessions[key]
        self.metrics.evictions.labels(reason=reason).inc()

    def _finish(self, state: SessionState, generation: Generation) -> None:
        """A request of ``state`` ended (event loop): release its session and keep the cache memory in bounds."""
        self._running.discard(generation)
        state.pending -= 1
        state.last_used = time.monotonic()
        state.lock.release()
        for waiter in self._slot_waiters:  # a session may have become idle: let them try again
            if not waiter.done():
                waiter.set_result(None)
        limit = self.config.cache_memory_bytes
        self.prefix_cache.tree.evict(max(0, limit - self.session_bytes()))
        total = self.cache_bytes()
        for key, candidate in list(self._sessions.items()):
            if total <= self.config.cache_memory_bytes:
                break
            if candidate.idle():
                total -= candidate.bytes
                self._evict(key, "memory")

    # -- compute (the model's worker thread) ----------------------------------------------------------------------
    def _inputs(self, hosted: HostedModel, request: GenerationRequest):
        """(prompt ids, one grammar constraint per answer or None) of ``request`` for ``hosted``; what does not fit
        the model (a token id past its vocabulary, a conversation its template refuses) is a `RequestError`."""
        prompt = prompt_ids(hosted.tokenizer, hosted.vocab_size, request.messages, request.prompt, request.tools,
                            self.chat_template, self.max_context)
        try:
            Sampler(request.sampling, hosted.stop_ids, hosted.vocab_size, prompt)
        except ConfigError as exc:
            raise RequestError("invalid_request", str(exc), param=exc.field) from exc
        if request.grammar is None:
            return prompt, None
        try:
            constraints = [request.grammar.constraint(hosted.tokenizer, hosted.vocab_size, eos=hosted.stop_ids)
                           for _ in range(request.choices)]
        except ConfigError as exc:
            param = "tool_choice" if isinstance(request.grammar, ToolCalls) else "response_format"
            raise RequestError("invalid_request", str(exc), param=param) from exc
        return prompt, constraints

    def _step(self, server: str, reads: list[Read]) -> torch.Tensor:
        """One decode step of several requests on ``server``: log-probs [n, vocab]."""
        return SwitchingSession.read_together(server, [(read.session, read.token) for read in reads])

    def _run(self, state, hosted, prompt, max_new, request, generation, arrival, constraints):
        """A request's job on its model's worker (a generator: see `ModelWorker`)."""
        session, checkout = state.session, None
        try:
            if generation.cancelled.is_set():
                raise RequestError("cancelled", "the client went away before the request was served")
            if state.id is None:
                checkout = self.prefix_cache.checkout(request.namespace, prompt, hosted.name, session,
                                                      exact_only=request.handoff_mode == "exact")
            report, logprobs = yield from self._prepare(session, hosted.name, prompt, request.handoff_mode,
                                                        generation.cancelled)
            self.metrics.record_first_token(report.to_dict(), time.perf_counter() - arrival)
            if request.echo:
                generation.echo = self._echo(hosted, request, prompt)
            generation.post("ready", report)
            yield from self._decode(session, hosted, logprobs, prompt, max_new, request, generation, constraints)
            if checkout is not None:  # before the answer ends: the client's next turn finds it
                self.prefix_cache.checkin(checkout, session, report)
            generation.post("end")
        except Exception as exc:
            if not (isinstance(exc, RequestError) and exc.kind == "cancelled"):  # a cancel leaves the session whole
                with contextlib.suppress(Exception):  # it may be half-way through a change: forgotten, never stale
                    session.truncate(0)
            error = exc if isinstance(exc, RequestError) else RequestError("internal", f"{type(exc).__name__}: {exc}")
            generation.post("error", error)
        finally:
            if checkout is not None:
                try:
                    self.prefix_cache.release(checkout)
                except Exception:
                    logger.exception("prefix cache: a request's path could not be released")
            state.bytes = session.cache_bytes() if state.id is not None else 0
            generation.call_soon(functools.partial(self._finish, state, generation))

    def _prepare(self, session: SwitchingSession, server: str, prompt: list[int], mode: str = "auto",
                 cancelled: threading.Event | None = None):
        """Bring ``server``'s cache of the session up to ``prompt``; returns (report, log-probs of the next token).
        At a switch with ``mode`` "reprefill" the model re-prefills the whole conversation instead of mapping; with
        "exact" it re-reads what it does not hold exactly (its own positions of earlier turns are kept). A generator:
        the new tokens are read `config.prefill_chunk` at a time, yielding None between chunks; a ``cancelled`` set
        meanwhile stops it there (`RequestError` "cancelled"). Re-prefills are read in one forward."""
        started = time.perf_counter()
        common = min(common_prefix(session.tokens, prompt), len(prompt) - 1)
        session.truncate(common)
        new = prompt[common:]
        previous = session.owner
        own_before = session.own_length(server)  # its exact positions of the prompt, before anything is read
        mapped = common - session.cached_length(server) if previous not in (None, server) else 0
        status, source, guard = "none", None, None
        kept = common  # the positions of the prompt served from a cache, not read again
        if mapped > 0 and mode == "reprefill":  # the path without a handoff: the whole conversation read again
            status, source, mapped, kept = "reprefill", previous, 0, 0
            session.tokens += new  # read by the prefill below, with the rest of the conversation
            logprobs = session.reprefill(server, keep_own=False)[None]
        elif mode == "exact" and (mapped > 0 or session.own_length(server) < common):  # nothing mapped serves it
            status, source = ("reprefill", previous) if previous not in (None, server) else ("none", None)
            mapped = 0
            session.tokens += new
            kept = session.reprefill_start(server)
            logprobs = session.reprefill(server)[None]
        elif mapped > 0:
            status, source = "applied", previous
            policy = self.guards[previous, server]
            keep = policy.window if policy.active else 1
            # the previous model's read of the turn: the guard's reference and, for a policy ranking by it, the
            # attention that picks the positions to recompute (one forward for both)
            reference, turn_read = (session.preview_turn(server, new, keep) if policy.needs_reference
                                    else (None, None))
            logprobs = yield from self._read_chunked(session, server, new, keep, cancelled, turn_read=turn_read)
            if policy.active:
                score = guard_score(policy.signal, logprobs, reference, new, mapped / common)
                guard = policy.report(score)
                if policy.rejects(score) and isinstance(policy.action, Escalate):
                    session.undo_handover()  # hand over again, recomputing more of what is mapped
                    plan = session.plan_for(previous, server).with_recompute(policy.action.recompute)
                    status = "escalated"
                    logprobs = yield from self._read_chunked(session, server, new, 1, cancelled, plan, turn_read)
                elif policy.rejects(score):  # re-read what the model does not hold exactly (its own turns stay)
                    status, kept = "fallback", session.reprefill_start(server)
                    logprobs = session.reprefill(server)[None]
        else:
            logprobs = yield from self._read_chunked(session, server, new, 1, cancelled)
        approximate = max(0, kept - own_before) if status in ("applied", "escalated", "none") else 0
        report = HandoffReport(status, source, server, mapped, len(prompt) - kept, kept, len(prompt), guard,
                               round((time.perf_counter() - started) * 1000, 3), approximate)
        return report, logprobs[-1]

    def _read_chunked(self, session: SwitchingSession, server: str, new: list[int], keep: int = 1,
                      cancelled: threading.Event | None = None, plan: HandoffPlan | None = None,
                      turn_read: torch.Tensor | None = None):
        """``server`` reads ``new`` in chunks of `config.prefill_chunk` (the last one holds at least ``keep``
        tokens), yielding None after each but the last, and stopping there when ``cancelled`` is set; returns the
        log-probs of the last ``keep`` positions. ``plan``: that of a handover the first chunk makes, instead of the
        pair's; ``turn_read``: the previous model's attention while it read ``new`` (`preview_turn`), for it."""
        chunk = self.config.prefill_chunk
        last = min((len(new) - 1) // chunk * chunk, max(0, len(new) - keep))  # where the last chunk starts
        for start in range(0, last, chunk):
            session.read_logprobs(server, new[start:min(start + chunk, last)], 1, upcoming=new[start:], plan=plan,
                                  source_turn_read=turn_read)
            yield None
            if cancelled is not None and cancelled.is_set():
                raise RequestError("cancelled", "the client went away while its prompt was read")
        return session.read_logprobs(server, new[last:], keep, upcoming=new[last:], plan=plan,
                                     source_turn_read=turn_read)

    def _echo(self, hosted: HostedModel, request: GenerationRequest, prompt: list[int]):
        """(the prompt's text, its log-prob entries): each token under the model's distribution after the tokens
        before it (a forward over the whole prompt, apart from the session's cache); no entries without log-probs."""
        text = request.prompt if isinstance(request.prompt, str) else hosted.tokenizer.decode(prompt)
        if request.logprobs is None:
            return text, []
        logits = new_cache(hosted.model).read(hosted.model, torch.tensor([prompt]), 0)[0]  # every position's
        logprobs = logits.float().log_softmax(-1).cpu()
        entries = [token_entry(hosted.tokenizer, None, prompt[0], 0)]
        entries += [token_entry(hosted.tokenizer, logprobs[i - 1], prompt[i], request.logprobs)
                    for i in range(1, len(prompt))]
        return text, entries

    def _decode(self, session, hosted, logprobs, prompt, max_new, request, generation, constraints):
        """Each of the request's answers in turn, from the same distribution after the prompt (the session's cache
        rolled back to the prompt between them); stops early when the client goes away."""
        for index in range(request.choices):
            if index:
                session.truncate(len(prompt))
            params = request.sampling
            if index and params.seed is not None:  # one seed, different answers
                params = replace(params, seed=params.seed + index)
            sampler = Sampler(params, hosted.stop_ids, hosted.vocab_size, prompt)
            constraint = constraints[index] if constraints else None
            if not (yield from self._answer(session, hosted, logprobs, len(prompt), max_new, request, generation,
                                            index, sampler, constraint)):
                break

    def _answer(self, session, hosted, logprobs, prompt_length, max_new, request, generation, index, sampler,
                constraint):
        """One answer, token by token on the session's cache (a generator yielding each decode step as a `Read`):
        stops at a stop id, a stop string, the end of the grammar, ``max_new`` tokens, or a cancel (then returns
        False, else True)."""
        answer: list[int] = []
        entries: list[TokenEntry] = []
        text, sent, finish = "", 0, "length"
        for step in range(max_new):
            token = sampler.next_token(logprobs, answer, constraint.allowed() if constraint else None)
            if token in sampler.stop_ids:
                finish = "stop"
                break
            if request.logprobs is not None:
                entries.append(token_entry(hosted.tokenizer, logprobs, token, request.logprobs))
            answer.append(token)
            if constraint is not None:
                constraint.accept(token)
            text = hosted.tokenizer.decode(answer, skip_special_tokens=True)
            cut = stop_index(text, request.stop, sent) if request.stop else None
            if cut is not None:
                text, finish = text[:cut], "stop"
                break
            ready = len(text) - held_back(text, request.stop)
            if ready > sent:
                generation.post("delta", index, text[sent:ready], len(answer), entries)
                entries, sent = [], ready
            if generation.cancelled.is_set():
                keep = min(len(session.tokens), prompt_length + generation.delivered[index])
                session.truncate(keep)  # what the client received, no more
                self.metrics.cancelled.inc()
                generation.post("done", index, "cancelled", len(answer), entries)
                return False
            if constraint is not None and constraint.done():
                finish = "stop"
                break
            if step + 1 < max_new:
                logprobs = yield Read(session, token)  # one decode step, batched with the worker's others
        if len(text) > sent:
            generation.post("delta", index, text[sent:], len(answer), entries)
            entries = []
        generation.post("done", index, finish, len(answer), entries)
        return True
