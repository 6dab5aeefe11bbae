"""The plan of a handoff: what the target recomputes itself after its cache is mapped, validated once at the edge."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from kvhandoff.errors import ConfigError
from kvhandoff.mapper.manifest import RECORD_HINT, MapperManifest, RecomputeChoice
from kvhandoff.runtime import policy
from kvhandoff.runtime.policy import DEFAULT_RECOMPUTE, RecomputePolicy
from kvhandoff.runtime.prefix_store import PrefixStore


@dataclass(frozen=True)
class HandoffPlan:
    """What a handoff's target does to a freshly mapped cache before it reads on.

    exact_prefix: the leading positions it recomputes itself (attention sinks; causal attention makes them exact
        from those tokens alone); None: the mapper's own setting (its fit config's).
    recompute: the selective-recompute policy that picks further mapped positions to recompute (`RecomputePolicy`;
        default `DEFAULT_RECOMPUTE`).
    prefix_store: where the target's own K/V of exact prefixes are kept (`PrefixStore`): a stored prefix is copied,
        not recomputed; a recomputed one is stored. None: always recomputed.

    Built once where the settings enter (`of` reads a recompute spec) and passed down as it is.
    """

    exact_prefix: int | None = None
    recompute: RecomputePolicy = DEFAULT_RECOMPUTE
    prefix_store: PrefixStore | None = None

    def __post_init__(self) -> None:
        prefix = self.exact_prefix
        if prefix is not None and (isinstance(prefix, bool) or not isinstance(prefix, int) or prefix < 0):
            raise ConfigError(f"exact_prefix must be an integer >= 0 or None (the mapper's), got {prefix!r}")
        if not isinstance(self.recompute, RecomputePolicy):
            raise ConfigError(f"a handoff plan's recompute is a RecomputePolicy, got {self.recompute!r}: read a spec "
                              "with HandoffPlan.of or kvhandoff.runtime.policy.parse where it enters")
        if self.prefix_store is not None and not isinstance(self.prefix_store, PrefixStore):
            raise ConfigError(f"a handoff plan's prefix_store is a PrefixStore or None, got {self.prefix_store!r}")

    @classmethod
    def of(cls, exact_prefix: int | None = None, recompute: RecomputePolicy | str | None = None,
           prefix_store: PrefixStore | None = None) -> HandoffPlan:
        """The plan of these settings as they arrive at an edge: ``recompute`` a policy, a spec such as "recent:5%"
        (`policy.parse`) or None (`DEFAULT_RECOMPUTE`)."""
        chosen = DEFAULT_RECOMPUTE if recompute is None else policy.parse(recompute)
        return cls(exact_prefix, chosen, prefix_store)

    def with_recompute(self, recompute: RecomputePolicy) -> HandoffPlan:
        """This plan under another recompute policy."""
        return replace(self, recompute=recompute)

    def prefix_length(self, mapper, total: int) -> int:
        """The exact prefix a context of ``total`` tokens gets under ``mapper`` (its own setting when the plan's is
        None)."""
        prefix = getattr(mapper, "exact_prefix", 0) if self.exact_prefix is None else self.exact_prefix
        return min(max(prefix or 0, 0), total)


#: the plan of a handoff that names none: the mapper's exact prefix, `DEFAULT_RECOMPUTE`, no prefix store
DEFAULT_PLAN = HandoffPlan()


def recorded_recompute(mapper) -> RecomputeChoice | None:
    """The recompute policy recorded in ``mapper``'s manifest (None: none, or a stand-in without a manifest)."""
    manifest = getattr(mapper, "manifest", None)
    return manifest.recompute if isinstance(manifest, MapperManifest) else None


def recorded_policy(recorded: RecomputeChoice | None, pair: str = "this pair") -> RecomputePolicy | None:
    """The policy of a pair's record (None: none recorded). A record this kvhandoff cannot read is refused
    (ConfigError naming the pair and the fix)."""
    if recorded is None:
        return None
    try:
        return policy.parse(recorded.spec)
    except ConfigError as exc:
        raise ConfigError(f"the recompute policy recorded with the mapper of {pair} ({recorded.spec!r}) cannot be "
                          f"read ({exc}): record it again ({RECORD_HINT}) or name a policy (--recompute)",
                          field="recompute") from exc


def recorded_plans(plan: HandoffPlan, mappers: Mapping) -> dict[tuple[str, str], HandoffPlan]:
    """``plan`` under each pair's recorded recompute policy, for the pairs of ``mappers`` ((from, to) → mapper)
    that record one (`recorded_recompute`)."""
    plans = {}
    for (source, target), mapper in mappers.items():
        chosen = recorded_policy(recorded_recompute(mapper), f"{source} → {target}")
        if chosen is not None:
            plans[source, target] = plan.with_recompute(chosen)
    return plans
