"""The target's own K/V of exact prefixes, kept across handoffs (a conversation's opening is recomputed once)."""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict

import torch

from kvhandoff.errors import ConfigError
from kvhandoff.model.cache import model_device
from kvhandoff.runtime.seam import as_kv_cache, new_cache, rows_of


class PrefixStore:
    """The target's own K/V of the exact prefix (the first tokens of a handed-over context), by model and token ids.

    A router's conversations open alike (chat template, system prompt), so after the first handoff of an opening the
    target's K/V of its exact prefix are copied from here instead of recomputed, and the target's first forward
    after a switch reads only the new tokens. The K/V of positions 0..p−1 depend on those p tokens alone (causal
    attention), so a copy is exact. Holds up to ``capacity`` openings per model, least recently used dropped first;
    it assumes a model's weights do not change in place (`clear` it if they do). Thread-safe."""

    def __init__(self, capacity: int = 256) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ConfigError(f"a prefix store holds at least one opening, got capacity {capacity!r}")
        self.capacity = capacity
        self._entries: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def __len__(self) -> int:
        with self._lock:
            return sum(len(entries) for entries in self._entries.values())

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def lookup(self, model, prefix_ids: torch.Tensor, dtype: torch.dtype):
        """The stored K/V of ``prefix_ids`` [batch, p] as rows (the cache seam's format: positions 0..p−1 of every
        layer), or None unless every row is stored."""
        keys = _row_keys(prefix_ids, dtype)
        with self._lock:
            entries = self._entries.get(model, {})
            rows = [entries.get(key) for key in keys]
            if any(row is None for row in rows):
                self.misses += 1
                return None
            self.hits += 1
            for key in keys:
                entries.move_to_end(key)
        return rows_of((torch.cat([row[i][0] for row in rows]), torch.cat([row[i][1] for row in rows]))
                       for i in range(len(rows[0])))

    def remember(self, model, prefix_ids: torch.Tensor, cache) -> None:
        """Store ``cache``'s positions 0..p−1 (a `KVCache`'s or a `transformers` cache's: the target's own K/V of
        ``prefix_ids`` [batch, p]), row by row."""
        count, cache = prefix_ids.shape[1], as_kv_cache(cache)
        keys = _row_keys(prefix_ids, cache.dtype)
        layers = [(layer.keys, layer.values) for layer in cache.export(0, count).layers]
        with self._lock:
            entries = self._entries.setdefault(model, OrderedDict())
            for row, key in enumerate(keys):
                entries[key] = [(k[row : row + 1].clone(), v[row : row + 1].clone()) for k, v in layers]
                entries.move_to_end(key)
            while len(entries) > self.capacity:
                entries.popitem(last=False)

    @torch.inference_mode()
    def prime(self, model, prefix_ids: torch.Tensor) -> None:
        """Store ``model``'s own K/V of ``prefix_ids`` [batch, p] (a prefill of those p tokens), e.g. a system
        prompt's opening before the first switch."""
        cache = new_cache(model)
        cache.read(model, prefix_ids.to(model_device(model)))
        self.remember(model, prefix_ids, cache)


def _row_keys(prefix_ids: torch.Tensor, dtype: torch.dtype) -> list[tuple]:
    """A `PrefixStore` key per row of ``prefix_ids`` [batch, p]: its token ids and the cache dtype."""
    return [(tuple(row.tolist()), dtype) for row in prefix_ids]
