"""Finding a run of tokens that a cached conversation holds at another offset: the history a conversation carries
behind other instructions (another agent's system prompt, another tool list), which a prefix match cannot see.

`RunIndex` keeps, per tenant, where a reused run may start in each cached token sequence it is told of: the anchors,
the positions of the tokens that open a chat message (the caller's anchor ids, e.g. ``<|im_start|>``), keyed by the
first ``probe`` tokens from there. `RunIndex.find` returns the longest run of a prompt that a held sequence of the
same tenant also holds from an anchor, after a beginning that differs (a plain prefix is the prefix cache's), at
least ``min_length`` tokens: `RunMatch`; callers look before the prompt's new turn (`RunIndex.new_turn_start`), which
the model reads itself. `kvhandoff.runtime.offset.reuse_run` then reuses the held rows of that run.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from kvhandoff.config import require_positive
from kvhandoff.errors import ConfigError

#: tokens from an anchor that key it: a run shorter than this is not looked for
DEFAULT_PROBE = 16
#: the shortest run worth reusing (a shorter one saves less than its recompute and bookkeeping cost)
DEFAULT_MIN_RUN = 64
#: held sequences kept over all tenants (the least recently added forgotten past it)
DEFAULT_MAX_HELD = 1024
#: a prompt's last message opener this close to its end opens the generation prompt (the answer's role header)
GENERATION_PROMPT_TOKENS = 8


def _ids(tokens: Sequence[int]) -> array:
    return array("q", (int(token) for token in tokens))


@dataclass(frozen=True)
class RunMatch:
    """A run of ``length`` tokens at ``prompt_start`` in the prompt, held by sequence ``key`` at ``held_start``."""

    key: Hashable
    prompt_start: int
    held_start: int
    length: int

    @property
    def shift(self) -> int:
        """How far the run moves: its position in the prompt less its position in the held sequence."""
        return self.prompt_start - self.held_start


class RunIndex:
    """The anchors of held token sequences by tenant (see the module docstring). ``anchor_ids``: the token ids that
    open a message; ``probe``: tokens from an anchor that key it; ``min_length``: the shortest run `find` returns;
    ``max_held``: the sequences kept over all tenants (the least recently added forgotten first). A sequence added
    makes those it extends (held by the same tenant) redundant: they are forgotten."""

    def __init__(self, anchor_ids: Iterable[int], probe: int = DEFAULT_PROBE, min_length: int = DEFAULT_MIN_RUN,
                 max_held: int = DEFAULT_MAX_HELD):
        self.anchor_ids = frozenset(int(token) for token in anchor_ids)
        if not self.anchor_ids:
            raise ConfigError("a run index needs the token ids that open a message (e.g. <|im_start|>'s)")
        self.probe = require_positive("run index probe", probe)
        self.min_length = require_positive("run index min_length", min_length)
        self.max_held = require_positive("run index max_held", max_held)
        if self.min_length < self.probe:
            raise ConfigError(f"run index min_length ({min_length}) must be at least its probe ({probe})")
        self._held: OrderedDict[tuple[str, Hashable], array] = OrderedDict()
        self._anchors: dict[tuple[str, tuple[int, ...]], dict[Hashable, list[int]]] = {}

    def __len__(self) -> int:
        return len(self._held)

    def _anchor_keys(self, tokens: Sequence[int]) -> Iterable[tuple[int, tuple[int, ...]]]:
        for position, token in enumerate(tokens):
            if token in self.anchor_ids and position + self.probe <= len(tokens):
                yield position, tuple(tokens[position: position + self.probe])

    def held(self, key: Hashable, tenant: str = "default") -> Sequence[int] | None:
        """The token ids held under ``key`` in ``tenant`` (None: none)."""
        return self._held.get((tenant, key))

    def add(self, key: Hashable, tokens: Sequence[int], tenant: str = "default") -> None:
        """Hold ``tokens`` under ``key`` in ``tenant`` (replacing what the key held; forgetting the sequences of the
        tenant that ``tokens`` extends, and the least recently added past ``max_held``)."""
        self.remove(key, tenant)
        held = _ids(tokens)
        anchors = list(self._anchor_keys(held))
        if anchors:  # a sequence this one extends shares its first anchor at the same position
            first, probe = anchors[0]
            for other, positions in list(self._anchors.get((tenant, probe), {}).items()):
                previous = self._held[tenant, other]
                if first in positions and len(previous) <= len(held) and held[:len(previous)] == previous:
                    self.remove(other, tenant)
        self._held[tenant, key] = held
        for position, probe in anchors:
            self._anchors.setdefault((tenant, probe), {}).setdefault(key, []).append(position)
        while len(self._held) > self.max_held:
            (old_tenant, old_key), _ = next(iter(self._held.items()))
            self.remove(old_key, old_tenant)

    def remove(self, key: Hashable, tenant: str = "default") -> None:
        """Forget ``key`` in ``tenant`` (nothing if it is not held)."""
        held = self._held.pop((tenant, key), None)
        if held is None:
            return
        for _, probe in self._anchor_keys(held):
            entries = self._anchors.get((tenant, probe))
            if entries is not None:
                entries.pop(key, None)
                if not entries:
                    del self._anchors[tenant, probe]

    def new_turn_start(self, prompt: Sequence[int]) -> int:
        """Where ``prompt``'s new turn begins: the opener of its last message (a generation prompt's skipped), which
        the model reads itself, as at any switch — a run reused is looked for before it; without an anchor, the
        prompt's last token."""
        anchors = [position for position, token in enumerate(prompt) if token in self.anchor_ids]
        if anchors and len(prompt) - anchors[-1] <= GENERATION_PROMPT_TOKENS:
            anchors.pop()
        return anchors[-1] if anchors else max(0, len(prompt) - 1)

    def find(self, prompt: Sequence[int], tenant: str = "default") -> RunMatch | None:
        """The longest run of ``prompt`` that a sequence of ``tenant`` holds from one of its anchors after another
        beginning, at least ``min_length`` tokens (ties: the earliest in the prompt); None when there is none."""
        prompt = _ids(prompt)
        best: RunMatch | None = None
        for start, probe in self._anchor_keys(prompt):
            for key, positions in self._anchors.get((tenant, probe), {}).items():
                held = self._held[tenant, key]
                for held_start in positions:
                    if held_start == start and held[:start] == prompt[:start]:
                        continue  # a plain prefix: the prefix cache's
                    length = self.probe
                    while (start + length < len(prompt) and held_start + length < len(held)
                           and prompt[start + length] == held[held_start + length]):
                        length += 1
                    if length >= self.min_length and (best is None or length > best.length):
                        best = RunMatch(key, start, held_start, length)
        return best
