"""The serving engine: sessions, one worker thread per model, handoff decisions and decoding. No HTTP here: the
routes (`app.py`) turn requests into `GenerationRequest`s and `RequestError`s into status codes.

A session is one conversation (`SwitchingSession`): its token ids and each model's cache of them. A request names
a model and brings the whole conversation (chat template applied); the engine finds the longest common token
prefix with what the session has cached, rolls every cache back to it (an edited or dropped turn is never served
from stale KV), and the model reads only the rest. When another model served the session last, the conversation
is handed over: the history is mapped (incrementally: only what this model has not cached), the new turn is read
by the receiving model itself, and the quality guard may reject the mapped cache (the model then re-prefills).

Threads: the event loop only admits requests and relays events; each model's compute runs on that model's worker
thread, fed by a bounded queue (a batching engine can replace the worker later). Requests of one session are
serialised in arrival order by the session's lock, held until its generation ends. The guard's reference pass runs
the previous model on the receiving model's worker (a forward of the new turn only; eval-mode forwards share no
state).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from kvhandoff.errors import ConfigError, KVHandoffError
from kvhandoff.runtime.prefix_store import PrefixStore
from kvhandoff.runtime.session import SwitchingSession
from kvhandoff.serving.config import ServeConfig
from kvhandoff.serving.decoding import choose_token, end_ids, held_back, make_generator, stop_index
from kvhandoff.serving.guard import guard_score, needs_reference, reference_logprobs
from kvhandoff.serving.metrics import ServingMetrics
from kvhandoff.serving.protocol import HANDOFF_MODES

#: the chat template of a tokenizer that has none (ChatML, the layout of Qwen chat models)
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

#: what went wrong with a request (`RequestError.kind`); app.py gives each its HTTP status
ERROR_KINDS = ("invalid_request", "not_found", "too_long", "too_many_sessions", "overloaded", "cancelled", "internal")


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
    """One request: chat ``messages`` ((role, text) pairs, the chat template applied by the engine) or a completion
    ``prompt`` (text or token ids); sampling settings (temperature 0: greedy); ``session_id`` None: stateless;
    ``handoff_mode`` (`protocol.HANDOFF_MODES`) "auto", or "reprefill": at a switch the receiving model re-prefills
    the conversation instead of mapping it (the path without handoff, for comparisons)."""

    model: str
    messages: tuple[tuple[str, str], ...] | None = None
    prompt: str | tuple[int, ...] | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    session_id: str | None = None
    handoff_mode: str = "auto"

    @property
    def prompt_field(self) -> str:
        return "messages" if self.messages is not None else "prompt"


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

    def to_dict(self) -> dict:
        return {"status": self.status, "from": self.source, "to": self.target, "mapped_tokens": self.mapped_tokens,
                "read_tokens": self.read_tokens, "cached_tokens": self.cached_tokens,
                "prompt_tokens": self.prompt_tokens, "guard": self.guard, "milliseconds": self.milliseconds}


def common_prefix(first, second) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = 0
    for a, b in zip(first, second, strict=False):
        if a != b:
            break
        n += 1
    return n


class Generation:
    """A request in flight: its handoff report once the first token's distribution is known, then its text.

    The worker thread posts events; the event loop consumes them (`wait_ready`, then `deltas()`). `cancel()` (the
    client went away) stops the worker at its next token and rolls the session back to what was delivered.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, prompt_tokens: int) -> None:
        self._loop = loop
        self._events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.prompt_tokens = prompt_tokens
        self.delivered = 0  # answer tokens whose text the consumer has taken
        self.report: HandoffReport | None = None
        self.finish_reason: str | None = None
        self.completion_tokens = 0

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

    async def deltas(self):
        """The answer's text, piece by piece; ends when the answer does (`finish_reason` is then set)."""
        while True:
            kind, *rest = await self._events.get()
            if kind == "delta":
                self.delivered = rest[1]
                yield rest[0]
            elif kind == "done":
                self.finish_reason, self.completion_tokens = rest
                return
            else:
                raise rest[0]

    async def text(self) -> str:
        return "".join([piece async for piece in self.deltas()])

    def cancel(self) -> None:
        self.cancelled.set()


class ModelWorker:
    """One model's compute thread and its bounded job queue."""

    def __init__(self, name: str, max_queue: int) -> None:
        self.name = name
        self.max_queue = max_queue
        self._jobs: queue.Queue = queue.Queue(maxsize=max_queue)
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

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            with contextlib.suppress(Exception):  # jobs report their own errors; the worker never dies
                job()

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
    id: str | None
    session: SwitchingSession
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_used: float = field(default_factory=time.monotonic)
    pending: int = 0  # requests admitted and not finished (waiting for the lock or running)
    bytes: int = 0

    def idle(self) -> bool:
        return self.pending == 0 and not self.lock.locked()


