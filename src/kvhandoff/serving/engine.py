"""The serving engine: the hosted family, admission, and each request's job on its model's worker. No HTTP here: the
routes (`app.py`) turn requests into `GenerationRequest`s (`requests.py`) and `RequestError`s into status codes;
named sessions live in `sessions.py`, the scheduler in `worker.py`, prompts in `prompts.py`, answers in
`answers.py`.

A conversation is a `SwitchingSession`: its token ids and each model's cache of them. A request names a model and
brings the whole conversation (chat template applied). A request that names a session (within its tenant) is served
on that session: the engine finds the longest common token prefix with what the session has cached, rolls every
cache back to it (an edited or dropped turn is never served from stale KV), and the model reads only the rest. A
request that names none is served from the prefix cache (`prefix_cache.PrefixCache`): a fresh session is filled
with what each model holds of its prompt, and what the request adds is kept there afterwards. Either way, when
another model served the conversation last (or holds more of it), the conversation is handed over: the history is
mapped (incrementally: only what this model has not cached), the new turn is read by the receiving model itself,
and the pair's quality guard may reject the mapped cache — the runtime's `serve_turn` under each ordered pair's
`PairPolicy` (`kvhandoff.runtime.switch`), resolved when the engine starts.

Threads: the event loop only admits requests and relays events; each model's compute runs on that model's worker
thread (`ModelWorker`), which schedules the requests it holds: their decode steps share one forward, their prompts
are read in chunks between the steps. Requests of one named session are serialised in arrival order by the
session's lock, held until its generation ends. The guard's reference pass runs the previous model on the
receiving model's worker (a forward of the new turn only; eval-mode forwards share no state).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Iterable
from dataclasses import replace

import torch

from kvhandoff.errors import ConfigError
from kvhandoff.runtime.llama_cpp.backend import LlamaCppModel
from kvhandoff.runtime.prefix_store import PrefixStore
from kvhandoff.runtime.rebase import rebase
from kvhandoff.runtime.runs import RunIndex
from kvhandoff.runtime.seam import capabilities_of
from kvhandoff.runtime.session import SwitchingSession
from kvhandoff.runtime.switch.pair import PairPolicy, pair_policies
from kvhandoff.runtime.switch.turn import TURN_MODES, TurnCancelled, serve_turn
from kvhandoff.serving.answers import answers, echo
from kvhandoff.serving.decoding import GenerationDefaults, end_ids, generation_config_defaults
from kvhandoff.serving.healing import Healer
from kvhandoff.serving.metrics import ServingMetrics
from kvhandoff.serving.prefix_cache import PrefixCache
from kvhandoff.serving.prefix_tree import DEFAULT_NAMESPACE
from kvhandoff.serving.prompts import MESSAGE_OPENERS, family_template, message_anchor_ids, request_inputs, too_long
from kvhandoff.serving.requests import Generation, GenerationRequest, RequestError, refuse_large_logprobs
from kvhandoff.serving.sessions import SessionState, SessionTable
from kvhandoff.serving.settings import ServeConfig
from kvhandoff.serving.tools import tool_parser
from kvhandoff.serving.worker import HostedModel, ModelWorker, Read

logger = logging.getLogger(__name__)


def _window(model) -> int:
    """The tokens one conversation may reach on ``model``: its context window, and for a llama.cpp model the cells
    its context holds, less room for a handoff's import."""
    window = model.config.max_position_embeddings
    if isinstance(model, LlamaCppModel):
        window = min(window, model.settings.context // 2)
    return window


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


def _run_index(config: ServeConfig, models) -> RunIndex | None:
    """The index of runs reused at another offset, anchored at the tokens that open a chat message; None when the
    settings turn it off or the family's tokenizer has no such token (said in the log)."""
    if not config.switch.offset_reuse:
        return None
    tokenizer = next(iter(models.values()))[1]
    anchors = message_anchor_ids(tokenizer)
    if not anchors:
        logger.info("no reuse at another offset: the tokenizer has none of %s to anchor runs at",
                    ", ".join(MESSAGE_OPENERS))
        return None
    return RunIndex(anchors)


def _announce(hosted: Iterable[HostedModel], policies: Iterable[PairPolicy], guard: bool) -> None:
    """Say at start-up which models' generation configs give the defaults of requests that leave fields out, and what
    each pair's switches do: its recompute policy, then its guard (a pair without a guard, or whose record was
    measured under other settings, at WARNING)."""
    for model in hosted:
        defaults = model.generation_defaults
        if defaults:
            logger.info("%s: a request that leaves them out gets its generation config's sampling %s and max_tokens %s "
                        "(--generation-config vllm: the server's own defaults)", model.name, defaults.sampling,
                        defaults.max_tokens or "as the server's")
    policies = list(policies)
    for policy in policies:
        logger.info("%s", policy.describe()[0])
    if not guard:
        logger.info("the quality guard is off (--guard off): every switch is served mapped")
        return
    for policy in policies:
        level = logging.WARNING if not policy.guard.active or policy.guard.note else logging.INFO
        logger.log(level, "%s", policy.describe()[1])


class Engine:
    """Serves a model family: ``models`` name → (model, tokenizer) (one tokenizer's ids), ``mappers`` (from, to) →
    `Mapper` for every ordered pair of names, under ``config``'s limits. Use from one asyncio event loop.

    ``policies``: each ordered pair's `PairPolicy` (`pair_policies` of ``config.switch``, the mappers' records and
    what the hosted models' backends can do), built here once and logged; a turn is served by the runtime's
    `serve_turn` under them."""

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
                                          config.max_batch),
                              generation_config_defaults(model, name) if config.generation_config == "auto"
                              else GenerationDefaults())
            for name, (model, tokenizer) in models.items()
        }
        self.chat_template = family_template(models)
        self.tool_parser = tool_parser(config.tool_parser)  # reads tool calls out of every answer
        self.prefix_store = PrefixStore()  # the conversations' openings, per tenant: a switch copies its exact prefix
        # the conversations that name no session, found by their tokens (and their runs at another offset)
        runs = _run_index(config, models)  # a run reused at another offset keeps its beginning in the tenant's store
        self.prefix_cache = PrefixCache(runs=runs, offset_plan=lambda namespace: config.switch.offset_plan(
            self.prefix_store.within(namespace)))
        self.anchor_ids = None if runs is None else runs.anchor_ids  # where a named session's runs may start
        self.plan = config.switch.plan(self.prefix_store)  # every session's handoffs, each pair's recompute its own
        self.policies: dict[tuple[str, str], PairPolicy] = pair_policies(
            config.switch, self._mappers, self.prefix_store, lambda name: capabilities_of(models[name][0]))
        _announce(self._models.values(), self.policies.values(), config.switch.guard)
        self._running: set[Generation] = set()  # admitted and not finished
        self.draining = False  # shutting down: no new request is admitted
        self.sessions = SessionTable(config, self._new_session, self.metrics, self._refuse_if_draining)
        self.healer = Healer(config.heal, self.metrics, self.prefix_cache, self.sessions, self._new_session)
        self.metrics.track(lambda: len(self.sessions), self.cache_bytes)
        self.metrics.track_prefix_cache(self.prefix_cache.tree.stats)

    # -- state ----------------------------------------------------------------------------------------------------
    def model_names(self) -> list[str]:
        return list(self._models)

    def session_count(self) -> int:
        return len(self.sessions)

    def cache_bytes(self) -> int:
        """Bytes of KV cache held: the named sessions', the prefix cache's and the openings store's (all under
        ``config.cache_memory_bytes``)."""
        return self.sessions.bytes() + self.prefix_cache.tree.total_bytes() + self.prefix_store.bytes()

    def hosted(self, name: str) -> HostedModel:
        """The hosted model ``name``, or a not-found `RequestError` listing the served names."""
        hosted = self._models.get(name)
        if hosted is None:
            raise RequestError("not_found", f"the model {name!r} does not exist; this server hosts "
                               f"{', '.join(self._models)}", param="model", code="model_not_found")
        return hosted

    def generation_defaults(self, name: str) -> GenerationDefaults:
        """The sampling fields and answer limit a request to model ``name`` gets when it leaves them out
        (`decoding.generation_config_defaults`; none for a name not hosted, refused later)."""
        hosted = self._models.get(name)
        return GenerationDefaults() if hosted is None else hosted.generation_defaults

    def mapper_id(self, source: str, target: str) -> str:
        """The identity of the mapper from ``source`` to ``target``: its manifest's checksum."""
        return self._mappers[source, target].manifest.checksum()

    def session_tokens(self, session_id: str, namespace: str = DEFAULT_NAMESPACE) -> list[int] | None:
        """The token ids a session has cached (None: no such session in ``namespace``)."""
        state = self.sessions.state(namespace, session_id)
        return None if state is None else list(state.session.tokens)

    def liveness(self) -> dict:
        """What a probe without a key sees (a keyed server with open probes): status, per model the requests queued,
        generations running and cancelling — nothing of what the tenants' caches hold."""
        return {"status": "draining" if self.draining else "ok",
                "models": {name: {"queued": hosted.worker.queued()} for name, hosted in self._models.items()},
                "running": len(self._running), "cancelling": sum(g.cancelled.is_set() for g in self._running)}

    def health(self) -> dict:
        """Liveness and load: status ("ok", or "draining" while shutting down), per model the requests queued, the
        named sessions, cache bytes (sessions, prefix cache, openings store), generations running and those cancelled
        (their client went away) that have not stopped yet; per ordered pair ("from → to") its quality guard
        (`GuardPolicy.to_dict`: source "recorded" | "configured" | "none", signal, threshold) and its recompute
        policy (`ServedRecompute.to_dict`: policy, source "configured" | "recorded" | "default"); the prefix store's
        and the prefix cache's figures (`prefix_tree_stats.TreeStats`); reuse at another offset (None: off): its
        recompute policy and the conversations indexed; healing (`healing.Healer.status`): its budget and chunk, and
        per model the conversations waiting to be healed."""
        return {**self.liveness(), "sessions": len(self.sessions), "cache_bytes": self.cache_bytes(),
                "guard": {policy.name: policy.guard.to_dict() for policy in self.policies.values()},
                "recompute": {policy.name: policy.recompute.to_dict() for policy in self.policies.values()},
                "prefix_store": {"openings": len(self.prefix_store), "bytes": self.prefix_store.bytes(),
                                 "hits": self.prefix_store.hits, "misses": self.prefix_store.misses},
                "prefix_cache": self.prefix_cache.tree.stats().to_dict(),
                "offset_reuse": self.prefix_cache.offset_status(), "healing": self.healer.status(self._models)}

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
        if request.handoff_mode not in TURN_MODES:
            raise RequestError("invalid_request", f"kv_handoff.mode must be one of {', '.join(TURN_MODES)}, got "
                               f"{request.handoff_mode!r}", param="kv_handoff.mode")
        limit = request.max_tokens
        if limit is None:
            limit = hosted.generation_defaults.max_tokens or self.config.default_max_tokens
        refuse_large_logprobs(request, min(limit, self.max_context))  # before any work
        prompt, constraints = await asyncio.to_thread(request_inputs, hosted, request, self.chat_template,
                                                     self.max_context)
        if not prompt:
            raise RequestError("invalid_request", "the prompt is empty", param=request.prompt_field)
        if len(prompt) >= self.max_context:
            raise too_long(request.prompt_field, self.max_context, len(prompt))
        max_new = min(limit, self.max_context - len(prompt))
        refuse_large_logprobs(request, max_new, len(prompt) if request.echo else 0)
        self._refuse_if_draining()  # it may have begun while the prompt was built
        state = await self.sessions.admit_waiting(request.session_id, request.namespace)
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

    def _new_session(self, namespace: str = DEFAULT_NAMESPACE) -> SwitchingSession:
        """A conversation of ``namespace``: its handoffs copy and keep exact prefixes in that tenant's share of the
        openings store only."""
        store = self.prefix_store.within(namespace)
        return SwitchingSession({name: hosted.model for name, hosted in self._models.items()}, self._mappers,
                                self.config.handover, replace(self.plan, prefix_store=store),
                                pair_plans={pair: replace(policy.plan, prefix_store=store)
                                            for pair, policy in self.policies.items()})

    def _finish(self, state: SessionState, generation: Generation, hosted: HostedModel | None = None,
                kept: tuple[str, list[int]] | None = None) -> None:
        """A request of ``state`` ended (event loop): release its session, keep the cache memory in bounds (the
        prefix cache's least recently used leaves first, then idle sessions, then the openings store's least
        recently used openings) and have ``hosted``, the model that served it, heal its conversation (``kept``: the
        namespace and tokens the prefix cache kept of it)."""
        self._running.discard(generation)
        self.sessions.release(state)
        limit = self.config.cache_memory_bytes
        self.prefix_cache.tree.evict(max(0, limit - self.sessions.bytes() - self.prefix_store.bytes()))
        self.sessions.trim(self.cache_bytes(), limit)
        self.prefix_store.trim(max(0, limit - self.sessions.bytes() - self.prefix_cache.tree.total_bytes()))
        if hosted is not None and not self.draining:
            self.healer.after(state, hosted, *(kept or ("", [])))

    # -- compute (the model's worker thread) ----------------------------------------------------------------------
    def _step(self, server: str, reads: list[Read]) -> torch.Tensor:
        """One decode step of several requests on ``server``: log-probs [n, vocab]."""
        return SwitchingSession.read_together(server, [(read.session, read.token) for read in reads])

    def _run(self, state, hosted, prompt, max_new, request, generation, arrival, constraints):
        """A request's job on its model's worker (a generator: see `ModelWorker`)."""
        session, checkout, kept = state.session, None, None
        try:
            if generation.cancelled.is_set():
                raise RequestError("cancelled", "the client went away before the request was served")
            if state.id is None:
                checkout = self.prefix_cache.checkout(request.namespace, prompt, hosted.name, session,
                                                      exact_only=request.handoff_mode == "exact",
                                                      offset=request.handoff_mode == "auto")
            elif self.anchor_ids is not None and request.handoff_mode == "auto":  # a beginning that changed
                rebase(session, hosted.name, prompt, self.anchor_ids, self.prefix_cache.offset_plan(request.namespace))
            try:
                report, logprobs = yield from serve_turn(session, hosted.name, prompt, self.policies,
                                                         request.handoff_mode, self.config.prefill_chunk,
                                                         generation.cancelled)
            except TurnCancelled as exc:
                raise RequestError("cancelled", str(exc)) from None
            self.metrics.record_first_token(report.to_dict(), time.perf_counter() - arrival)
            if request.echo:
                generation.echo = yield from echo(hosted, request, prompt)
            generation.post("ready", report)
            yield from answers(session, hosted, logprobs, prompt, max_new, request, generation, constraints,
                               self.metrics)
            if checkout is not None:  # before the answer ends: the client's next turn finds it
                self.prefix_cache.checkin(checkout, session, report)
                kept = (request.namespace, session.tokens[:session.cached_length(hosted.name)])
            generation.post("end")
        except Exception as exc:
            if isinstance(exc, RequestError) and exc.kind == "cancelled":  # before its first token: the session whole
                self.metrics.cancelled.inc()  # (a cancel while it answers is counted by `answers`)
            else:
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
            generation.call_soon(functools.partial(self._finish, state, generation, hosted, kept))
