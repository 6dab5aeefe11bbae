"""The prefix tree's figures for /metrics and /health (`TreeStats`, per model `ModelStats`), and the running
counts behind them (`TreeCounts`), kept by `prefix_tree.PrefixTree` under its lock."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvhandoff.serving.prefix_reuse import Hold


@dataclass(frozen=True)
class ModelStats:
    """One model's part of the tree: bytes and nodes held; matches asking for it that its own exact rows served
    (``hits_own``), that mapped rows served (``hits_mapped``) or nothing (``misses``), those where another model
    held a longer exact prefix (``handoff_candidates``), the positions asked for and served; payloads evicted."""

    bytes: int = 0
    nodes: int = 0
    hits_own: int = 0
    hits_mapped: int = 0
    misses: int = 0
    handoff_candidates: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0
    evictions: int = 0
    evicted_bytes: int = 0


@dataclass(frozen=True)
class TreeStats:
    """The tree for /metrics and /health: bytes, nodes, namespaces, nodes evicted, handles locked, per model."""

    bytes: int
    nodes: int
    namespaces: int
    evictions: int
    locked: int
    models: dict[str, ModelStats]

    def to_dict(self) -> dict:
        return asdict(self)


class TreeCounts:
    """What `TreeStats` reports, counted as the tree changes: its nodes, the nodes evicted and the handles locked
    (attributes the tree updates) and, per model, the fields of `ModelStats`. Not thread-safe: the tree's lock
    guards it."""

    def __init__(self) -> None:
        self.nodes = 0
        self.node_evictions = 0
        self.locked = 0
        self._models: dict[str, dict[str, int]] = {}

    def bytes_held(self, model: str | None = None) -> int:
        """The bytes the tree holds (``model``: that model's part)."""
        if model is None:
            return sum(counts["bytes"] for counts in self._models.values())
        return self._models.get(model, {}).get("bytes", 0)

    def account(self, model: str, nbytes: int, nodes: int) -> None:
        """``model`` holds ``nbytes`` more bytes on ``nodes`` more nodes (negative: fewer)."""
        counts = self._model(model)
        counts["bytes"] += nbytes
        counts["nodes"] += nodes

    def count_eviction(self, model: str, nbytes: int) -> None:
        """``model``'s payload of ``nbytes`` bytes on one node was evicted."""
        self.account(model, -nbytes, -1)
        counts = self._models[model]
        counts["evictions"] += 1
        counts["evicted_bytes"] += nbytes

    def count_match(self, model: str, own: Hold, holds: Mapping[str, Hold], tokens: int) -> None:
        """A match of ``tokens`` ids asking for ``model``, which holds ``own`` of them (``holds``: every model's)."""
        counts = self._model(model)
        counts["queried_tokens"] += tokens
        counts["hit_tokens"] += own.length
        kind = "misses" if not own.length else "hits_mapped" if own.mapped else "hits_own"
        counts[kind] += 1
        if any(hold.transferable(own.length) > own.length for name, hold in holds.items() if name != model):
            counts["handoff_candidates"] += 1

    def snapshot(self, namespaces: int) -> TreeStats:
        """The figures now, for a tree of ``namespaces`` namespaces."""
        return TreeStats(self.bytes_held(), self.nodes, namespaces, self.node_evictions, self.locked,
                         {name: ModelStats(**counts) for name, counts in sorted(self._models.items())})

    def _model(self, model: str) -> dict[str, int]:
        counts = self._models.get(model)
        if counts is None:
            counts = self._models[model] = asdict(ModelStats())
        return counts