class Engine:
    """Serves a model family: ``models`` name → (model, tokenizer) (one tokenizer's ids), ``mappers`` (from, to) →
    `Mapper` for every ordered pair of names, under ``config``'s limits. Use from one asyncio event loop."""

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
        self.config = config
        positions = [model.config.max_position_embeddings for model, _ in models.values()]
        self.max_context = config.max_context or min(positions)
        self.metrics = metrics or ServingMetrics()
        self.created = int(time.time())
        self._mappers = dict(mappers)
        self._models = {
            name: HostedModel(name, model, tokenizer, end_ids(model, tokenizer), model.config.vocab_size,
                              ModelWorker(name, config.max_queue))
            for name, (model, tokenizer) in models.items()
        }
        self._sessions: OrderedDict[str, SessionState] = OrderedDict()  # least recently used first
        self.prefix_store = PrefixStore()  # the conversations' openings, shared: a switch copies its exact prefix
        self.plan = config.plan(self.prefix_store)  # every session's handoffs
        self._running: set[Generation] = set()  # admitted and not finished
        self.metrics.track(lambda: len(self._sessions), self.cache_bytes)

    # -- state ----------------------------------------------------------------------------------------------------
    def model_names(self) -> list[str]:
        return list(self._models)

    def session_count(self) -> int:
        return len(self._sessions)

    def cache_bytes(self) -> int:
        return sum(state.bytes for state in self._sessions.values())

    def session_tokens(self, session_id: str) -> list[int] | None:
        """The token ids a session has cached (None: no such session)."""
        state = self._sessions.get(session_id)
        return None if state is None else list(state.session.tokens)

    def health(self) -> dict:
        """Liveness and load: per model the requests queued, sessions, cache bytes, generations running and those of
        them cancelled (their client went away) that have not stopped yet."""
        return {"status": "ok", "models": {name: {"queued": hosted.worker.queued()}
                                           for name, hosted in self._models.items()},
                "sessions": len(self._sessions), "cache_bytes": self.cache_bytes(), "running": len(self._running),
                "prefix_store": {"openings": len(self.prefix_store), "hits": self.prefix_store.hits,
                                 "misses": self.prefix_store.misses},
                "cancelling": sum(g.cancelled.is_set() for g in self._running)}

    def close(self) -> None:
        for hosted in self._models.values():
            hosted.worker.close()

    # -- admission (event loop) -----------------------------------------------------------------------------------
    async def start(self, request: GenerationRequest) -> Generation:
        """Admit ``request``; returns its `Generation` once the first token's distribution is known (its report
        set), or raises `RequestError`."""
        arrival = time.perf_counter()
        hosted = self._models.get(request.model)
        if hosted is None:
            raise RequestError("not_found", f"the model {request.model!r} does not exist; this server hosts "
                               f"{', '.join(self._models)}", param="model", code="model_not_found")
        if request.handoff_mode not in HANDOFF_MODES:
            raise RequestError("invalid_request", f"kv_handoff.mode must be one of {', '.join(HANDOFF_MODES)}, got "
                               f"{request.handoff_mode!r}", param="kv_handoff.mode")
        prompt = await asyncio.to_thread(self._prompt_ids, hosted, request)
        if not prompt:
            raise RequestError("invalid_request", "the prompt is empty", param=request.prompt_field)
        if len(prompt) >= self.max_context:
            raise RequestError("too_long", f"the prompt has {len(prompt)} tokens; this server's context holds "
                               f"{self.max_context} tokens, prompt and answer together", param=request.prompt_field,
                               code="context_length_exceeded")
        max_new = min(request.max_tokens or self.config.default_max_tokens, self.max_context - len(prompt))
        state = self._admit(request.session_id)
        state.pending += 1
        try:
            await state.lock.acquire()
        except BaseException:
            state.pending -= 1
            raise
        generation = Generation(asyncio.get_running_loop(), len(prompt))
        job = functools.partial(self._run, state, hosted, prompt, max_new, request, generation, arrival)
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

    def _admit(self, session_id: str | None) -> SessionState:
        now = time.monotonic()
        for key, state in list(self._sessions.items()):
            if state.idle() and now - state.last_used > self.config.session_ttl_s:
                self._evict(key, "ttl")
        if session_id is None:  # stateless: a session of its own, forgotten afterwards
            return SessionState(None, self._new_session())
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
                                self.config.handover, self.plan)

    def _evict(self, key: str, reason: str) -> None:
        del self._sessions[key]
        self.metrics.evictions.labels(reason=reason).inc()

    def _finish(self, state: SessionState, generation: Generation) -> None:
        """A request of ``state`` ended (event loop): release its session and keep the cache memory in bounds."""
        self._running.discard(generation)
        state.pending -= 1
        state.last_used = time.monotonic()
        state.lock.release()
        total = self.cache_bytes()
        for key, candidate in list(self._sessions.items()):
            if total <= self.config.cache_memory_bytes:
                break
            if candidate.idle():
                total -= candidate.bytes
                self._evict(key, "memory")

    # -- compute (the model's worker thread) ----------------------------------------------------------------------
    def _prompt_ids(self, hosted: HostedModel, request: GenerationRequest) -> list[int]:
        tokenizer = hosted.tokenizer
        if request.messages is not None:
            messages = [{"role": role, "content": text} for role, text in request.messages]
            template = None if getattr(tokenizer, "chat_template", None) else CHATML_TEMPLATE
            try:
                text = tokenizer.apply_chat_template(messages, chat_template=template, add_generation_prompt=True,
                                                     tokenize=False)
            except Exception as exc:  # the model's template refuses this conversation (e.g. role order)
                raise RequestError("invalid_request", f"the chat template cannot render these messages: {exc}",
                                   param="messages") from exc
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if isinstance(request.prompt, str):
            return list(tokenizer(request.prompt)["input_ids"])
        ids = list(request.prompt or ())
        if any(not 0 <= token < hosted.vocab_size for token in ids):
            raise RequestError("invalid_request", f"token ids must be in 0..{hosted.vocab_size - 1}", param="prompt")
        return ids

    def _run(self, state, hosted, prompt, max_new, request, generation, arrival) -> None:
        session = state.session
        try:
            if generation.cancelled.is_set():
                raise RequestError("cancelled", "the client went away before the request was served")
            with torch.inference_mode():
                report, logprobs = self._prepare(session, hosted.name, prompt, request.handoff_mode)
                self.metrics.record_first_token(report.to_dict(), time.perf_counter() - arrival)
                generation.post("ready", report)
                self._decode(session, hosted, logprobs, len(prompt), max_new, request, generation)
        except Exception as exc:  # the session may be half-way through a change: forget it rather than serve stale KV
            with contextlib.suppress(Exception):
                session.truncate(0)
            error = exc if isinstance(exc, RequestError) else RequestError("internal", f"{type(exc).__name__}: {exc}")
            generation.post("error", error)
        finally:
            state.bytes = session.cache_bytes() if state.id is not None else 0
            generation.call_soon(functools.partial(self._finish, state, generation))

    def _prepare(self, session: SwitchingSession, server: str, prompt: list[int], mode: str = "auto"):
        """Bring ``server``'s cache of the session up to ``prompt``; returns (report, log-probs of the next token).
        At a switch with ``mode`` "reprefill" the model re-prefills the whole conversation instead of mapping."""
        started = time.perf_counter()
        common = min(common_prefix(session.tokens, prompt), len(prompt) - 1)
        session.truncate(common)
        new = prompt[common:]
        previous = session.owner
        mapped = common - session.cached_length(server) if previous not in (None, server) else 0
        status, source, guard = "none", None, None
        if mapped > 0 and mode == "reprefill":
            status, source, mapped = "reprefill", previous, 0
            session.tokens += new  # read by the prefill below, with the rest of the conversation
            logprobs = session.reprefill(server)[None]
        elif mapped > 0:
            status, source = "applied", previous
            config = self.config
            keep, reference = 1, None
            if config.guard:
                keep = config.guard_window
                if needs_reference(config.guard_signal):
                    reference = reference_logprobs(self._models[previous].model, session.cache(previous), new,
                                                   keep)
            logprobs = session.read_logprobs(server, new, keep)
            if config.guard:
                score = guard_score(config.guard_signal, logprobs, reference, new, mapped / common)
                guard = {"signal": config.guard_signal, "score": score, "threshold": float(config.guard_threshold)}
                if score is not None and score > config.guard_threshold:
                    status = "fallback"
                    logprobs = session.reprefill(server)[None]
        else:
            logprobs = session.read_logprobs(server, new)
        prefilled = status in ("fallback", "reprefill")  # the whole conversation was read again
        report = HandoffReport(status, source, server, mapped, len(prompt) if prefilled else len(new),
                               0 if prefilled else common, len(prompt), guard,
                               round((time.perf_counter() - started) * 1000, 3))
        return report, logprobs[-1]

    def _decode(self, session, hosted, logprobs, prompt_length, max_new, request, generation) -> None:
        """Token by token on the session's cache: stop at an end id, a stop string, ``max_new`` tokens, or a cancel."""
        generator = make_generator(request.seed)
        answer: list[int] = []
        text, sent, finish = "", 0, "length"
        for step in range(max_new):
            token = choose_token(logprobs, request.temperature, request.top_p, generator)
            if token in hosted.stop_ids:
                finish = "stop"
                break
            answer.append(token)
            text = hosted.tokenizer.decode(answer, skip_special_tokens=True)
            cut = stop_index(text, request.stop, sent) if request.stop else None
            if cut is not None:
                text, finish = text[:cut], "stop"
                break
            ready = len(text) - held_back(text, request.stop)
            if ready > sent:
                generation.post("delta", text[sent:ready], len(answer))
                sent = ready
            if generation.cancelled.is_set():
                keep = min(len(session.tokens), prompt_length + generation.delivered)
                session.truncate(keep)  # what the client received, no more
                self.metrics.cancelled.inc()
                generation.post("done", "cancelled", len(answer))
                return
            if step + 1 < max_new:
                logprobs = session.read_logprobs(hosted.name, [token])[-1]
        if len(text) > sent:
            generation.post("delta", text[sent:], len(answer))
        generation.post("done", finish, len(answer))
