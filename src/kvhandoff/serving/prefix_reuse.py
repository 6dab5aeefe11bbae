"""What the prefix tree's models hold of a prompt, and how a request is served from it: `PrefixTree.match` returns a
`PrefixMatch` (each model's `Hold`: its longest prefix, how much of it is its own exact K/V and how much mapped or
derived); `choose_reuse` turns that into the model's own hit, a handoff from the model holding the longest prefix
it may hand over (only the part the receiving model lacks is mapped), or a miss.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvhandoff.errors import ConfigError
from kvhandoff.serving.row_ops import RowOps


@dataclass(eq=False)
class PrefixHandle:
    """A path of one namespace's tree (from its root to a node) that `PrefixTree.lock` pins against eviction: what
    `match` and `insert` return. ``length``: the positions of the tokens asked about that the model holds."""

    namespace: str
    length: int
    node: Any = field(repr=False)
    owner: object = field(repr=False)
    locks: int = field(default=0, repr=False)


#: what `choose_reuse` decides for a request (`Reuse.kind`)
REUSE_KINDS = ("own", "handoff", "miss")


@dataclass(frozen=True)
class Hold:
    """What one model holds of a prompt: positions 0..``length`` − 1, the first ``exact`` of them its own K/V and
    the rest mapped or derived (``sources``: the models they were mapped from); ``mapped_until``: where its last run
    of a mapper's output ends (0: none), so its rows from there on may be handed over."""

    model: str
    length: int = 0
    exact: int = 0
    sources: tuple[str, ...] = ()
    mapped_until: int = 0
    # (start position, positions used, the node's segments) along the path, captured at the match
    parts: tuple = field(default=(), repr=False, compare=False)
    ops: RowOps | None = field(default=None, repr=False, compare=False)

    @property
    def mapped(self) -> bool:
        return self.length > self.exact

    def transferable(self, start: int) -> int:
        """How far this model's rows from position ``start`` on may be handed over to another model: to its end when
        no mapper's output lies past ``start``, else to the end of its exact rows (``start`` when none)."""
        if self.mapped_until <= start:
            return self.length
        return max(start, self.exact)


@dataclass(frozen=True)
class PrefixMatch:
    """The result of `PrefixTree.match`: what ``model`` and every other model hold (``holds``, models holding
    nothing left out) of a prompt of ``tokens`` ids, and the ``handle`` of the matched path. With ``exact_only``
    every hold stops at its first mapped position."""

    namespace: str
    model: str
    tokens: int
    exact_only: bool
    holds: Mapping[str, Hold]
    handle: PrefixHandle

    @property
    def own(self) -> Hold:
        """What the model asked about holds."""
        return self.hold(self.model)

    def hold(self, model: str) -> Hold:
        return self.holds.get(model, Hold(model))

    def rows(self, model: str, start: int = 0, end: int | None = None):
        """``model``'s rows of positions ``start``..``end`` − 1 (None: to the end of its hold) as new rows of its
        `RowOps` (a copy: valid whatever the tree does later). Call it on a worker thread."""
        hold = self.hold(model)
        end = hold.length if end is None else end
        if not 0 <= start < end <= hold.length:
            raise ConfigError(f"{model} holds positions 0..{hold.length - 1} of this prompt"
                              f"{' exactly' if self.exact_only else ''}; rows {start}..{end - 1} were asked for")
        pieces = []
        for depth, _, segments in hold.parts:
            offset = depth
            for segment in segments:
                first, offset = offset, offset + segment.positions
                if offset <= start or first >= end:
                    continue
                low, high = max(start, first) - first, min(end, offset) - first
                whole = low == 0 and high == segment.positions
                pieces.append(segment.rows if whole else hold.ops.slice(segment.rows, low, high))
        return hold.ops.concat(pieces)


@dataclass(frozen=True)
class Reuse:
    """How to serve a request (`choose_reuse`): ``kind`` "own" (the model's rows of positions 0..``own`` − 1),
    "handoff" (those, then ``source``'s exact rows of positions ``own``..``source_length`` − 1 mapped onto them) or
    "miss" (a prefill)."""

    kind: str
    own: int = 0
    source: str | None = None
    source_length: int = 0

    @property
    def reused(self) -> int:
        """The positions not computed by the model's forward over the prompt."""
        return self.source_length if self.kind == "handoff" else self.own


def choose_reuse(match: PrefixMatch, *, limit: int | None = None, sources: Collection[str] | None = None,
                 min_gain: int = 1) -> Reuse:
    """The reuse of ``match``: a handoff when a model in ``sources`` (None: any) holds, past what the model itself
    holds, at least ``min_gain`` positions it may hand over (its exact or derived rows: `Hold.transferable`), else
    its own rows, else a miss. Prefixes are capped at ``limit`` positions (e.g. the prompt's length − 1: the last
    token is read for its logits). A mapper's output is never a handoff's source (no position makes two trips
    through mappers) and an exact-only match never hands off (the mapped rows would serve it)."""
    cap = match.tokens if limit is None else limit
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
        raise ConfigError(f"limit must be a non-negative integer, got {limit!r}")
    if isinstance(min_gain, bool) or not isinstance(min_gain, int) or min_gain < 1:
        raise ConfigError(f"min_gain must be a positive integer, got {min_gain!r}")
    own = min(match.own.length, cap)
    if not match.exact_only:
        candidates = sorted((-min(hold.transferable(own), cap), name) for name, hold in match.holds.items()
                            if name != match.model and (sources is None or name in sources))
        if candidates and -candidates[0][0] - own >= min_gain:
            return Reuse("handoff", own, candidates[0][1], -candidates[0][0])
    return Reuse("own", own) if own else Reuse("miss")
