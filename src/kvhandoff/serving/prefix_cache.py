"""Conversations found by their tokens: a request that names no session is served from the `PrefixTree`, so any
client gets the prefix cache and the handoff, header or not.

A request checks out what the hosted models hold of its prompt (`PrefixCache.checkout`: the tree's match, pinned
until the request ends, and `prefix_tree.choose_reuse`'s decision): the asked model's rows of the longest prefix it
holds go into a fresh `SwitchingSession`, and when another model holds further rows it may hand over (its own or
derived ones, never a mapper's output), that model's rows too, as the session's previous owner. The session then
serves the request exactly as a named session would — the asked model's own rows, a handoff from the owner of the
part it lacks (incremental: only that part is mapped), or a prefill — and `checkin` keeps what the request added
to the asked model's cache: the rows it computed over its own exact prefix as exact, the rows the mapper made as
mapped, the rows it computed on top of those as derived.

With ``exact_only`` (`kv_handoff.mode` "exact") only the asked model's own exact rows are checked out: nothing
mapped serves the request, and nothing is handed over.

Reuse at another offset: with a `RunIndex`, every conversation kept is indexed in its tenant, and a prompt whose
history another conversation holds after another beginning (another agent's instructions) is served from that run
when it saves more than the prefix: the rows of the model holding it (the asked model's own exact ones, else another
model's that may be handed over, mapped) are moved behind the prompt's beginning (`SwitchingSession.reuse`), the
asked model's own exact rows of the beginning's start copied in, the rest of the beginning and the offset plan's
picks recomputed with the prompt's read. Never with ``exact_only``. Checked in as: the beginning exact, the run
mapped from the model whose rows it was, the rest derived from it.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass

from kvhandoff.runtime.offset import held_read, mapped_run
from kvhandoff.runtime.plan import HandoffPlan
from kvhandoff.runtime.runs import RunIndex, RunMatch
from kvhandoff.runtime.session import SwitchingSession
from kvhandoff.serving.prefix_reuse import PrefixMatch, Reuse
from kvhandoff.serving.prefix_tree import (
    DEFAULT_NAMESPACE,
    EXACT,
    PrefixHandle,
    PrefixTree,
    choose_reuse,
    derived_from,
    mapped_from,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OffsetRun:
    """Where a run reused at another offset sits in a request's prompt: after ``beginning`` positions (the first
    ``known`` of them the asked model's own rows), ``length`` positions whose rows came from ``source``."""

    beginning: int
    length: int
    source: str
    known: int = 0


@dataclass(frozen=True)
class Checkout:
    """A request's share of the tree: its namespace, the pinned path, and what the asked model's cache started with:
    its positions, its own exact ones among them, and the model its mapped or derived ones came from; ``offset``: the
    run reused at another offset it started from instead (None: a prefix)."""

    namespace: str
    handle: PrefixHandle
    model: str
    length: int = 0
    exact: int = 0
    source: str | None = None
    offset: OffsetRun | None = None


