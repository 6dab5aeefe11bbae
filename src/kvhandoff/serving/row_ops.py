"""What the prefix tree (`prefix_tree.PrefixTree`) does with one engine's K/V rows, which are opaque to it: count,
slice and concatenate them along positions, and count their bytes (`RowOps`); `SEAM_ROWS`: those of the cache
seam's `DynamicCache` rows, what `KVCache.export` returns and `KVCache.append` takes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from transformers.cache_utils import DynamicCache

from kvhandoff.errors import ConfigError
from kvhandoff.model.cache import cache_view
from kvhandoff.runtime.seam import rows_of


@runtime_checkable
class RowOps(Protocol):
    """What the tree does with one engine's K/V rows (opaque to it): count, slice and concatenate them along
    positions, and count their bytes."""

    def positions(self, rows) -> int:
        """The positions ``rows`` hold."""

    def slice(self, rows, start: int, end: int):
        """The rows of positions ``start``..``end`` − 1 (views allowed: the tree copies what it keeps)."""

    def concat(self, parts: Sequence):
        """``parts`` one after the other as new rows that own their memory (a copy, even of a single part)."""

    def nbytes(self, rows) -> int:
        """The bytes ``rows`` hold."""


class SeamRows:
    """`RowOps` of the cache seam's rows: a `DynamicCache` of (keys, values) [batch, kv_heads, positions,
    head_dim] per layer (`KVCache.export`, `KVCache.append`, `Mapper.transfer`)."""

    def positions(self, rows: DynamicCache) -> int:
        if not rows.layers or rows.layers[0].keys is None:
            return 0
        return rows.layers[0].keys.shape[-2]

    def slice(self, rows: DynamicCache, start: int, end: int) -> DynamicCache:
        return cache_view(rows, start, end)

    def concat(self, parts: Sequence[DynamicCache]) -> DynamicCache:
        if not parts:
            raise ConfigError("concat needs at least one part")
        layers = {len(part.layers) for part in parts}
        if len(layers) != 1:
            raise ConfigError(f"rows of different layer counts cannot be joined: {sorted(layers)}")
        return rows_of((torch.cat([part.layers[i].keys for part in parts], dim=-2),
                        torch.cat([part.layers[i].values for part in parts], dim=-2))
                       for i in range(layers.pop()))

    def nbytes(self, rows: DynamicCache) -> int:
        return sum(tensor.numel() * tensor.element_size()
                   for layer in rows.layers for tensor in (layer.keys, layer.values) if tensor is not None)


SEAM_ROWS = SeamRows()
