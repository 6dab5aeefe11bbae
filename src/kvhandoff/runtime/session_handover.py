"""A `SwitchingSession`'s handovers: how they are made (`HANDOVERS`), the check of its settings when it starts
(`check_settings`), the handover itself (`pair_mapper`, `hand_over`: the conversation mapped for the model it goes
to) and its record (`Handover`), by which it can be taken back."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kvhandoff.errors import ConfigError
from kvhandoff.runtime.handoff import MappedCache, catch_up, map_for_target, verify_mapper
from kvhandoff.runtime.plan import HandoffPlan
from kvhandoff.runtime.policy import SelectionInfo
from kvhandoff.runtime.seam import CacheFactory
from kvhandoff.runtime.session_caches import SessionCaches

#: how a conversation is handed over at a switch: "all" — the current server's whole cache is mapped for the new
#: server; "incremental" — every model keeps its own cache and only the positions it has not cached are mapped
HANDOVERS = ("all", "incremental")


def check_settings(models: Mapping, mappers: Mapping, handover: str, plan: HandoffPlan | None,
                   pair_plans: Mapping[tuple[str, str], HandoffPlan]) -> None:
    """ConfigError for a session's settings that do not fit together (a handover not of `HANDOVERS`, a plan that is
    no `HandoffPlan`, a pair plan or a mapper naming unknown models); MapperMismatchError for a mapper fitted for
    another pair than the models it is given for."""
    if handover not in HANDOVERS:
        raise ConfigError(f"handover must be one of {', '.join(HANDOVERS)}, got {handover!r}")
    for given in (plan, *pair_plans.values()):
        if given is not None and not isinstance(given, HandoffPlan):
            raise ConfigError(f"a session's plan is a HandoffPlan (HandoffPlan.of reads the settings), got "
                              f"{given!r}")
    unknown = [pair for pair in pair_plans if pair not in mappers]
    if unknown:
        raise ConfigError(f"pair_plans name pairs without a mapper: {unknown}")
    for (source, target), mapper in mappers.items():
        unknown = [name for name in (source, target) if name not in models]
        if unknown:
            raise ConfigError(f"mapper {source} → {target} names unknown model(s) {unknown}; the session "
                              f"serves {', '.join(models)}")
        verify_mapper(mapper, models[source], models[target])


def pair_mapper(mappers: Mapping, source: str, target: str):
    """The mapper of a handover from ``source`` to ``target``; ConfigError when the session holds none."""
    mapper = mappers.get((source, target))
    if mapper is None:
        raise ConfigError(f"no mapper for the handoff {source} → {target}")
    return mapper


@dataclass(frozen=True)
class Handover:
    """What a handover changed, so that it can be taken back (`SwitchingSession.undo_handover`): from ``source`` to
    ``target`` at ``at`` tokens of the conversation; ``held`` / ``own``: the positions the target's cache held, and
    its own exact ones, before it (held None: it had no cache)."""

    source: str
    target: str
    at: int
    held: int | None
    own: int

    @staticmethod
    def undoable(last: Handover | None, handover: str, owner: str | None, caches: SessionCaches) -> Handover:
        """``last``, the session's last handover, when it can still be taken back: under handover ``handover``
        "incremental" (under "all" the previous model's cache was given away), while the model it went to is the
        ``owner`` and the conversation was not cut back past it (it is forgotten then); else ConfigError."""
        if handover != "incremental":
            raise ConfigError("a handover can only be taken back under handover 'incremental' (under 'all' the "
                              "previous model's cache is given away at the switch)")
        if last is None or owner != last.target or last.source not in caches:
            raise ConfigError("no handover to take back: the last model to read was not handed the conversation, "
                              "or the conversation was cut back past the switch since")
        return last

    def undo(self, caches: SessionCaches) -> None:
        """Return the target's cache to what it held before the handover (none, if it had none)."""
        if self.held is None:
            caches.drop(self.target)
        else:
            caches.rewind(self.target, self.held, self.own)


def hand_over(caches: SessionCaches, models: Mapping, mapper, source: str, target: str, tokens: list[int],
              plan: HandoffPlan, info: SelectionInfo, *, give_away: bool,
              cache_factory: CacheFactory) -> tuple[MappedCache, Handover]:
    """Hand the conversation ``tokens`` over from ``source`` to ``target`` by ``mapper`` (`pair_mapper`) under
    ``plan``: the target's cache of it as a `MappedCache` whose recompute (the exact prefix, the policy's picks) is
    left to its next forward (`MappedCache.read`), and the handover's record. A target that holds a cache catches up
    on the positions appended since (its own prefix stays as it was); one that holds none gets the whole
    conversation mapped, nothing of it its own (its exact prefix is recomputed in place), in a fresh cache of its
    own engine's (``cache_factory``), never of the kind of the cache it is mapped from. give_away: the source's
    cache is mapped and forgotten (handover "all")."""
    current = caches.drop(source) if give_away else caches[source]
    ids = torch.tensor([tokens], device=current.device)
    held = caches.length(target) if target in caches else None
    record = Handover(source, target, len(tokens), held, caches.own_length(target))
    if target in caches:
        mapped = catch_up(caches[target], current, mapper, models[source], models[target], ids, plan, info)
    else:
        mapped = map_for_target(models[source], models[target], mapper, ids, plan, current, info,
                                cache_factory=cache_factory)
        caches.start(target, mapped.cache)
    return mapped, record
