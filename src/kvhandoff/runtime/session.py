"""A conversation served by several models in turn: each switch hands the conversation over by mapping the
cache (`handoff`), never by re-prefilling it."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

from kvhandoff.config import require_positive
from kvhandoff.errors import ConfigError
from kvhandoff.runtime.handoff import MappedCache, check_context
from kvhandoff.runtime.offset import moved_read, reuse_run
from kvhandoff.runtime.plan import DEFAULT_PLAN, HandoffPlan
from kvhandoff.runtime.policy import SelectionInfo
from kvhandoff.runtime.seam import CacheFactory, as_kv_cache, new_cache
from kvhandoff.runtime.session_caches import SessionCaches
from kvhandoff.runtime.session_handover import HANDOVERS, Handover, check_settings, hand_over, pair_mapper

__all__ = ["HANDOVERS", "ReusedRun", "SwitchingSession", "read_together"]


@dataclass(frozen=True)
class ReusedRun:
    """A conversation started from a run of tokens held at another offset (`SwitchingSession.reuse`): ``server``'s
    cache of the new ``beginning`` positions, then ``length`` positions of the run whose rows came from ``source``'s
    cache (``server`` itself: its own rows, moved), recomputed by the plan's policy with the next read
    (``mapped``); the first ``known`` positions of the beginning were ``server``'s own rows, copied in."""

    server: str
    source: str
    beginning: int
    length: int
    mapped: MappedCache
    known: int = 0

    @property
    def pending(self) -> bool:
        """Whether the recompute still waits for the next read."""
        return bool(self.mapped.pending.numel())


def _listed(items, refusal: str) -> list:
    """``items`` (token ids, reads) as a list; ConfigError ``refusal`` when there are none."""
    items = list(items)
    if not items:
        raise ConfigError(refusal)
    return items


