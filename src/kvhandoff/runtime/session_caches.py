"""Each model's cache of one conversation, how much of it the model computed itself, and the forwards that grow
it (`SessionCaches`): the bookkeeping a `SwitchingSession` holds for its models."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from kvhandoff.errors import ConfigError
from kvhandoff.model.cache import cache_copy
from kvhandoff.runtime.handoff import MappedCache
from kvhandoff.runtime.seam import CacheFactory, KVCache


class SessionCaches:
    """Per model name: its cache of the conversation (behind the cache seam, `KVCache`) and its own length.

    A model's own length is the number of leading positions of its cache that it computed itself over the exact
    conversation: what it read or generated on a cache that held only positions of its own — never a mapped
    position, nor one read on top of one (a cache handed over fresh counts as mapped from its first position on).
    Those positions are exactly what a prefill of them would hold, so a re-prefill keeps them and reads only the
    rest (`SwitchingSession.reprefill`). Every forward of a model on its cache goes through here (`read`,
    `generate`, `read_together`), so that its own length follows what it computed.
    """

    def __init__(self, held: Mapping[str, tuple[KVCache, int]] | None = None) -> None:
        held = dict(held or {})
        self._caches: dict[str, KVCache] = {name: cache for name, (cache, _) in held.items()}
        # per model: the leading positions of its cache it computed itself over the exact conversation
        self._own: dict[str, int] = {name: own for name, (_, own) in held.items()}

    @classmethod
    def restored(cls, held: Mapping[str, tuple[KVCache, int]], length: int, owner: str,
                 require_model: Callable[[str], None]) -> SessionCaches:
        """The caches of a conversation of ``length`` tokens kept elsewhere (e.g. a server's prefix cache), per model
        name (`KVCache`, own length): its cache of the conversation's first positions, of which the leading ``own``
        are its own exact ones. ``owner``, the model that read the conversation last, holds all of it. ConfigError
        (``require_model``'s for an unknown name) for caches that do not fit."""
        require_model(owner)
        if owner not in held or held[owner][0].length != length:
            raise ConfigError(f"the owner {owner!r} must hold all {length} positions of the conversation")
        for name, (cache, own) in held.items():
            require_model(name)
            if not 0 <= own <= cache.length <= length:
                raise ConfigError(f"{name}: a cache of {cache.length} positions with {own} of its own does not fit "
                                  f"a conversation of {length} tokens")
        return cls(held)

    def __contains__(self, name: str) -> bool:
        return name in self._caches

    def __getitem__(self, name: str) -> KVCache:
        return self._caches[name]

    def __bool__(self) -> bool:
        return bool(self._caches)

    def length(self, name: str) -> int:
        """Positions ``name``'s cache holds (0 before it has one)."""
        kv = self._caches.get(name)
        return 0 if kv is None else kv.length

    def own_length(self, name: str) -> int:
        """The leading positions of ``name``'s cache that are its own (class docstring); 0 before it has a cache."""
        return min(self._own.get(name, 0), self.length(name))

    def start(self, name: str, cache: KVCache) -> KVCache:
        """Hold ``cache`` as ``name``'s, none of its positions its own yet (an empty one, or one mapped for it)."""
        self._caches[name] = cache
        self._own[name] = 0
        return cache

    def ensure(self, name: str, cache_factory: CacheFactory, model) -> KVCache:
        """``name``'s cache; before its first turn a fresh one of its engine's, ``cache_factory(model)``."""
        return self._caches[name] if name in self._caches else self.start(name, cache_factory(model))

    def restart(self, name: str, start: int, cache_factory: CacheFactory, model) -> KVCache:
        """``name``'s cache cut back to its first ``start`` positions (its own ones) for a re-prefill from there; 0:
        a fresh one, ``cache_factory(model)``, instead."""
        if not start:
            return self.start(name, cache_factory(model))
        self._caches[name].truncate(start)
        return self._caches[name]

    def drop(self, name: str) -> KVCache:
        """Forget ``name``'s cache (e.g. given away at a handover); returns it."""
        self._own.pop(name, None)
        return self._caches.pop(name)

    def _grown(self, name: str, before: int) -> None:
        """``name``'s cache grew from ``before`` positions by its own forward: the new positions are its own
        (exact) when everything before them was."""
        if self._own.get(name, 0) >= before:
            self._own[name] = self._caches[name].length

    def heal(self, name: str, model, tokens: Sequence[int], limit: int | None = None) -> int:
        """``name``'s ``model`` reads again, on its own rows, the positions of its cache past its own length
        (``tokens``: the conversation's), at most ``limit`` of them (None: all): they become its own, exactly what a
        prefill would hold, and the positions after them stay as they were. Returns the positions healed."""
        cache = self._caches[name]
        own, length = self.own_length(name), cache.length
        end = length if limit is None else min(length, own + limit)
        if end <= own:
            return 0
        rest = cache_copy(cache.export(end, length)) if end < length else None  # kept while the cache is cut
        cache.truncate(own)
        cache.read(model, torch.tensor([list(tokens[own:end])], device=cache.device), 1)
        if rest is not None:
            cache.append(rest)
        self._own[name] = end
        return end - own

    def read(self, name: str, model, ids: torch.Tensor, keep: int = 1,
             mapped: MappedCache | None = None) -> torch.Tensor:
        """``name``'s ``model`` reads ``ids`` [1, n] on its cache (through ``mapped``, the `MappedCache` a handover
        just made of it: the pending recompute and the read in one forward); logits of the last ``keep``
        [1, keep, vocab]."""
        cache = self._caches[name]
        before = cache.length
        logits = mapped.read(model, ids, keep) if mapped is not None else cache.read(model, ids, keep)
        self._grown(name, before)
        return logits

    def generate(self, name: str, model, input_ids: torch.Tensor, mapped: MappedCache | None = None,
                 **generate_kwargs) -> torch.Tensor:
        """``name``'s ``model`` generates on its cache for ``input_ids`` [1, T + N] (through ``mapped`` as in `read`:
        generate's first forward also recomputes); its cache then holds every token of the returned sequences."""
        cache = self._caches[name]
        before = cache.length
        out = (mapped.generate(model, input_ids, **generate_kwargs) if mapped is not None
               else cache.generate(model, input_ids, **generate_kwargs))
        missing = out[0].tolist()[cache.length:]  # generate does not feed its last token back
        if missing:
            cache.read(model, torch.tensor([missing], device=model.device))
        self._grown(name, before)
        return out

    def preview(self, name: str, model, ids: list[int], keep: int,
                attention: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``name``'s ``model`` reads ``ids`` on its cache and forgets them (the cache is left as it was): float32
        log-probs of the last ``keep`` [keep, vocab] and, with ``attention``, the attention it paid each cached
        position [1, T] (`KVCache.read_turn`, in the cache's engine), else None."""
        kv = self._caches[name]
        turn = torch.tensor([ids], device=kv.device)
        if attention:
            read = kv.read_turn(model, turn, keep)
            return read.logprobs[0], read.scores
        length = kv.length
        logits = kv.read(model, turn, keep)
        kv.truncate(length)
        return logits[0].float().log_softmax(-1), None

    @staticmethod
    def read_together(name: str, model, held: Sequence[SessionCaches], tokens: Sequence[int]) -> torch.Tensor:
        """``name``'s ``model`` reads one more token on its cache in each of ``held`` (one per conversation), in one
        forward where its engine batches (`KVCache.read_batch`); the logits of the token after each [n, vocab]."""
        caches = [each[name] for each in held]
        before = [cache.length for cache in caches]
        logits = type(caches[0]).read_batch(model, caches, list(tokens))
        for each, length in zip(held, before, strict=True):
            each._grown(name, length)
        return logits

    def cut(self, name: str, length: int) -> None:
        """Drop what ``name``'s cache holds past ``length`` positions (a shorter cache is kept as it is)."""
        cache = self._caches[name]
        if cache.length > length:
            cache.truncate(length)
        self._own[name] = min(self._own.get(name, 0), cache.length)

    def cut_held(self, names, length: int) -> None:
        """`cut` the caches of those of ``names`` that hold one."""
        for name in names:
            if name in self._caches:
                self.cut(name, length)

    def rewind(self, name: str, length: int, own: int) -> None:
        """Take ``name``'s cache back to the ``length`` positions it held, ``own`` of them its own, before a handover
        appended to it."""
        self._caches[name].truncate(length)
        self._own[name] = min(own, length)

    def cut_all(self, length: int) -> None:
        """`cut` every cache to ``length`` positions (0: forget them all)."""
        if length == 0:
            self._caches.clear()
            self._own.clear()
        for name in self._caches:
            self.cut(name, length)

    def export(self, name: str, start: int = 0, end: int | None = None):
        """``name``'s cached rows of positions ``start``..``end`` − 1 (`KVCache.export`; None: to its end)."""
        if name not in self._caches:
            raise ConfigError(f"{name} holds no cache of this conversation")
        return self._caches[name].export(start, end)

    def copy(self) -> SessionCaches:
        """Copies of every cache (`KVCache.copy`), with their own lengths."""
        return SessionCaches({name: (cache.copy(), self._own.get(name, 0)) for name, cache in self._caches.items()})

    def nbytes(self) -> int:
        """Bytes of memory the caches hold (storage shared by several views counted once)."""
        storages: dict[tuple, int] = {}
        for cache in self._caches.values():
            storages.update(cache.storages())
        return sum(storages.values())
