"""The target's own K/V of exact prefixes, kept across handoffs (a conversation's opening is recomputed once)."""

from __future__ import annotations

import copy
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from kvhandoff.errors import ConfigError
from kvhandoff.model.cache import model_device
from kvhandoff.runtime.seam import as_kv_cache, new_cache, rows_of


@dataclass
class _Shelves:
    """What a store and its views share: per model its openings (key → (rows, bytes)), least recently used first;
    the lock; the bytes held; the lookups that found or missed an opening."""

    entries: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    lock: threading.Lock = field(default_factory=threading.Lock)
    bytes: int = 0
    hits: int = 0
    misses: int = 0
    tick: int = 0  # the last use handed out (orders every model's openings by their last use)


class PrefixStore:
    """The target's own K/V of the exact prefix (the first tokens of a handed-over context), by model and token ids.

    A router's conversations open alike (chat template, system prompt), so after the first handoff of an opening the
    target's K/V of its exact prefix are copied from here instead of recomputed, and the target's first forward
    after a switch reads only the new tokens. The K/V of positions 0..p−1 depend on those p tokens alone (causal
    attention), so a copy is exact. Holds up to ``capacity`` openings per model, least recently used dropped first
    (`trim` drops them down to a number of bytes); it assumes a model's weights do not change in place (`clear` it
    if they do). Thread-safe.

    Tenants: `within(namespace)` is a view of the store that finds and keeps only ``namespace``'s openings, so a
    tenant is never served another's (nor can it learn whether another's conversation opened with a guessed text).
    The views share the store's entries, capacity, bytes and counters; the store itself is the namespace None."""

    def __init__(self, capacity: int = 256) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ConfigError(f"a prefix store holds at least one opening, got capacity {capacity!r}")
        self.capacity = capacity
        self.namespace: str | None = None
        self._shelves = _Shelves()

    def within(self, namespace: str | None) -> PrefixStore:
        """A view of this store holding ``namespace``'s openings only (sharing everything else with the store)."""
        view = copy.copy(self)
        view.namespace = namespace
        return view

    @property
    def hits(self) -> int:
        """Lookups, in any namespace, that found every row."""
        return self._shelves.hits

    @property
    def misses(self) -> int:
        return self._shelves.misses

    def __len__(self) -> int:
        """Openings held, in every namespace."""
        with self._shelves.lock:
            return sum(len(entries) for entries in self._shelves.entries.values())

    def bytes(self) -> int:
        """Bytes of K/V held, in every namespace."""
        return self._shelves.bytes

    def clear(self) -> None:
        with self._shelves.lock:
            self._shelves.entries.clear()
            self._shelves.bytes = 0

    def trim(self, limit: int) -> int:
        """Drop the least recently used openings (of any model and namespace) while the store holds more than
        ``limit`` bytes; returns how many were dropped."""
        shelves, dropped = self._shelves, 0
        with shelves.lock:
            while shelves.bytes > limit:
                oldest = min((entries for entries in shelves.entries.values() if entries),
                             key=lambda entries: next(iter(entries.values()))[2], default=None)
                if oldest is None:
                    break
                shelves.bytes -= oldest.popitem(last=False)[1][1]
                dropped += 1
        return dropped

    def lookup(self, model, prefix_ids: torch.Tensor, dtype: torch.dtype):
        """The stored K/V of ``prefix_ids`` [batch, p] as rows (the cache seam's format: positions 0..p−1 of every
        layer), or None unless every row is stored (in this view's namespace)."""
        keys = self._row_keys(prefix_ids, dtype)
        shelves = self._shelves
        with shelves.lock:
            entries = shelves.entries.get(model, {})
            rows = [entries.get(key) for key in keys]
            if any(row is None for row in rows):
                shelves.misses += 1
                return None
            shelves.hits += 1
            for key in keys:
                entries.move_to_end(key)
                shelves.tick += 1
                entries[key] = (*entries[key][:2], shelves.tick)
            rows = [row[0] for row in rows]
        return rows_of((torch.cat([row[i][0] for row in rows]), torch.cat([row[i][1] for row in rows]))
                       for i in range(len(rows[0])))

    def remember(self, model, prefix_ids: torch.Tensor, cache) -> None:
        """Store ``cache``'s positions 0..p−1 (a `KVCache`'s or a `transformers` cache's: the target's own K/V of
        ``prefix_ids`` [batch, p]), row by row, in this view's namespace."""
        count, cache = prefix_ids.shape[1], as_kv_cache(cache)
        keys = self._row_keys(prefix_ids, cache.dtype)
        layers = [(layer.keys, layer.values) for layer in cache.export(0, count).layers]
        shelves = self._shelves
        with shelves.lock:
            entries = shelves.entries.setdefault(model, OrderedDict())
            for row, key in enumerate(keys):
                kept = [(k[row : row + 1].clone(), v[row : row + 1].clone()) for k, v in layers]
                size = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kept)
                if key in entries:
                    shelves.bytes -= entries[key][1]
                shelves.tick += 1
                entries[key] = (kept, size, shelves.tick)
                shelves.bytes += size
                entries.move_to_end(key)
            while len(entries) > self.capacity:
                shelves.bytes -= entries.popitem(last=False)[1][1]

    @torch.inference_mode()
    def prime(self, model, prefix_ids: torch.Tensor) -> None:
        """Store ``model``'s own K/V of ``prefix_ids`` [batch, p] (a prefill of those p tokens), e.g. a system
        prompt's opening before the first switch."""
        cache = new_cache(model)
        cache.read(model, prefix_ids.to(model_device(model)))
        self.remember(model, prefix_ids, cache)

    def _row_keys(self, prefix_ids: torch.Tensor, dtype: torch.dtype) -> list[tuple]:
        """A key per row of ``prefix_ids`` [batch, p]: this view's namespace, its token ids and the cache dtype."""
        return [(self.namespace, tuple(row.tolist()), dtype) for row in prefix_ids]
