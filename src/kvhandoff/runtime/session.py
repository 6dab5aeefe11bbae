"""A conversation served by several models in turn: each switch hands the conversation over by mapping the
cache (`handoff`), never by re-prefilling it."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kvhandoff.errors import ConfigError
from kvhandoff.runtime.handoff import MappedCache, catch_up, check_context, map_for_target, verify_mapper
from kvhandoff.runtime.plan import DEFAULT_PLAN, HandoffPlan
from kvhandoff.runtime.policy import SelectionInfo
from kvhandoff.runtime.recompute import read_turn
from kvhandoff.runtime.seam import CacheFactory, KVCache, new_cache

#: how a conversation is handed over at a switch: "all" — the current server's whole cache is mapped for the new
#: server; "incremental" — every model keeps its own cache and only the positions it has not cached are mapped
HANDOVERS = ("all", "incremental")


@dataclass(frozen=True)
class _Handover:
    """What a handover changed, so that it can be taken back (`SwitchingSession.undo_handover`): from ``source`` to
    ``target`` at ``at`` tokens of the conversation; ``held`` / ``own``: the positions the target's cache held, and
    its own exact ones, before it (held None: it had no cache)."""

    source: str
    target: str
    at: int
    held: int | None
    own: int


def _check_keep(keep) -> None:
    """ConfigError unless ``keep`` (how many of a read's last positions to return) is a positive integer."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ConfigError(f"keep must be a positive integer, got {keep!r}")


class SwitchingSession:
    """One conversation served by several models in turn (a router switching between them at turn boundaries).

    models: name → model (one family, one tokenizer); mappers: (from name, to name) → `Mapper`.
    handover: see `HANDOVERS` ("incremental": a model returning to the conversation keeps its cache and catches
    up on the turns it missed, so no position is mapped twice). plan: the `HandoffPlan` of every handover (None:
    `DEFAULT_PLAN`): the exact prefix a model recomputes itself the first time it is handed the conversation, the
    recompute policy by which the receiving model recomputes a share of the positions just mapped for it, and the
    `PrefixStore` the models' exact prefixes are copied from and kept in (shared by the sessions of one server,
    whose conversations open alike). pair_plans: (from name, to name) → the `HandoffPlan` of that pair's handovers
    instead (e.g. a recompute policy chosen per pair). The session knows where each turn (each `read`, each
    generated answer) starts, for "sinks". Each model's cache sits behind the cache seam (`KVCache`); cache_factory
    makes a model's fresh one, ``cache_factory(model)`` (`CacheFactory`; default `new_cache`: the model's own
    engine's): at its first turn, at a re-prefill, and when a handover maps the conversation for it — always by the
    model's own engine, never of the kind of the cache it is mapped from.

    `read(server, ids)` lets ``server`` read the next tokens of the conversation, switching to it first when
    another model served last; `generate(server, ids, ...)` also answers, and the answer joins the conversation.
    A caller may decode from `cache(server)` itself: what it decodes past `tokens` (what every cache agrees on)
    is dropped before the conversation goes on (`rollback`). A handover whose result is not to be trusted can be
    taken back while the turn it served is the conversation's last (`undo_handover`), and made again under another
    plan (``plan`` of `read_logprobs`).

    The session knows which leading positions of each model's cache the model computed itself over the exact
    conversation (`own_length`): what it read or generated on a cache that held only positions of its own — never
    a mapped position, nor one read on top of one (a cache handed over fresh counts as mapped from its first
    position on). A re-prefill keeps those and reads only the rest (`reprefill`).

    Every mapper is checked against its two models when the session starts (MapperMismatchError for a wrong
    pair), and a turn that would take the conversation past a model's context window is refused before any
    work (ContextTooLongError).
    """

    def __init__(self, models, mappers, handover: str = "incremental", plan: HandoffPlan | None = None, *,
                 cache_factory: CacheFactory = new_cache,
                 pair_plans: Mapping[tuple[str, str], HandoffPlan] | None = None) -> None:
        if handover not in HANDOVERS:
            raise ConfigError(f"handover must be one of {', '.join(HANDOVERS)}, got {handover!r}")
        pair_plans = dict(pair_plans or {})
        for given in (plan, *pair_plans.values()):
            if given is not None and not isinstance(given, HandoffPlan):
                raise ConfigError(f"a session's plan is a HandoffPlan (HandoffPlan.of reads the settings), got "
                                  f"{given!r}")
        unknown = [pair for pair in pair_plans if pair not in mappers]
        if unknown:
            raise ConfigError(f"pair_plans name pairs without a mapper: {unknown}")
        self.models, self.mappers = dict(models), dict(mappers)
        for (source, target), mapper in self.mappers.items():
            unknown = [name for name in (source, target) if name not in self.models]
            if unknown:
                raise ConfigError(f"mapper {source} → {target} names unknown model(s) {unknown}; the session "
                                  f"serves {', '.join(self.models)}")
            verify_mapper(mapper, self.models[source], self.models[target])
        self.handover, self.plan, self.cache_factory = handover, plan or DEFAULT_PLAN, cache_factory
        self.pair_plans = pair_plans
        self._turn_starts: list[int] = []  # where each read turn and each generated answer began
        self.tokens: list[int] = []
        self.owner: str | None = None  # the model that read the conversation last
        self._caches: dict[str, KVCache] = {}
        # per model: the leading positions of its cache it computed itself over the exact conversation
        self._own: dict[str, int] = {}
        self._handover: _Handover | None = None  # the last handover, while it can be taken back

    def plan_for(self, source: str, target: str) -> HandoffPlan:
        """The plan of a handover from ``source`` to ``target``: the pair's own (``pair_plans``), else the session's."""
        return self.pair_plans.get((source, target), self.plan)

    def require_model(self, server: str) -> None:
        """ConfigError unless ``server`` is one of the session's models."""
        if server not in self.models:
            raise ConfigError(f"unknown model {server!r}; the session serves {', '.join(self.models)}")

    def cache(self, server: str):
        """``server``'s cache of the conversation as its engine holds it (`KVCache.native`; None before it has
        one)."""
        kv = self._caches.get(server)
        return None if kv is None else kv.native

    def cached_length(self, server: str) -> int:
        """Positions ``server``'s cache holds (0 before it has one)."""
        kv = self._caches.get(server)
        return 0 if kv is None else kv.length

    def own_length(self, server: str) -> int:
        """The leading positions of ``server``'s cache that it computed itself over the exact conversation (read or
        generated on a cache of its own positions only; never mapped, nor read on top of a mapped position):
        exactly what a prefill of them would hold. 0 before it has a cache."""
        return min(self._own.get(server, 0), self.cached_length(server))

    def _grown(self, server: str, before: int) -> None:
        """``server``'s cache grew from ``before`` positions by its own forward: the new positions are its own
        (exact) when everything before them was."""
        if self._own.get(server, 0) >= before:
            self._own[server] = self._caches[server].length

    def switch_to(self, server: str):
        """Make ``server`` the owner; returns its cache of `tokens` (as `cache` does: mapped as `handover` says,
        the positions the model recomputes after a handover already recomputed)."""
        mapped = self._switch(server)
        if mapped is not None:
            mapped.settle(self.models[server])
        return self.cache(server)

    def _switch(self, server: str, upcoming=(), plan: HandoffPlan | None = None,
                source_turn_read: torch.Tensor | None = None) -> MappedCache | None:
        """Make ``server`` the owner; at a handover, its cache of `tokens` as a `MappedCache` whose recompute (the
        exact prefix, the policy's picks) is left to the model's next forward (`MappedCache.read`); else None.
        ``upcoming``: the tokens it reads next (the new turn), which a policy may pick positions by; ``plan``: the
        handover's plan instead of the pair's (`plan_for`); ``source_turn_read``: the previous owner's attention
        over `tokens` while it read ``upcoming`` (`SelectionInfo.source_turn_read`), when the caller read it."""
        self.require_model(server)
        owner = self.owner
        for name in (owner, server):
            if name in self._caches:
                self.rollback(name)
        if owner is not None and server != owner:
            mapper = self.mappers.get((owner, server))
            if mapper is None:
                raise ConfigError(f"no mapper for the handoff {owner} → {server}")
            if self.handover == "incremental":
                current = self._caches[owner]
            else:
                current = self._caches.pop(owner)
                self._own.pop(owner, None)
            ids = torch.tensor([self.tokens], device=current.device)
            plan = plan or self.plan_for(owner, server)
            held = self._caches[server].length if server in self._caches else None
            self._handover = _Handover(owner, server, len(self.tokens), held, self._own.get(server, 0))
            info = SelectionInfo(turn_starts=tuple(p for p in self._turn_starts if p < len(self.tokens)),
                                 new_turn=tuple(upcoming), source_turn_read=source_turn_read)
            if server in self._caches:  # the positions appended are mapped: its own prefix stays as it was
                mapped = catch_up(self._caches[server], current, mapper, self.models[owner], self.models[server],
                                  ids, plan, info)
            else:  # mapped from the start: nothing of it is its own (its exact prefix is recomputed in place)
                mapped = map_for_target(self.models[owner], self.models[server], mapper, ids, plan, current,
                                        info, cache_factory=self.cache_factory)
                self._caches[server] = mapped.cache
                self._own[server] = 0
            self.owner = server
            return mapped
        self.owner = server
        return None

    def _read_on(self, server: str, ids: list[int], keep: int, upcoming=None,
                 plan: HandoffPlan | None = None, source_turn_read: torch.Tensor | None = None) -> torch.Tensor:
        """``server`` reads ``ids`` on its cache of the conversation, switching to it first (at a handover the
        recompute and the read are one forward; ``upcoming``: the whole new turn when ``ids`` is its first part;
        ``plan``: the handover's, instead of the pair's; ``source_turn_read``: as in `_switch`); logits of the last
        ``keep`` of them [1, keep, vocab]."""
        mapped = self._switch(server, ids if upcoming is None else upcoming, plan, source_turn_read)
        model = self.models[server]
        input_ids = torch.tensor([ids], device=model.device)
        cache = mapped.cache if mapped is not None else self._own_cache(server)
        before = cache.length
        logits = mapped.read(model, input_ids, keep) if mapped is not None else cache.read(model, input_ids, keep)
        self._grown(server, before)
        return logits

    def _own_cache(self, server: str) -> KVCache:
        """``server``'s cache, an empty one before the conversation's first turn."""
        if server not in self._caches:
            self._caches[server] = self.cache_factory(self.models[server])
            self._own[server] = 0
        return self._caches[server]

    @torch.inference_mode()
    def read(self, server: str, ids) -> torch.Tensor:
        """``server`` reads ``ids`` (the conversation's next tokens); float32 log-probs of the token after them."""
        ids = list(ids)
        if not ids:
            raise ConfigError("read needs at least one token")
        self._check_length(server, len(ids))
        logits = self._read_on(server, ids, 1)
        self._mark_turns(len(self.tokens))
        self.tokens += ids
        return logits[0, -1].float().log_softmax(-1)

    @torch.inference_mode()
    def generate(self, server: str, ids, **generate_kwargs) -> list[int]:
        """``server`` reads ``ids`` (the new turn) and generates its answer with ``model.generate``
        (generate_kwargs: max_new_tokens, do_sample, ...). The answer joins the conversation: every generated
        token is cached and appended to `tokens`. Returns the generated token ids."""
        ids = list(ids)
        if not ids:
            raise ConfigError("generate needs at least one token of the new turn")
        self._check_length(server, len(ids))
        mapped = self._switch(server, ids)
        model = self.models[server]
        input_ids = torch.tensor([self.tokens + ids], device=model.device)
        if mapped is not None:  # at a handover, generate's first forward also recomputes (`MappedCache.generate`)
            cache = mapped.cache
            before = cache.length
            out = mapped.generate(model, input_ids, **generate_kwargs)
        else:  # on the conversation's first turn generate prefills it
            cache = self._own_cache(server)
            before = cache.length
            out = cache.generate(model, input_ids, **generate_kwargs)
        answer = out[0, input_ids.shape[1]:].tolist()
        self._mark_turns(len(self.tokens), input_ids.shape[1])  # the turn read, then the answer
        everything = out[0].tolist()
        missing = everything[cache.length:]  # generate does not feed its last token back
        if missing:
            cache.read(model, torch.tensor([missing], device=model.device))
        self._grown(server, before)
        self.tokens = everything
        return answer

    def _mark_turns(self, *starts: int) -> None:
        """Record where turns start (positions past the current conversation, e.g. after a rollback, are dropped)."""
        self._turn_starts = [p for p in self._turn_starts if p < len(self.tokens)] + list(starts)

    def _check_length(self, server: str, new: int) -> None:
        """Refuse a turn that takes the conversation past ``server``'s context window, before anything runs."""
        self.require_model(server)
        check_context(len(self.tokens) + new, self.models[server])

    def rollback(self, server: str) -> None:
        """Drop what ``server``'s cache holds past `tokens` (e.g. an answer the caller decoded and will feed back
        later as part of the next turn)."""
        cache = self._caches[server]
        if cache.length > len(self.tokens):
            cache.truncate(len(self.tokens))
        self._own[server] = min(self._own.get(server, 0), cache.length)

    # -- for a server (kvhandoff.serving): roll back to a common prefix, read with scores, re-prefill, size ---------
    def truncate(self, length: int) -> None:
        """Roll the conversation back to its first ``length`` tokens (e.g. the prefix an edited history shares with
        the cached one): `tokens` and every cache are cut there; a cache that is already shorter (a model that
        missed later turns) is kept as it is. ``length`` 0 forgets the conversation and every cache."""
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= len(self.tokens):
            raise ConfigError(f"truncate length must be in 0..{len(self.tokens)}, got {length!r}")
        self.tokens = self.tokens[:length]
        if self._handover is not None and length < self._handover.at:
            self._handover = None
        if length == 0:
            self._caches.clear()
            self._own.clear()
            self.owner = None
            return
        for name, cache in self._caches.items():
            if cache.length > length:
                cache.truncate(length)
            self._own[name] = min(self._own.get(name, 0), cache.length)

    def undo_handover(self) -> None:
        """Take back the last handover, while the model it went to is still the owner and the conversation has not
        been cut back past it: the conversation returns to where the handover happened, the receiving model's cache
        to what it held before (none, if it had none) and the previous model becomes the owner again. Its next read
        hands over again, e.g. under a larger recompute budget (``plan`` of `read_logprobs`). ConfigError when there
        is nothing to take back (and always under handover "all", where the previous model's cache was given
        away)."""
        last = self._handover
        if self.handover != "incremental":
            raise ConfigError("a handover can only be taken back under handover 'incremental' (under 'all' the "
                              "previous model's cache is given away at the switch)")
        if last is None or self.owner != last.target or last.source not in self._caches:
            raise ConfigError("no handover to take back: the last model to read was not handed the conversation, "
                              "or the conversation was cut back past the switch since")
        self.truncate(last.at)
        if last.held is None:
            del self._caches[last.target]
            self._own.pop(last.target, None)
        else:
            self._caches[last.target].truncate(last.held)
            self._own[last.target] = min(last.own, last.held)
        self.owner, self._handover = last.source, None

    @torch.inference_mode()
    def preview_turn(self, server: str, ids, keep: int = 1,
                     attention: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The owner reads ``ids`` (the turn ``server`` reads next) on its cache of `tokens` and forgets them again
        (its cache is left as it was): the float32 log-probs of the last ``keep`` positions [min(keep, len(ids)),
        vocab] and the attention it paid each position of `tokens` [1, T] (`recompute.read_turn`; the cache exported
        by its engine), or None. The attention is read when ``attention`` says so, by default when the handover to
        ``server`` ranks by it (`RecomputePolicy.ranks_by_source_turn_read` of its plan); `read_logprobs` takes it
        as ``source_turn_read``: one forward serves a guard's reference and the policy's ranking."""
        ids = list(ids)
        if self.owner is None or not ids:
            raise ConfigError("preview_turn needs a conversation with an owner and at least one token to read")
        _check_keep(keep)
        if attention is None:
            attention = self.plan_for(self.owner, server).recompute.ranks_by_source_turn_read
        self.rollback(self.owner)
        model, kv, keep = self.models[self.owner], self._caches[self.owner], min(keep, len(ids))
        turn = torch.tensor([ids], device=kv.device)
        if attention:
            read = read_turn(model, kv.export(), turn, keep)
            return read.logprobs[0], read.scores
        length = kv.length
        logits = kv.read(model, turn, keep)
        kv.truncate(length)
        return logits[0].float().log_softmax(-1), None

    @torch.inference_mode()
    def read_logprobs(self, server: str, ids, keep: int = 1, upcoming=None,
                      plan: HandoffPlan | None = None, source_turn_read: torch.Tensor | None = None) -> torch.Tensor:
        """As `read`, but returns the float32 log-probs of the last ``keep`` positions of ``ids`` [min(keep,
        len(ids)), vocab] (row i: the distribution of the token after that position); only those logits are
        computed. ``upcoming``: the whole new turn when ``ids`` is only its first part (a prompt read in chunks),
        for a recompute policy that picks positions by it; ``plan``: the plan of a handover this read makes,
        instead of the pair's (`plan_for`); ``source_turn_read``: the previous owner's attention over the
        conversation while it read the new turn (`preview_turn`), for a policy that ranks by it."""
        ids = list(ids)
        if not ids:
            raise ConfigError("read_logprobs needs at least one token")
        _check_keep(keep)
        logits = self._read_on(server, ids, min(keep, len(ids)), upcoming, plan, source_turn_read)
        self.tokens += ids
        return logits[0].float().log_softmax(-1)

    @staticmethod
    @torch.inference_mode()
    def read_together(server: str, reads) -> torch.Tensor:
        """``server`` reads one more token in each of several sessions, in one forward where its engine batches
        (`KVCache.read_batch`): ``reads`` (session, token id) pairs, ``server`` already the owner of each (no
        handover pending: a decode step). Returns the float32 log-probs of the token after each [n, vocab]."""
        reads = list(reads)
        if not reads:
            raise ConfigError("read_together needs at least one (session, token) pair")
        model = reads[0][0].models[server]
        for session, _ in reads:
            if session.owner != server or session.models[server] is not model or server not in session._caches:
                raise ConfigError(f"read_together: every session must already be served by {server} (a decode "
                                  "step), on the same model")
            session.rollback(server)
        caches = [session._caches[server] for session, _ in reads]
        before = [cache.length for cache in caches]
        logits = type(caches[0]).read_batch(model, caches, [token for _, token in reads])
        for (session, token), length in zip(reads, before, strict=True):
            session._grown(server, length)
            session.tokens.append(token)
        return logits.float().log_softmax(-1)

    def reprefill_start(self, server: str, keep_own: bool = True) -> int:
        """Where a `reprefill` of ``server`` starts reading: its `own_length` (keep_own; at most all but the last
        token, whose log-probs it returns), else 0."""
        return min(self.own_length(server), len(self.tokens) - 1) if keep_own and self.tokens else 0

    @torch.inference_mode()
    def reprefill(self, server: str, keep_own: bool = True) -> torch.Tensor:
        """``server`` prefills the conversation itself (the fallback when a mapped cache is not to be trusted) and
        becomes the owner; other models keep theirs. keep_own: it keeps the leading positions it computed itself
        (`own_length`: exact, what a prefill would hold) and prefills only the rest from there
        (`reprefill_start`); False: it drops its cache and prefills all of it. Returns the float32 log-probs of the
        token after `tokens`."""
        self.require_model(server)
        if not self.tokens:
            raise ConfigError("reprefill needs a conversation of at least one token")
        start = self.reprefill_start(server, keep_own)
        model = self.models[server]
        if start:
            cache = self._caches[server]
            cache.truncate(start)
        else:
            cache = self._caches[server] = self.cache_factory(model)
        logits = cache.read(model, torch.tensor([self.tokens[start:]], device=model.device))
        self._own[server] = cache.length
        self.owner, self._handover = server, None
        return logits[0, -1].float().log_softmax(-1)

    def restore(self, tokens, caches, owner: str) -> None:
        """Start from a conversation whose caches were kept elsewhere (a server's prefix cache): ``tokens``, and per
        model name (`KVCache`, own length): its cache of the conversation's first positions, of which the leading
        ``own`` are its own exact ones (`own_length`). ``owner``: the model that read the conversation last, whose
        cache holds all of ``tokens``. The session must be new (no tokens yet)."""
        if self.tokens or self._caches:
            raise ConfigError("restore needs a new session (this one already holds a conversation)")
        tokens = list(tokens)
        self.require_model(owner)
        if owner not in caches or caches[owner][0].length != len(tokens):
            raise ConfigError(f"the owner {owner!r} must hold all {len(tokens)} positions of the conversation")
        for name, (cache, own) in caches.items():
            self.require_model(name)
            if not 0 <= own <= cache.length <= len(tokens):
                raise ConfigError(f"{name}: a cache of {cache.length} positions with {own} of its own does not fit "
                                  f"a conversation of {len(tokens)} tokens")
        self.tokens, self.owner, self._handover = tokens, owner, None
        self._caches = {name: cache for name, (cache, _) in caches.items()}
        self._own = {name: own for name, (_, own) in caches.items()}

    def export(self, server: str, start: int = 0, end: int | None = None):
        """``server``'s cached rows of positions ``start``..``end`` − 1 (`KVCache.export`; None: to its end)."""
        self.require_model(server)
        if server not in self._caches:
            raise ConfigError(f"{server} holds no cache of this conversation")
        return self._caches[server].export(start, end)

    def fork(self) -> SwitchingSession:
        """A copy of the conversation that shares the models and mappers but owns copies of the caches: what the
        fork reads, generates or hands over leaves this session as it was (e.g. to try a switch another way)."""
        twin = copy.copy(self)
        twin.tokens, twin._turn_starts = list(self.tokens), list(self._turn_starts)
        twin._caches = {name: cache.copy() for name, cache in self._caches.items()}
        twin._own = dict(self._own)
        return twin

    def cache_bytes(self) -> int:
        """Bytes of memory the session's caches hold (storage shared by several views counted once)."""
        storages: dict[tuple, int] = {}
        for cache in self._caches.values():
            storages.update(cache.storages())
        return sum(storages.values())
