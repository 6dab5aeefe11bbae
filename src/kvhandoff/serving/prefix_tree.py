"""The server's caches found by token prefix: which hosted model holds the K/V of which prompt prefix, its own
(exact) or mapped from another model, so a request is served from the longest prefix any model holds.

After SGLang's radix cache and vLLM's automatic prefix caching, across models: one radix tree per namespace (a
tenant; `tenants.namespace_of`), whose nodes each hold a run of token ids and, per model, that model's K/V rows of
exactly those positions with their `Provenance`. `PrefixTree.match` finds, for the model asked about and for every
other one, the longest prefix of a prompt it holds (a `prefix_reuse.PrefixMatch`); `choose_reuse`
(`prefix_reuse`) turns that into the model's own hit, a handoff from the model holding the longest exact prefix
(only the part the receiving model lacks is mapped), or a miss. `PrefixTree.stats`: its figures
(`prefix_tree_stats.TreeStats`).

Invariants: a model's payload on a node covers exactly the node's positions; a model holding a node holds its parent
(what a model holds of a prompt is a path from the root); every node but a root holds some model's payload. Rows are
opaque: the tree only counts, slices, concatenates and sizes them through `RowOps` (`row_ops.SEAM_ROWS`: the cache
seam's `DynamicCache` rows, what `KVCache.export` returns and `KVCache.append` takes), and keeps its own copies, so
the rows it hands out stay valid whatever happens to the caches they came from or to the tree afterwards.

Threads: one lock inside; every method is safe from any thread. `match`, `lock`, `unlock`, `evict`, `stats` and
`total_bytes` are bookkeeping (references, counters: no tensor work), fit for the event loop. `insert` copies the
rows it keeps (outside the lock; a node split copies the one straddling segment inside it) and
`PrefixMatch.rows` concatenates (outside the lock): call them on the model's worker thread. `evict` walks every node
(inside the lock).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvhandoff.errors import ConfigError, KVHandoffError
from kvhandoff.serving.prefix_reuse import Hold, PrefixHandle, PrefixMatch, choose_reuse
from kvhandoff.serving.prefix_tree_stats import TreeCounts, TreeStats
from kvhandoff.serving.row_ops import SEAM_ROWS, RowOps
from kvhandoff.serving.tenants import DEFAULT_NAMESPACE, namespace_of

# what docs/API.md documents here: the tree, and from `prefix_reuse` and `tenants` the reuse decision and namespaces
__all__ = ["DEFAULT_NAMESPACE", "EXACT", "PROVENANCES", "PrefixHandle", "PrefixTree", "Provenance", "choose_reuse",
           "derived_from", "mapped_from", "namespace_of"]

logger = logging.getLogger(__name__)

#: what a model's rows are: its own ("exact": computed by the model on its own exact prefix), "mapped" (a mapper's
#: output from another model's K/V) or "derived" (computed by the model itself on top of mapped rows). Mapped and
#: derived rows are approximate; derived rows may be a handoff's source, mapped ones never (no position makes two
#: trips through mappers)
PROVENANCES = ("exact", "mapped", "derived")

# the longest segment the in-place growth of a leaf merges into (a merge is a copy inside the lock: kept small)
_MERGE_POSITIONS = 256


# -- provenance -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Provenance:
    """Where a model's rows come from: ``kind`` "exact" (its own), "mapped" from ``source``'s (a model name), or
    "derived": computed on top of rows mapped from ``source``'s."""

    kind: str = "exact"
    source: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in PROVENANCES:
            raise ConfigError(f"provenance must be one of {', '.join(PROVENANCES)}, got {self.kind!r}")
        if self.kind == "exact" and self.source is not None:
            raise ConfigError(f"exact rows have no source model, got source {self.source!r}")
        if self.kind != "exact":
            _name(self.source, f"a {self.kind} provenance's source model")

    @property
    def exact(self) -> bool:
        return self.kind == "exact"


EXACT = Provenance()


