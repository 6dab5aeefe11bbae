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
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvhandoff.runtime.session import SwitchingSession
from kvhandoff.serving.prefix_tree import EXACT, PrefixHandle, PrefixTree, choose_reuse, derived_from, mapped_from

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Checkout:
    """A request's share of the tree: its namespace, the pinned path, and what the asked model's cache started with:
    its positions, its own exact ones among them, and the model its mapped or derived ones came from."""

    namespace: str
    handle: PrefixHandle
    model: str
    length: int = 0
    exact: int = 0
    source: str | None = None


class PrefixCache:
    """The server's caches of conversations by token prefix (one `PrefixTree`, every namespace)."""

    def __init__(self, tree: PrefixTree | None = None) -> None:
        self.tree = tree or PrefixTree()

    def checkout(self, namespace: str, prompt: list[int], model: str, session: SwitchingSession,
                 exact_only: bool = False) -> Checkout:
        """Fill the new ``session`` with what serves ``prompt`` in ``namespace`` (all but its last token, which the
        model reads for its logits): ``model``'s longest prefix and, when another model may hand over more, that
        model's rows as the previous owner. The matched path stays pinned until `release`. Call on the model's
        worker thread (the rows are copied here)."""
        match = self.tree.match(namespace, prompt, model, exact_only, lock=True)
        try:
            reuse = choose_reuse(match, limit=len(prompt) - 1)
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

    def release(self, checkout: Checkout) -> None:
        """Unpin the request's path (it may be evicted again)."""
        self.tree.unlock(checkout.handle)