class PrefixCache:
    """The server's caches of conversations by token prefix (one `PrefixTree`, every namespace); with ``runs`` (a
    `RunIndex`) and ``offset_plan`` (a namespace's `HandoffPlan` of runs reused at another offset), the runs too."""

    def __init__(self, tree: PrefixTree | None = None, runs: RunIndex | None = None,
                 offset_plan: Callable[[str], HandoffPlan] | None = None) -> None:
        self.tree = tree or PrefixTree()
        self.runs = runs if offset_plan is not None else None
        self.offset_plan = offset_plan
        self._keys = itertools.count()  # the run index's key of each conversation kept

    def offset_status(self) -> dict | None:
        """What reuse at another offset does (None: off): its recompute policy and the conversations indexed."""
        if self.runs is None:
            return None
        return {"recompute": self.offset_plan(DEFAULT_NAMESPACE).recompute.spec, "conversations": len(self.runs)}

    def checkout(self, namespace: str, prompt: list[int], model: str, session: SwitchingSession,
                 exact_only: bool = False, offset: bool = True) -> Checkout:
        """Fill the new ``session`` with what serves ``prompt`` in ``namespace`` (all but its last token, which the
        model reads for its logits): ``model``'s longest prefix and, when another model may hand over more, that
        model's rows as the previous owner. The matched path stays pinned until `release`. Call on the model's
        worker thread (the rows are copied here)."""
        match = self.tree.match(namespace, prompt, model, exact_only, lock=True)
        try:
            reuse = choose_reuse(match, limit=len(prompt) - 1)
            run = self._reuse_offset(namespace, prompt, session, match, reuse) if offset and not exact_only else None
            if run is not None:
                return Checkout(namespace, match.handle, model, run.known, run.known, run.source, run)
            own = match.own
            caches, owner = {}, model
            if reuse.own:
                caches[model] = (self._restored(session, match, model, reuse.own), min(own.exact, reuse.own))
            if reuse.kind == "handoff":
                source = match.hold(reuse.source)
                length = reuse.source_length
                caches[reuse.source] = (self._restored(session, match, reuse.source, length),
                                        min(source.exact, length))
                owner = reuse.source
            if caches:
                session.restore(prompt[:max(reuse.own, reuse.source_length)], caches, owner)
        except BaseException:
            self.tree.unlock(match.handle)
            raise
        return Checkout(namespace, match.handle, model, reuse.own, min(own.exact, reuse.own),
                        own.sources[-1] if own.sources and reuse.own > own.exact else None)

    def _reuse_offset(self, namespace: str, prompt: list[int], session: SwitchingSession, match: PrefixMatch,
                      reuse: Reuse) -> OffsetRun | None:
        """Start ``session`` from the longest run of ``prompt`` a conversation of ``namespace`` holds at another
        offset, when there is one longer than what ``reuse`` (the prefix's) serves; None otherwise."""
        if self.runs is None:
            return None
        run = self.runs.find(prompt[:self.runs.new_turn_start(prompt)], namespace)  # the new turn is read
        if run is None or run.length <= reuse.reused:
            return None
        model = match.model
        held = self.runs.held(run.key, namespace)
        plan = self.offset_plan(namespace)
        found = self.tree.match(namespace, held[:run.held_start + run.length], model, lock=True, count=False)
        read = None
        try:
            source, length = _run_holder(found, run, session)
            if length < self.runs.min_length or length <= reuse.reused:
                if length == 0:  # the tree no longer holds its rows (evicted): forget it
                    self.runs.remove(run.key, namespace)
                return None
            end = run.held_start + length
            if plan.recompute.ranks_by_source_turn_read:  # the holder reads the rest of the prompt on what it held
                held_rows = found.rows(source, 0, end)  # gathered once: the run is its tail
                read = held_read(session.models[source], held_rows, prompt[run.prompt_start + length:],
                                 session.cache_factory)
                rows = found.hold(source).ops.slice(held_rows, run.held_start, end)
            else:
                rows = found.rows(source, run.held_start, end)
        finally:
            self.tree.unlock(found.handle)
        if source != model:
            rows = mapped_run(session.mappers[source, model], rows, run.held_start,
                              dtype=rows.layers[0].keys.dtype)
        known = min(match.own.exact, run.prompt_start)
        end = run.prompt_start + length
        session.reuse(model, prompt[:run.prompt_start], prompt[run.prompt_start:end], rows, run.held_start, source,
                      plan, match.rows(model, 0, known) if known else None, read)
        logger.debug("%s: %d positions reused at another offset (%+d) from %s", model, length, run.shift, source)
        return OffsetRun(run.prompt_start, length, source, known)

    @staticmethod
    def _restored(session: SwitchingSession, match, model: str, length: int):
        cache = session.cache_factory(session.models[model])
        cache.append(match.rows(model, 0, length))
        return cache

    def checkin(self, checkout: Checkout, session: SwitchingSession, report) -> None:
        """Keep what the request added to the asked model's cache of ``session`` (``report``: the request's
        `engine.TurnReport`): the positions it computed over its own exact prefix as exact rows, those a handoff
        mapped as mapped from the model handed over from, and the rest as derived. Best effort: a failure is
        logged, the request's answer stands. Call on the worker thread, before `release`."""
        try:
            self._keep(checkout, session, report)
        except Exception:
            logger.exception("prefix cache: the rows of a request could not be kept")

    def _keep(self, checkout: Checkout, session: SwitchingSession, report) -> None:
        name = checkout.model
        length = session.cached_length(name)
        own = session.own_length(name)
        tokens = session.tokens[:length]
        namespace = checkout.namespace
        if self.runs is not None and length:
            self.runs.add(next(self._keys), tokens, namespace)
        offset = checkout.offset
        if offset is not None and report.reuse == "offset":  # the beginning exact, the run mapped, the rest derived
            begin, end = offset.beginning, offset.beginning + offset.length
            if begin > offset.known:
                self.tree.insert(namespace, tokens[:begin], name, session.export(name, offset.known, begin), EXACT,
                                 start=offset.known)
            self.tree.insert(namespace, tokens[:end], name, session.export(name, begin, end),
                             mapped_from(offset.source), start=begin)
            if length > end:
                self.tree.insert(namespace, tokens, name, session.export(name, end, length),
                                 derived_from(offset.source), start=end)
            return
        if own > checkout.exact:
            self.tree.insert(namespace, tokens[:own], name, session.export(name, checkout.exact, own), EXACT,
                             start=checkout.exact)
        start = max(own, checkout.length)
        source = report.source if report.status == "applied" else checkout.source
        if length <= start or source is None:
            return
        mapped_end = report.cached_tokens if report.status == "applied" else start  # the handoff mapped up to there
        if mapped_end > start:
            self.tree.insert(namespace, tokens[:mapped_end], name, session.export(name, start, mapped_end),
                             mapped_from(source), start=start)
        start = max(start, mapped_end)
        if length > start:
            self.tree.insert(namespace, tokens, name, session.export(name, start, length), derived_from(source),
                             start=start)

    def heal(self, namespace: str, tokens: list[int], model: str, session: SwitchingSession, limit: int) -> int:
        """``model`` heals its rows of ``tokens`` in ``namespace`` (a conversation kept here): the positions past its
        own exact ones (mapped or derived), at most ``limit`` of them, read again on a copy of its exact rows in the
        new ``session`` (`SwitchingSession.heal`) and kept as exact, replacing them. Returns the positions healed (0:
        nothing left, or the rows were evicted). Call on the model's worker thread."""
        match = self.tree.match(namespace, tokens, model, lock=True, count=False)
        try:
            own = match.own
            end = min(own.length, own.exact + limit)
            if end <= own.exact:
                return 0
            session.restore(tokens[:end], {model: (self._restored(session, match, model, end), own.exact)}, model)
            healed = session.heal(model)
            self.tree.insert(namespace, tokens[:end], model, session.export(model, own.exact, end), EXACT,
                             start=own.exact)
            return healed
        finally:
            self.tree.unlock(match.handle)

    def release(self, checkout: Checkout) -> None:
        """Unpin the request's path (it may be evicted again)."""
        self.tree.unlock(checkout.handle)


def _run_holder(found: PrefixMatch, run: RunMatch, session: SwitchingSession) -> tuple[str, int]:
    """The model whose rows of ``run`` (at its held position) serve the asked model, and how many of the run's
    positions they cover: the asked model's own (whatever their provenance: what already serves it), else another
    model's that may be handed over and that a mapper of ``session`` maps (the longest; the asked model's on a tie);
    ("", 0) when none holds any."""
    start, end = run.held_start, run.held_start + run.length
    model = found.model
    best = (model, max(0, min(found.own.length, end) - start))
    for name, hold in found.holds.items():
        if name != model and (name, model) in session.mappers:
            covered = max(0, min(hold.transferable(start), hold.length, end) - start)
            if covered > best[1]:
                best = (name, covered)
    return best if best[1] else ("", 0)