def mapped_from(source: str) -> Provenance:
    """The provenance of rows a mapper made from ``source``'s K/V."""
    return Provenance("mapped", source)


def derived_from(source: str) -> Provenance:
    """The provenance of rows a model computed itself on top of rows mapped from ``source``'s K/V."""
    return Provenance("derived", source)


# -- segments, handles -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Segment:
    """Rows the tree owns, of ``positions`` positions and ``nbytes`` bytes."""

    rows: Any
    positions: int
    nbytes: int


# -- the tree ----------------------------------------------------------------------------------------------------------
@dataclass(eq=False)
class _Payload:
    provenance: Provenance
    segments: list[_Segment]
    nbytes: int


class _Node:
    __slots__ = ("alive", "children", "last_access", "lock_ref", "parent", "payloads", "tokens")

    def __init__(self, tokens: tuple[int, ...], parent: _Node | None, last_access: int = 0) -> None:
        self.tokens = tokens
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.payloads: dict[str, _Payload] = {}
        self.lock_ref = 0
        self.last_access = last_access
        self.alive = True


class PrefixTree:
    """The K/V rows of token prefixes, per namespace and model (see the module docstring).

    ops: the `RowOps` of every model's rows (default `SEAM_ROWS`); model_ops: other `RowOps` for some models (an
    engine whose rows are of its own type)."""

    def __init__(self, ops: RowOps = SEAM_ROWS, model_ops: Mapping[str, RowOps] | None = None) -> None:
        for name, candidate in {"ops": ops, **dict(model_ops or {})}.items():
            if not isinstance(candidate, RowOps):
                raise ConfigError(f"{name}: row operations need positions, slice, concat and nbytes, got "
                                  f"{type(candidate).__name__}")
        self._default_ops = ops
        self._model_ops = dict(model_ops or {})
        self._lock = threading.Lock()
        self._roots: dict[str, _Node] = {}
        self._clock = 0  # a counter, not time: the order of matches and inserts is what LRU needs
        self._counts = TreeCounts()

    # -- lookup ---------------------------------------------------------------------------------------------------
    def match(self, namespace: str, tokens, model: str, exact_only: bool = False, *,
              lock: bool = False, count: bool = True) -> PrefixMatch:
        """The longest prefix of ``tokens`` that ``model`` holds (its own rows only, with ``exact_only``; else its
        own then mapped ones), and what every other model holds; with ``lock`` the matched path is pinned in the
        same step (`unlock` its handle when the request ends). ``count``: a request's lookup, counted in `stats`
        (False: a lookup of held rows, e.g. a run reused at another offset)."""
        namespace, model, tokens = _name(namespace, "namespace"), _name(model, "model"), _token_ids(tokens)
        with self._lock:
            self._clock += 1
            root = self._roots.get(namespace)
            path = _walk(root, tokens) if root is not None else []
            for node, _, _ in path:
                node.last_access = self._clock
            holds, deepest = _holds(path, exact_only)
            holds = {name: Hold(name, *hold, ops=self._ops(name)) for name, hold in holds.items()}
            own = holds.get(model, Hold(model))
            node = path[deepest][0] if deepest is not None else None
            handle = PrefixHandle(namespace, own.length, node, self)
            if lock:
                self._pin(handle)
            if count:
                self._counts.count_match(model, own, holds, len(tokens))
        return PrefixMatch(namespace, model, len(tokens), exact_only, holds, handle)

    # -- insert ---------------------------------------------------------------------------------------------------
    def insert(self, namespace: str, tokens, model: str, rows, provenance: Provenance = EXACT, *, start: int = 0,
               lock: bool = False) -> PrefixHandle:
        """Keep ``model``'s ``rows`` of positions ``start``..len(tokens) − 1 of ``tokens`` (a copy of what the tree
        lacks). Positions the model already holds stay as they are, except mapped ones under exact rows (replaced).
        Rows past a position the model does not hold (``start`` past its prefix) are not kept: the handle's
        ``length`` says how far the model's prefix reaches. A leaf only this model holds grows in place (an
        answer's tokens inserted as they are generated). With ``lock`` the path is pinned in the same step."""
        namespace, model, tokens = _name(namespace, "namespace"), _name(model, "model"), _token_ids(tokens)
        if not isinstance(provenance, Provenance):
            raise ConfigError(f"provenance must be a Provenance (EXACT or mapped_from(model)), got {provenance!r}")
        if provenance.source == model:
            raise ConfigError(f"rows of {model} cannot be mapped from {model} itself")
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start < len(tokens):
            raise ConfigError(f"start must be in 0..{len(tokens) - 1} (at least one position inserted), got {start!r}")
        ops = self._ops(model)
        count = ops.positions(rows)
        if count != len(tokens) - start:
            raise ConfigError(f"rows of {count} positions for positions {start}..{len(tokens) - 1} of the tokens "
                              f"({len(tokens) - start} positions)")
        with self._lock:
            ranges = _missing(self._roots.get(namespace), tokens, model, provenance, start)
        pieces = [(first, _owned(ops, rows, first - start, last - start)) for first, last in ranges]  # unlocked copy
        with self._lock:
            return self._commit(namespace, tokens, model, provenance, pieces, lock)

    def _commit(self, namespace, tokens, model, provenance, pieces, lock) -> PrefixHandle:
        """Store ``pieces`` (start, `_Segment`) of ``model``'s rows along ``tokens``, splitting and growing nodes;
        the tree may have changed since the pieces were cut, so a piece is cut again (or left unused) as needed."""
        self._clock += 1
        ops = self._ops(model)
        root = self._roots.setdefault(namespace, _Node((), None))
        node, depth, end = root, 0, len(tokens)
        while depth < end:
            child = node.children.get(tokens[depth])
            if child is None:
                segments = _take(pieces, depth, end, ops)
                if segments is not None:
                    node, depth = self._grow(node, tokens[depth:], model, provenance, segments), end
                break
            count = _common_length(child.tokens, tokens, depth)
            payload = child.payloads.get(model)
            replace = payload is None or (provenance.exact and not payload.provenance.exact)
            segments = _take(pieces, depth, depth + count, ops) if replace else None
            if payload is None and segments is None:  # positions the model lacks and no rows for them
                break
            if count < len(child.tokens) and (segments is not None or depth + count < end):
                child = self._split(child, count)
            child.last_access = self._clock
            if segments is not None:
                self._store(child, model, provenance, segments)
            node, depth = child, depth + count
            if count < len(child.tokens):  # the tokens end inside a node the model holds
                break
        if not root.children:
            del self._roots[namespace]
        handle = PrefixHandle(namespace, depth, node if node is not root else None, self)
        if lock:
            self._pin(handle)
        return handle

    def _grow(self, node: _Node, tokens: tuple[int, ...], model: str, provenance: Provenance,
              segments: list[_Segment]) -> _Node:
        """``node``'s new child of ``tokens`` holding ``segments``, or ``node`` itself grown by them when it is a leaf
        only ``model`` holds, alike (in place: an answer inserted token by token stays one node)."""
        payload = node.payloads.get(model)
        if (node.parent is not None and not node.children and len(node.payloads) == 1 and payload is not None
                and payload.provenance == provenance):
            merged = _merge_tail([*payload.segments, *segments], self._ops(model))
            node.tokens += tokens
            node.last_access = self._clock
            self._counts.account(model, sum(s.nbytes for s in merged) - payload.nbytes, 0)
            payload.segments, payload.nbytes = merged, sum(s.nbytes for s in merged)
            return node
        child = _Node(tokens, node, self._clock)
        node.children[tokens[0]] = child
        self._counts.nodes += 1
        self._store(child, model, provenance, segments)
        return child

    def _split(self, node: _Node, count: int) -> _Node:
        """Split ``node`` after its first ``count`` tokens; returns the new upper node. ``node`` stays the lower part
        (handles of it keep their meaning) and its locks carry over to the upper node (on every locked path)."""
        cuts = {name: _cut(payload.segments, count, self._ops(name)) for name, payload in node.payloads.items()}
        upper = _Node(node.tokens[:count], node.parent, node.last_access)
        upper.lock_ref = node.lock_ref
        for name, (top, bottom) in cuts.items():
            old = node.payloads[name]
            upper.payloads[name] = _Payload(old.provenance, top, sum(s.nbytes for s in top))
            node.payloads[name] = _Payload(old.provenance, bottom, sum(s.nbytes for s in bottom))
            self._counts.account(name, upper.payloads[name].nbytes + node.payloads[name].nbytes - old.nbytes, 1)
        node.parent.children[node.tokens[0]] = upper
        node.tokens, node.parent = node.tokens[count:], upper
        upper.children[node.tokens[0]] = node
        self._counts.nodes += 1
        return upper

    def _store(self, node: _Node, model: str, provenance: Provenance, segments: list[_Segment]) -> None:
        old = node.payloads.get(model)
        payload = _Payload(provenance, list(segments), sum(s.nbytes for s in segments))
        node.payloads[model] = payload
        self._counts.account(model, payload.nbytes - (old.nbytes if old else 0), 0 if old else 1)

    # -- locks ----------------------------------------------------------------------------------------------------
    def lock(self, handle: PrefixHandle) -> None:
        """Pin ``handle``'s path (its nodes, every model's rows on them) until as many `unlock` s: a request in
        flight keeps its nodes. A path evicted before it was locked is refused (match or insert with ``lock``)."""
        with self._lock:
            self._pin(handle)

    def unlock(self, handle: PrefixHandle) -> None:
        """Undo one `lock` of ``handle``."""
        with self._lock:
            self._check_handle(handle)
            if not handle.locks:
                raise KVHandoffError("unlock of a prefix handle that is not locked")
            node = handle.node
            while node is not None:
                node.lock_ref -= 1
                node = node.parent
            handle.locks -= 1
            self._counts.locked -= 1

    def _pin(self, handle: PrefixHandle) -> None:
        self._check_handle(handle)
        node = handle.node
        if node is not None and not node.alive:
            raise KVHandoffError("the prefix handle's path was evicted before it was locked; match (or insert) "
                                 "with lock=True to pin it in the same step")
        while node is not None:
            node.lock_ref += 1
            node = node.parent
        handle.locks += 1
        self._counts.locked += 1

    def _check_handle(self, handle) -> None:
        if not isinstance(handle, PrefixHandle) or handle.owner is not self:
            raise ConfigError("the handle is not one of this prefix tree's")

    # -- memory ---------------------------------------------------------------------------------------------------
    def evict(self, limit_bytes: int, model: str | None = None) -> int:
        """Drop payloads, least recently matched or inserted first, until the tree (``model``: that model's part)
        holds at most ``limit_bytes``; returns the bytes dropped. Only a model's last payload on a path goes (its
        leaf: a node none of whose children it holds); a node goes with its last payload, and its parent may become
        a leaf; nodes of locked paths stay, so the limit may not be reached."""
        if isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int) or limit_bytes < 0:
            raise ConfigError(f"limit_bytes must be a non-negative integer, got {limit_bytes!r}")
        if model is not None:
            model = _name(model, "model")
        with self._lock:
            def held() -> int:
                return self._counts.bytes_held(model)

            if held() <= limit_bytes:
                return 0
            order = itertools.count()
            heap = [(node.last_access, name, next(order), node) for root in self._roots.values()
                    for node in _descendants(root) for name in node.payloads
                    if (model is None or name == model) and _evictable(node, name)]
            heapq.heapify(heap)
            freed = 0
            while heap and held() > limit_bytes:
                _, name, _, node = heapq.heappop(heap)
                if not _evictable(node, name):  # an entry gone stale since it was pushed
                    continue
                parent = node.parent
                freed += self._drop(node, name)
                for other in parent.payloads:
                    if (model is None or other == model) and _evictable(parent, other):
                        heapq.heappush(heap, (parent.last_access, other, next(order), parent))
            if held() > limit_bytes:
                logger.debug("prefix tree: %d bytes held past the limit of %d (locked paths)", held(), limit_bytes)
            return freed

    def _drop(self, node: _Node, model: str) -> int:
        """Drop ``model``'s payload on ``node`` (a leaf of its), and ``node`` when nothing is left on it."""
        payload = node.payloads.pop(model)
        self._counts.count_eviction(model, payload.nbytes)
        if not node.payloads:  # no model holds it, so none holds a child either: the node is a leaf
            parent = node.parent
            del parent.children[node.tokens[0]]
            node.alive, node.parent = False, None
            self._counts.nodes -= 1
            self._counts.node_evictions += 1
            if parent.parent is None and not parent.children:
                self._roots = {key: root for key, root in self._roots.items() if root is not parent}
        return payload.nbytes

    def total_bytes(self) -> int:
        with self._lock:
            return self._counts.bytes_held()

    # -- stats ----------------------------------------------------------------------------------------------------
    def stats(self) -> TreeStats:
        with self._lock:
            return self._counts.snapshot(len(self._roots))

    def _ops(self, model: str) -> RowOps:
        return self._model_ops.get(model, self._default_ops)


