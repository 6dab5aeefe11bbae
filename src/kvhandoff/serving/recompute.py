"""Each hosted pair's selective-recompute policy, chosen once where the server starts: the policy it is told
(`ServeConfig.recompute`, for every pair), else the one recorded with the pair's mapper (`RecomputeChoice`, chosen
from a measured trade-off: `RECORD_HINT`) — chosen again from that trade-off when the server is given other bounds
(`ServeConfig.min_retention`, `ServeConfig.min_speedup`) — else `DEFAULT_RECOMPUTE`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvhandoff.errors import ConfigError
from kvhandoff.mapper.manifest import RECORD_HINT, RecomputeChoice
from kvhandoff.runtime.plan import HandoffPlan, recorded_policy, recorded_recompute
from kvhandoff.runtime.policy import DEFAULT_RECOMPUTE, RecomputePolicy
from kvhandoff.serving.config import ServeConfig

#: where a pair's recompute policy came from ("tradeoff": chosen again from the recorded trade-off)
RECOMPUTE_SOURCES = ("configured", "recorded", "tradeoff", "default")


@dataclass(frozen=True)
class PairRecompute:
    """One ordered pair's recompute policy as the server applies it, where it came from (`RECOMPUTE_SOURCES`) and
    the record with the pair's mapper (source "recorded"; with source "default", a record the engine does not
    serve)."""

    policy: RecomputePolicy
    source: str
    recorded: RecomputeChoice | None = None

    def __post_init__(self) -> None:
        if self.source not in RECOMPUTE_SOURCES:
            raise ConfigError(f"a recompute policy's source must be one of {', '.join(RECOMPUTE_SOURCES)}, got "
                              f"{self.source!r}")

    def describe(self, source: str, target: str) -> str:
        """One line for the server's start-up log."""
        line = f"recompute for {source} → {target}: {self.policy.spec}"
        if self.source == "configured":
            return f"{line} (--recompute, for every pair)"
        if self.recorded is not None and self.source == "recorded":
            return f"{line} (recorded with its mapper: {self.recorded.describe()})"
        if self.recorded is not None and self.source == "tradeoff":
            return f"{line} (from the trade-off recorded with its mapper, {self.recorded.describe()})"
        if self.recorded is not None:
            return f"{line} (the default: the engine does not serve the one recorded with its mapper, " \
                   f"{self.recorded.spec})"
        return f"{line} (the default: none recorded with its mapper; {RECORD_HINT} records one)"

    def to_dict(self) -> dict:
        """The policy as /health shows it: its spec, source and record."""
        data: dict = {"policy": self.policy.spec, "source": self.source}
        if self.recorded is not None:
            data["recorded"] = self.recorded.to_dict()
        return data


def pair_recompute(config: ServeConfig, recorded: RecomputeChoice | None, pair: str = "this pair"
                   ) -> PairRecompute:
    """One pair's `PairRecompute` under ``config``, given the policy recorded for it (None: none). A record this
    kvhandoff cannot read, or one that cannot be chosen again under the configured bounds, is refused (ConfigError
    naming the pair and the fix)."""
    if config.recompute is not None:
        return PairRecompute(config.recompute, "configured")
    if config.rechooses_recompute:
        if recorded is None:
            raise ConfigError(f"no recompute trade-off is recorded with the mapper of {pair}, so min_retention / "
                              f"min_speedup cannot choose its policy: record one ({RECORD_HINT}) or name a policy "
                              "(--recompute)", field="recompute")
        try:
            recorded = recorded.rechosen(config.min_retention, config.min_speedup)
        except ConfigError as exc:
            raise ConfigError(f"{pair}: {exc}", field="recompute") from exc
        return PairRecompute(recorded_policy(recorded, pair), "tradeoff", recorded)
    chosen = recorded_policy(recorded, pair)  # the record's spec is read here, where the server starts
    if chosen is None:
        return PairRecompute(DEFAULT_RECOMPUTE, "default")
    return PairRecompute(chosen, "recorded", recorded)


def pair_recomputes(config: ServeConfig, mappers: Mapping) -> dict[tuple[str, str], PairRecompute]:
    """Each ordered pair's `PairRecompute`: ``mappers`` (from, to) → mapper, under ``config``."""
    return {pair: pair_recompute(config, recorded_recompute(mapper), f"{pair[0]} → {pair[1]}")
            for pair, mapper in mappers.items()}


def pair_plans(plan: HandoffPlan, recomputes: Mapping[tuple[str, str], PairRecompute]
               ) -> dict[tuple[str, str], HandoffPlan]:
    """Each ordered pair's handoff plan: ``plan`` under the pair's recompute policy (`pair_recomputes`)."""
    return {pair: plan.with_recompute(chosen.policy) for pair, chosen in recomputes.items()}