def _check_keep(keep) -> None:
    """ConfigError unless ``keep`` (how many of a read's last positions to return) is a positive integer."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ConfigError(f"keep must be a positive integer, got {keep!r}")


@torch.inference_mode()
def read_together(server: str, reads) -> torch.Tensor:
    """``server`` reads one more token in each of several sessions, in one forward where its engine batches
    (`KVCache.read_batch`): ``reads`` (session, token id) pairs, ``server`` already the owner of each (no
    handover pending: a decode step). Returns the float32 log-probs of the token after each [n, vocab]."""
    reads = _listed(reads, "read_together needs at least one (session, token) pair")
    model = reads[0][0].models[server]
    for session, _ in reads:
        if session.owner != server or session.models[server] is not model or server not in session._caches:
            raise ConfigError(f"read_together: every session must already be served by {server} (a decode "
                              "step), on the same model")
        session.rollback(server)
    logits = SessionCaches.read_together(server, model, [session._caches for session, _ in reads],
                                         [token for _, token in reads])
    for session, token in reads:
        session.tokens.append(token)
    return logits.float().log_softmax(-1)


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
    generated answer) starts, for "sinks". Each model's cache sits behind the cache seam (`KVCache`; held in a
    `SessionCaches`); cache_factory makes a model's fresh one, ``cache_factory(model)`` (`CacheFactory`; default
    `new_cache`: the model's own engine's): at its first turn, at a re-prefill, and at a handover (`hand_over`).

    `read(server, ids)` lets ``server`` read the next tokens of the conversation, switching to it first when
    another model served last; `generate(server, ids, ...)` also answers, and the answer joins the conversation.
    A caller may decode from `cache(server)` itself: what it decodes past `tokens` (what every cache agrees on)
    is dropped before the conversation goes on (`rollback`). A handover whose result is not to be trusted can be
    taken back while the turn it served is the conversation's last (`undo_handover`), and made again under another
    plan (``plan`` of `read_logprobs`).

    The session knows which leading positions of each model's cache the model computed itself over the exact
    conversation (`own_length`); a re-prefill keeps those and reads only the rest (`reprefill`).

    Every mapper is checked against its two models when the session starts (MapperMismatchError for a wrong
    pair), and a turn that would take the conversation past a model's context window is refused before any
    work (ContextTooLongError).
    """

    def __init__(self, models, mappers, handover: str = "incremental", plan: HandoffPlan | None = None, *,
                 cache_factory: CacheFactory = new_cache,
                 pair_plans: Mapping[tuple[str, str], HandoffPlan] | None = None) -> None:
        self.models, self.mappers, pair_plans = dict(models), dict(mappers), dict(pair_plans or {})
        check_settings(self.models, self.mappers, handover, plan, pair_plans)
        self.handover, self.plan, self.cache_factory = handover, plan or DEFAULT_PLAN, cache_factory
        self.pair_plans = pair_plans
        self._turn_starts: list[int] = []  # where each read turn and each generated answer began
        self.tokens: list[int] = []
        self.owner: str | None = None  # the model that read the conversation last
        self._caches = SessionCaches()  # each model's cache of the conversation, and its own length
        self._handover: Handover | None = None  # the last handover, while it can be taken back
        self.reused: ReusedRun | None = None  # the run this conversation started from at another offset, if any

    def plan_for(self, source: str, target: str) -> HandoffPlan:
        """The plan of a handover from ``source`` to ``target``: the pair's own (``pair_plans``), else the session's."""
        return self.pair_plans.get((source, target), self.plan)

    def require_model(self, server: str) -> None:
        """ConfigError unless ``server`` is one of the session's models."""
        if server not in self.models:
            raise ConfigError(f"unknown model {server!r}; the session serves {', '.join(self.models)}")

    def cache(self, server: str):
        """``server``'s cache of the conversation as its engine holds it (`KVCache.native`; None before it has one)."""
        return self._caches[server].native if server in self._caches else None

    def cached_length(self, server: str) -> int:
        """Positions ``server``'s cache holds (0 before it has one)."""
        return self._caches.length(server)

    def own_length(self, server: str) -> int:
        """The leading positions of ``server``'s cache that it computed itself over the exact conversation, exactly
        what a prefill of them would hold (`SessionCaches`); 0 before it has a cache."""
        return self._caches.own_length(server)

    def switch_to(self, server: str):
        """Make ``server`` the owner; returns its cache of `tokens` (as `cache` does: mapped as `handover` says,
        the positions the model recomputes after a handover already recomputed)."""
        mapped = self._switch(server)
        if mapped is not None:
            mapped.settle(self.models[server])
        return self.cache(server)

    def _switch(self, server: str, upcoming=(), plan: HandoffPlan | None = None,
                source_turn_read: torch.Tensor | None = None) -> MappedCache | None:
        """Make ``server`` the owner; at a handover, its cache of `tokens` as `hand_over` maps it (its recompute
        left to its next forward), else None. ``upcoming`` (the tokens it reads next) and the rest: as in
        `read_logprobs`."""
        self.require_model(server)
        owner = self.owner
        self._caches.cut_held((owner, server), len(self.tokens))
        if owner is None or server == owner:
            self.owner = server
            reused = self.reused
            return reused.mapped if reused is not None and reused.pending and reused.server == server else None
        mapper = pair_mapper(self.mappers, owner, server)
        info = SelectionInfo(turn_starts=tuple(p for p in self._turn_starts if p < len(self.tokens)),
                             new_turn=tuple(upcoming), source_turn_read=source_turn_read)
        self._handover = None  # a handover that fails cannot be taken back, nor can the one before it
        mapped, self._handover = hand_over(
            self._caches, self.models, mapper, owner, server, self.tokens, plan or self.plan_for(owner, server),
            info, give_away=self.handover != "incremental", cache_factory=self.cache_factory)
        self.owner = server
        return mapped

    def _read_on(self, server: str, ids: list[int], keep: int, upcoming=None,
                 plan: HandoffPlan | None = None, source_turn_read: torch.Tensor | None = None) -> torch.Tensor:
        """``server`` reads ``ids`` on its cache of the conversation, switching to it first (at a handover the
        recompute and the read are one forward; the other arguments as in `read_logprobs`); logits of the last
        ``keep`` of them [1, keep, vocab]."""
        mapped = self._switch(server, ids if upcoming is None else upcoming, plan, source_turn_read)
        model = self.models[server]
        self._caches.ensure(server, self.cache_factory, model)  # an empty one before the conversation's first turn
        return self._caches.read(server, model, torch.tensor([ids], device=model.device), keep, mapped)

    @torch.inference_mode()
    def read(self, server: str, ids) -> torch.Tensor:
        """``server`` reads ``ids`` (the conversation's next tokens); float32 log-probs of the token after them."""
        ids = _listed(ids, "read needs at least one token")
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
        ids = _listed(ids, "generate needs at least one token of the new turn")
        self._check_length(server, len(ids))
        mapped = self._switch(server, ids)
        model = self.models[server]
        input_ids = torch.tensor([self.tokens + ids], device=model.device)
        self._caches.ensure(server, self.cache_factory, model)  # on the conversation's first turn, prefilled
        out = self._caches.generate(server, model, input_ids, mapped, **generate_kwargs)
        self._mark_turns(len(self.tokens), input_ids.shape[1])  # the turn read, then the answer
        self.tokens = out[0].tolist()
        return out[0, input_ids.shape[1]:].tolist()

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
        self._caches.cut(server, len(self.tokens))

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
        if self.reused is not None and length < self.reused.beginning + self.reused.length:
            self.reused = None  # its rows are cut: what the run held is gone
        self._caches.cut_all(length)
        self.owner = self.owner if length else None

    def undo_handover(self) -> None:
        """Take back the last handover while it can be (`Handover.undoable`; else ConfigError): the conversation
        returns to where it happened, the receiving model's cache to what it held before (none, if it had none) and
        the previous model becomes the owner again. Its next read hands over again, e.g. under a larger recompute
        budget (``plan`` of `read_logprobs`)."""
        last = Handover.undoable(self._handover, self.handover, self.owner, self._caches)
        self.truncate(last.at)
        last.undo(self._caches)
        self.owner, self._handover = last.source, None

    @torch.inference_mode()
    def preview_turn(self, server: str, ids, keep: int = 1,
                     attention: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The owner reads ``ids`` (the turn ``server`` reads next) on its cache of `tokens` and forgets them again
        (`SessionCaches.preview`): the float32 log-probs of the last ``keep`` positions [min(keep, len(ids)), vocab]
        and the attention it paid each position of `tokens` [1, T], or None. The attention is read when
        ``attention`` says so, by default when the handover to ``server`` ranks by it (its plan's
        `RecomputePolicy.ranks_by_source_turn_read`); `read_logprobs` takes it as ``source_turn_read``: one forward
        serves a guard's reference and the policy's ranking."""
        ids = list(ids)
        if self.owner is None or not ids:
            raise ConfigError("preview_turn needs a conversation with an owner and at least one token to read")
        _check_keep(keep)
        if attention is None:
            attention = self.plan_for(self.owner, server).recompute.ranks_by_source_turn_read
        self.rollback(self.owner)
        return self._caches.preview(self.owner, self.models[self.owner], ids, min(keep, len(ids)), attention)

    @torch.inference_mode()
    def read_logprobs(self, server: str, ids, keep: int = 1, upcoming=None,
                      plan: HandoffPlan | None = None, source_turn_read: torch.Tensor | None = None) -> torch.Tensor:
        """As `read`, but returns the float32 log-probs of the last ``keep`` positions of ``ids`` [min(keep,
        len(ids)), vocab] (row i: the distribution of the token after that position); only those logits are
        computed. ``upcoming``: the whole new turn when ``ids`` is only its first part (a prompt read in chunks),
        for a recompute policy that picks positions by it; ``plan``: the plan of a handover this read makes,
        instead of the pair's (`plan_for`); ``source_turn_read``: the previous owner's attention over the
        conversation while it read the new turn (`preview_turn`), for a policy that ranks by it."""
        ids = _listed(ids, "read_logprobs needs at least one token")
        _check_keep(keep)
        logits = self._read_on(server, ids, min(keep, len(ids)), upcoming, plan, source_turn_read)
        self.tokens += ids
        return logits[0].float().log_softmax(-1)

    #: a decode step of several sessions in one forward: not one session's operation (`read_together`)
    read_together = staticmethod(read_together)

    def reprefill_start(self, server: str, keep_own: bool = True) -> int:
        """Where a `reprefill` of ``server`` starts reading: its `own_length` (keep_own; at most all but the last
        token, whose log-probs it returns), else 0."""
        return min(self.own_length(server), len(self.tokens) - 1) if keep_own and self.tokens else 0

    @torch.inference_mode()
    def reprefill(self, server: str, keep_own: bool = True) -> torch.Tensor:
        """``server`` prefills the conversation itself (the fallback when a mapped cache is not to be trusted) and
        becomes the owner; other models keep theirs. keep_own: it keeps the positions it computed itself
        (`own_length`) and prefills only the rest (`reprefill_start`); False: it drops its cache and prefills all
        of it. Returns the float32 log-probs of the token after `tokens`."""
        self.require_model(server)
        if not self.tokens:
            raise ConfigError("reprefill needs a conversation of at least one token")
        start = self.reprefill_start(server, keep_own)
        model = self.models[server]
        self._caches.restart(server, start, self.cache_factory, model)
        logits = self._caches.read(server, model, torch.tensor([self.tokens[start:]], device=model.device))
        self.owner, self._handover, self.reused = server, None, None
        return logits[0, -1].float().log_softmax(-1)

    def restore(self, tokens, caches, owner: str) -> None:
        """Start from a conversation whose caches were kept elsewhere (a server's prefix cache): ``tokens``, ``caches``
        per model name (`KVCache`, `own_length`) and its ``owner`` (`SessionCaches.restored`). The session must be
        new (no tokens yet)."""
        if self.tokens or self._caches:
            raise ConfigError("restore needs a new session (this one already holds a conversation)")
        tokens = list(tokens)
        self._caches = SessionCaches.restored(caches, len(tokens), owner, self.require_model)
        self.tokens, self.owner, self._handover = tokens, owner, None

    @torch.inference_mode()
    def reuse(self, server: str, beginning, run, run_rows, old_start: int, source: str | None = None,
              plan: HandoffPlan | None = None, beginning_rows=None,
              source_turn_read: torch.Tensor | None = None) -> ReusedRun:
        """Start this new session from a run of tokens another conversation holds at another offset: ``server``'s
        cache of ``beginning`` then ``run`` (token ids), the run's rows taken from ``run_rows`` (in ``server``'s
        format, keys rotated for positions ``old_start``…: its own rows of the other conversation, or another
        model's mapped, `offset.mapped_run`), moved to their new positions (`offset.reuse_run`). ``source``: the
        model the rows came from (None: ``server``). The beginning and the positions ``plan``'s recompute policy
        picks (None: the session's plan) are recomputed with the next read on ``server``, which owns the
        conversation; until then `reused` says what is pending; ``beginning_rows``: ``server``'s own exact rows of
        the beginning's first positions, copied in instead. ``source_turn_read``: the attention ``source`` paid the
        conversation that holds the run (its old beginning, then the run: [1, old_start + len(run)]) while it read
        the new turn (its `preview_turn`), for a policy that ranks by it (`turn_attention`; `offset.moved_read`
        places it). Every reused row is approximate: ``server``'s own length stays 0."""
        if self.tokens or self._caches:
            raise ConfigError("reuse needs a new session (this one already holds a conversation)")
        self.require_model(server)
        source = server if source is None else source
        self.require_model(source)
        beginning, run = [int(t) for t in beginning], _listed(run, "reuse needs a run of at least one token")
        model = self.models[server]
        info = None
        if source_turn_read is not None:
            if tuple(source_turn_read.shape) != (1, old_start + len(run)):
                raise ConfigError(f"source_turn_read must be [1, {old_start + len(run)}] (the conversation that holds "
                                  f"the run: {old_start} positions, then the run's {len(run)}), got "
                                  f"{tuple(source_turn_read.shape)}")
            info = SelectionInfo(source_attention=moved_read(source_turn_read, old_start, len(beginning)))
        mapped = reuse_run(model, torch.tensor([beginning], dtype=torch.long), torch.tensor([run]), run_rows,
                           old_start, plan or self.plan, info, cache_factory=self.cache_factory,
                           beginning_rows=beginning_rows)
        self._caches.start(server, mapped.cache)
        self.tokens, self.owner, self._handover = beginning + [int(t) for t in run], server, None
        self._turn_starts = [0, len(beginning)] if beginning else [0]
        known = 0 if beginning_rows is None else as_kv_cache(beginning_rows).length
        self.reused = ReusedRun(server, source, len(beginning), len(run), mapped, known)
        return self.reused

    @torch.inference_mode()
    def heal(self, server: str | None = None, limit: int | None = None) -> int:
        """``server`` (None: the owner) recomputes its approximate rows exactly: the positions of its cache past its
        `own_length` (mapped for it, or computed on top of mapped ones) are read again on its own rows, in order, at
        most ``limit`` of them (None: all; a caller heals in chunks between other work). They become its own, as a
        prefill would hold them; the positions after them stay as they were. A recompute still pending for it is done
        first, and the last handover to it can no longer be taken back. Returns the positions healed (0: its cache
        is all its own, or it holds none)."""
        if limit is not None:
            require_positive("heal limit", limit)
        server = self.owner if server is None else server
        if server is None:
            return 0
        self.require_model(server)
        if server not in self._caches or self.own_length(server) >= self.cached_length(server):
            return 0
        model = self.models[server]
        self.rollback(server)  # what a caller decoded past the conversation is not the conversation's
        reused = self.reused
        if reused is not None and reused.pending and reused.server == server:
            reused.mapped.settle(model)
        if self._handover is not None and self._handover.target == server:
            self._handover = None
        return self._caches.heal(server, model, self.tokens, limit)

    def export(self, server: str, start: int = 0, end: int | None = None):
        """``server``'s cached rows of positions ``start``..``end`` − 1 (`KVCache.export`; None: to its end)."""
        self.require_model(server)
        return self._caches.export(server, start, end)

    def fork(self) -> SwitchingSession:
        """A copy of the conversation that shares the models and mappers but owns copies of the caches: what the
        fork reads, generates or hands over leaves this session as it was (e.g. to try a switch another way)."""
        twin = copy.copy(self)
        twin.tokens, twin._turn_starts, twin._caches = list(self.tokens), list(self._turn_starts), self._caches.copy()
        if self.reused is not None:  # the twin's recompute runs on its own copy of the cache
            reused = self.reused
            twin.reused = replace(reused, mapped=replace(reused.mapped, cache=twin._caches[reused.server]))
        return twin

    def cache_bytes(self) -> int:
        """Bytes of memory the session's caches hold (storage shared by several views counted once)."""
        return self._caches.nbytes()