# -- pure helpers ------------------------------------------------------------------------------------------------------
def _name(value, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{what} must be a non-empty string, got {value!r}")
    return value


def _token_ids(tokens) -> tuple[int, ...]:
    """``tokens`` (a sequence of token ids, or a 1-D tensor of them) as a tuple, validated."""
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1:
            raise ConfigError(f"token ids must be one sequence (a 1-D tensor), got shape {tuple(tokens.shape)}")
        tokens = tokens.tolist()
    if isinstance(tokens, str | bytes) or not isinstance(tokens, Iterable):
        raise ConfigError(f"token ids must be a sequence of integers, got {type(tokens).__name__}")
    ids = tuple(tokens)
    if not ids:
        raise ConfigError("token ids: at least one is needed")
    if not all(type(token) is int for token in ids) or min(ids) < 0:
        bad = next(token for token in ids if type(token) is not int or token < 0)
        raise ConfigError(f"token ids must be non-negative integers, got {bad!r}")
    return ids


def _common_length(run: tuple[int, ...], tokens: tuple[int, ...], offset: int) -> int:
    """How many leading ids of ``run`` equal ``tokens`` from ``offset`` on."""
    if tokens[offset : offset + len(run)] == run:  # the usual case, compared at C speed
        return len(run)
    count = 0
    for mine, theirs in zip(run, tokens[offset:], strict=False):
        if mine != theirs:
            break
        count += 1
    return count


def _walk(root: _Node, tokens: tuple[int, ...]) -> list[tuple[_Node, int, int]]:
    """The nodes along ``tokens`` from ``root``: (node, its first position, how many of its tokens match)."""
    path, node, depth = [], root, 0
    while depth < len(tokens):
        child = node.children.get(tokens[depth])
        if child is None:
            break
        count = _common_length(child.tokens, tokens, depth)
        path.append((child, depth, count))
        if count < len(child.tokens):
            break
        node, depth = child, depth + count
    return path


def _holds(path, exact_only: bool) -> tuple[dict[str, tuple], int | None]:
    """What each model holds along ``path``: name → (length, exact, sources, mapped_until, parts), and the index of
    the deepest node any of them uses (None: none)."""
    found: dict[str, list] = {}
    alive: Iterable[str] | None = None
    deepest = None
    for index, (node, depth, count) in enumerate(path):
        still = []
        for name in (node.payloads if alive is None else alive):
            payload = node.payloads.get(name)
            if payload is None or (exact_only and not payload.provenance.exact):
                continue
            length, exact, sources, parts, _ = found.setdefault(name, [0, 0, [], [], 0])
            if payload.provenance.exact and exact == length:
                found[name][1] = depth + count
            elif not payload.provenance.exact and payload.provenance.source not in sources:
                sources.append(payload.provenance.source)
            if payload.provenance.kind == "mapped":
                found[name][4] = depth + count
            found[name][0] = depth + count
            parts.append((depth, count, tuple(payload.segments)))
            still.append(name)
            deepest = index
        alive = still
        if not alive:
            break
    return {name: (length, exact, tuple(sources), mapped_until, tuple(parts))
            for name, (length, exact, sources, parts, mapped_until) in found.items()}, deepest


def _missing(root: _Node | None, tokens: tuple[int, ...], model: str, provenance: Provenance,
             start: int) -> list[tuple[int, int]]:
    """The position ranges of ``tokens`` an insert of ``model``'s rows from ``start`` would store, one per node they
    will fill: those the model lacks (from its prefix's end on; none if that is before ``start``) and, for exact
    rows, those it holds mapped from ``start`` on."""
    ranges, reached = [], 0
    for node, depth, count in _walk(root, tokens) if root is not None else []:
        payload = node.payloads.get(model)
        if payload is None and depth < start:
            return ranges
        if depth >= start and (payload is None or (provenance.exact and not payload.provenance.exact)):
            ranges.append((depth, depth + count))
        reached = depth + count
    if start <= reached < len(tokens):
        ranges.append((reached, len(tokens)))
    return ranges


def _owned(ops: RowOps, rows, start: int, end: int) -> _Segment:
    """A copy of ``rows``' positions ``start``..``end`` − 1, as a segment the tree owns."""
    copy = ops.concat([ops.slice(rows, start, end)])
    return _Segment(copy, end - start, ops.nbytes(copy))


def _take(pieces: Sequence[tuple[int, _Segment]], first: int, last: int, ops: RowOps) -> list[_Segment] | None:
    """Segments of positions ``first``..``last`` − 1 from ``pieces`` (start, segment), cut where a piece straddles
    an end; None unless the pieces cover them all."""
    taken, position = [], first
    for start, segment in pieces:
        end = start + segment.positions
        if end <= position or start >= last:
            continue
        if start > position:
            return None
        whole = start == position and end <= last
        taken.append(segment if whole else _owned(ops, segment.rows, position - start, min(end, last) - start))
        position = min(end, last)
        if position == last:
            return taken
    return None


def _cut(segments: Sequence[_Segment], count: int, ops: RowOps) -> tuple[list[_Segment], list[_Segment]]:
    """``segments`` split after ``count`` positions; a segment across the cut is copied into two (neither half
    keeps the other's memory alive)."""
    top, bottom, offset = [], [], 0
    for segment in segments:
        if offset + segment.positions <= count:
            top.append(segment)
        elif offset >= count:
            bottom.append(segment)
        else:
            inside = count - offset
            top.append(_owned(ops, segment.rows, 0, inside))
            bottom.append(_owned(ops, segment.rows, inside, segment.positions))
        offset += segment.positions
    return top, bottom


def _merge_tail(segments: list[_Segment], ops: RowOps) -> list[_Segment]:
    """``segments`` with their last ones joined while the one before is no longer than the last (a binary counter:
    few segments, each position copied a few times), up to `_MERGE_POSITIONS` positions a segment."""
    segments = list(segments)
    while (len(segments) >= 2 and segments[-2].positions <= segments[-1].positions
           and segments[-2].positions + segments[-1].positions <= _MERGE_POSITIONS):
        joined = ops.concat([segments[-2].rows, segments[-1].rows])
        segments[-2:] = [_Segment(joined, segments[-2].positions + segments[-1].positions, ops.nbytes(joined))]
    return segments


def _descendants(root: _Node) -> Iterable[_Node]:
    stack = list(root.children.values())
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


def _evictable(node: _Node, model: str) -> bool:
    """Whether ``model``'s payload on ``node`` may go now: the node is alive, unlocked, not a root, and none of its
    children holds the model."""
    return (node.alive and node.parent is not None and not node.lock_ref and model in node.payloads
            and not any(model in child.payloads for child in node.children.values()))
