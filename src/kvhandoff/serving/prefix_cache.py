"""Conversations found by their tokens: a request that names no session is served from the `PrefixTree`, so any
client gets the prefix cache and the handoff, header or not.

A request checks out what the hosted models hold of its prompt (`PrefixCache.checkout`: the tree's match, pinned
until the request ends): every model's rows of the longest prefix it holds go into a fresh `SwitchingSession`,
whose owner is the model that holds the most of it. The session then serves the request exactly as a named
session would — the asked model's own rows, a handoff from the owner of the part it lacks (incremental: only that
part is mapped), or a prefill — and `checkin` keeps what the request added to any model's cache: rows the model
computed over its own exact prefix as exact, the rest as mapped from the model they came from.

With ``exact_only`` (`kv_handoff.mode` "exact") only the asked model's own exact rows are checked out: nothing
mapped serves the request, and nothing is handed over.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvhandoff.runtime.session import SwitchingSession
from kvhandoff.serving.prefix_tree import EXACT, PrefixHandle, PrefixTree, mapped_from

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Checkout:
    """A request's share of the tree: its namespace, the pinned path, and what each model's cache started with
    (name → (positions, own exact positions, the models its mapped positions came from))."""

    namespace: str
    handle: PrefixHandle
    started: dict[str, tuple[int, int, tuple[str, ...]]]


class PrefixCache:
    """The server's caches of conversations by token prefix (one `PrefixTree`, every namespace)."""

    def __init__(self, tree: PrefixTree | None = None) -> None:
        self.tree = tree or PrefixTree()

    def checkout(self, namespace: str, prompt: list[int], model: str, session: SwitchingSession,
                 exact_only: bool = False) -> Checkout:
        """Fill the new ``session`` with what the hosted models hold of ``prompt`` in ``namespace`` (all but its
        last token, which the model reads for its logits); the matched path stays pinned until `release`. Call on
        the model's worker thread (the rows are copied here)."""
        limit = len(prompt) - 1
        match = self.tree.match(namespace, prompt, model, exact_only, lock=True)
        try:
            holds = {model: match.own} if exact_only else dict(match.holds)
            holds = {name: hold for name, hold in holds.items() if min(hold.length, limit) > 0}
            started = {}
            if holds:  # the owner: who holds the most; the asked model on a tie (no switch)
                owner = max(holds, key=lambda name: (min(holds[name].length, limit), name == model))
                length = min(holds[owner].length, limit)
                caches = {}
                for name, hold in holds.items():
                    count = min(hold.length, length)
                    cache = session.cache_factory(session.models[name])
                    cache.append(match.rows(name, 0, count))
                    caches[name] = (cache, min(hold.exact, count))
                    started[name] = (count, min(hold.exact, count), hold.sources)
                session.restore(prompt[:length], caches, owner)
        except BaseException:
            self.tree.unlock(match.handle)
            raise
        return Checkout(namespace, match.handle, started)

    def checkin(self, checkout: Checkout, session: SwitchingSession, source: str | None) -> None:
        """Keep what the request added to each model's cache of ``session``: positions a model computed over its
        own exact prefix as its exact rows, the others as mapped (from ``source``, the model handed over from, else
        where the model's mapped rows came from before). Call on the worker thread, before `release`."""
        for name in session.models:
            length = session.cached_length(name)
            if not length:
                continue
            had, had_exact, sources = checkout.started.get(name, (0, 0, ()))
            own = session.own_length(name)
            tokens = session.tokens[:length]
            if own > had_exact:
                self.tree.insert(checkout.namespace, tokens[:own], name, session.export(name, had_exact, own), EXACT,
                                 start=had_exact)
            start = max(own, had)
            if length > start:
                origin = source or (sources[-1] if sources else None)
                if origin is None or origin == name:
                    logger.debug("prefix cache: %s's rows %d..%d have no known source; not kept", name, start, length)
                    continue
                self.tree.insert(checkout.namespace, tokens, name, session.export(name, start, length),
                                 mapped_from(origin), start=start)

    def release(self, checkout: Checkout) -> None:
        """Unpin the request's path (it may be evicted again)."""
        self.tree.unlock(checkout.handle)
