"""One ordered pair's switch policy: everything a switch from one model to another decides, resolved once.

A front end (the HTTP server, a vLLM connector, a script) reads what its user says of switches into one
`SwitchSettings` (plain values, validated there), then `pair_policies` resolves each ordered pair's `PairPolicy`
from those settings, the records with the pair's mapper (`MapperManifest.recompute`, `MapperManifest.guard`) and what
the pair's backends can do (`seam.Capabilities`):

- the recompute policy (`ServedRecompute`): the one the settings name for every pair, else the one recorded with the
  pair's mapper — chosen again from its recorded trade-off when the settings give other bounds — else
  `DEFAULT_RECOMPUTE`; a recorded one the backend cannot serve gives way to the default (said in the log), a named
  one is refused;
- the quality guard (`GuardPolicy`): a threshold the settings give for every pair, else the pair's recorded guard,
  else none; a recorded escalation the backend cannot serve falls back instead;
- the `HandoffPlan` its sessions hand over by: the exact prefix, that recompute policy, the prefix store.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kvhandoff.config import require_positive
from kvhandoff.errors import ConfigError
from kvhandoff.mapper.manifest import RECORD_HINT, GuardCalibration, RecomputeChoice
from kvhandoff.runtime import policy
from kvhandoff.runtime.offset import DEFAULT_OFFSET_RECOMPUTE, check_offset_policy
from kvhandoff.runtime.plan import HandoffPlan, recorded_policy, recorded_recompute
from kvhandoff.runtime.policy import DEFAULT_RECOMPUTE, RecomputePolicy
from kvhandoff.runtime.prefix_store import PrefixStore
from kvhandoff.runtime.seam import TRANSFORMERS_CAPABILITIES, Capabilities
from kvhandoff.runtime.switch.guard import (
    DEFAULT_GUARD_SIGNAL,
    DEFAULT_GUARD_WINDOW,
    GUARD_SIGNALS,
    NO_GUARD_HINT,
    Escalate,
    Fallback,
    GuardAction,
    GuardPolicy,
    parse_guard_action,
    recorded_guard,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SwitchSettings:
    """What a front end's user says of every pair's switches, validated once where it enters.

    exact_prefix: the leading positions a target recomputes itself (None: each mapper's own setting). recompute: one
    `RecomputePolicy` for every pair, given as one or as a spec such as "sinks:10%" and stored parsed (None: each
    pair's recorded policy, else `DEFAULT_RECOMPUTE`). min_retention / min_speedup: other bounds under which each
    pair's recorded policy is chosen again from the trade-off recorded with it (`RecomputeChoice.rechosen`; None: the
    record's own bound); not with recompute. guard: score a mapped cache before it serves (False: never, for every
    pair). guard_threshold: a guard for every pair ("configured"), scoring guard_signal (default
    `DEFAULT_GUARD_SIGNAL`) over the new turn's last guard_window positions (default `DEFAULT_GUARD_WINDOW`); without
    one each pair uses the guard recorded with its mapper, unless guard_signal or guard_window differ from the record's
    (then that pair has no guard, said at start-up). guard_action: what a flagged switch does, a `Fallback` or an
    `Escalate` (or its spec, "fallback", "escalate:recent:35%"), stored parsed; None: each recorded guard's action,
    else a fallback. offset_reuse: reuse a run of the history another conversation holds after another beginning
    (`kvhandoff.runtime.offset`); offset_recompute: what the target recomputes of such a run, a policy ranking by the
    target alone (None: `DEFAULT_OFFSET_RECOMPUTE`), stored parsed.
    """

    exact_prefix: int | None = None
    recompute: RecomputePolicy | str | None = None
    min_retention: float | None = None
    min_speedup: float | None = None
    guard: bool = True
    guard_signal: str | None = None
    guard_threshold: float | None = None
    guard_window: int | None = None
    guard_action: GuardAction | str | None = None
    offset_reuse: bool = True
    offset_recompute: RecomputePolicy | str | None = None

    def __post_init__(self) -> None:
        if self.exact_prefix is not None:
            require_positive("exact_prefix", self.exact_prefix, minimum=0)
        for name in ("min_retention", "min_speedup"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, float(require_positive(name, getattr(self, name), float, minimum=0)))
        if self.rechooses_recompute and self.recompute is not None:
            raise ConfigError("recompute (--recompute) names one policy for every pair, min_retention / min_speedup "
                              "(--min-retention / --min-speedup) choose each pair's from its recorded trade-off: give "
                              "one or the other")
        if self.recompute is not None:  # parsed here, once: sessions hold the policy object
            object.__setattr__(self, "recompute", policy.parse(self.recompute))
        if not isinstance(self.guard, bool):
            raise ConfigError(f"guard must be True or False, got {self.guard!r}")
        if self.guard_signal is not None and self.guard_signal not in GUARD_SIGNALS:
            raise ConfigError(f"guard_signal must be one of {', '.join(GUARD_SIGNALS)} (or None: the recorded one), "
                              f"got {self.guard_signal!r}")
        threshold = self.guard_threshold
        if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, int | float)
                                      or threshold != threshold):
            raise ConfigError(f"guard_threshold must be a number (or None: each pair's recorded one), got "
                              f"{threshold!r}")
        if self.guard_window is not None:
            require_positive("guard_window", self.guard_window)
        if self.guard_action is not None:
            object.__setattr__(self, "guard_action", parse_guard_action(self.guard_action))
        if not isinstance(self.offset_reuse, bool):
            raise ConfigError(f"offset_reuse must be True or False, got {self.offset_reuse!r}")
        offset = DEFAULT_OFFSET_RECOMPUTE if self.offset_recompute is None else policy.parse(self.offset_recompute)
        # the server's reuse hands a turn-attention policy the holder's read of the new turn (`offset.held_read`)
        object.__setattr__(self, "offset_recompute", check_offset_policy(offset, source_read=True))

    @property
    def rechooses_recompute(self) -> bool:
        """Whether each pair's recorded recompute policy is chosen again under other bounds."""
        return self.min_retention is not None or self.min_speedup is not None

    @property
    def served_recompute(self) -> RecomputePolicy:
        """The recompute policy of a pair without a recorded one: the named one, else `DEFAULT_RECOMPUTE`."""
        return DEFAULT_RECOMPUTE if self.recompute is None else self.recompute

    def plan(self, prefix_store: PrefixStore | None = None) -> HandoffPlan:
        """The handoffs' plan of a pair without a policy of its own, the exact prefixes kept in ``prefix_store``."""
        return HandoffPlan(self.exact_prefix, self.served_recompute, prefix_store)

    def offset_plan(self, prefix_store: PrefixStore | None = None) -> HandoffPlan:
        """The plan of a run reused at another offset (`SwitchingSession.reuse`): ``offset_recompute``, the new
        beginning's exact prefix kept in ``prefix_store``."""
        return HandoffPlan(None, self.offset_recompute, prefix_store)

    def to_dict(self) -> dict:
        """The settings as plain values (policies as their specs)."""
        return {**dataclasses.asdict(self), "offset_recompute": self.offset_recompute.spec,
                "recompute": None if self.recompute is None else self.recompute.spec,
                "guard_action": None if self.guard_action is None else self.guard_action.spec}


# -- the recompute policy --------------------------------------------------------------------------------------------
#: where a pair's recompute policy came from ("tradeoff": chosen again from the recorded trade-off)
RECOMPUTE_SOURCES = ("configured", "recorded", "tradeoff", "default")


@dataclass(frozen=True)
class ServedRecompute:
    """One ordered pair's recompute policy as its switches serve it, where it came from (`RECOMPUTE_SOURCES`) and
    the record with the pair's mapper (source "recorded" or "tradeoff"; with source "default", a record the backend
    does not serve)."""

    policy: RecomputePolicy
    source: str
    recorded: RecomputeChoice | None = None

    def __post_init__(self) -> None:
        if self.source not in RECOMPUTE_SOURCES:
            raise ConfigError(f"a recompute policy's source must be one of {', '.join(RECOMPUTE_SOURCES)}, got "
                              f"{self.source!r}")

    def describe(self, source: str, target: str) -> str:
        """One line for a start-up log."""
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


def served_recompute(settings: SwitchSettings, recorded: RecomputeChoice | None, pair: str = "this pair",
                     capabilities: Capabilities = TRANSFORMERS_CAPABILITIES) -> ServedRecompute:
    """One pair's `ServedRecompute` under ``settings``, given the policy recorded for it (None: none) and what its
    backend can do. A record this kvhandoff cannot read, one that cannot be chosen again under the settings' bounds,
    or a named policy the backend cannot serve is refused (ConfigError naming the pair and the fix)."""
    if settings.recompute is not None:
        if not capabilities.serves(settings.recompute):
            raise ConfigError(capabilities.refusal(settings.recompute), field="recompute")
        return ServedRecompute(settings.recompute, "configured")
    if settings.rechooses_recompute:
        if recorded is None:
            raise ConfigError(f"no recompute trade-off is recorded with the mapper of {pair}, so min_retention / "
                              f"min_speedup cannot choose its policy: record one ({RECORD_HINT}) or name a policy "
                              "(--recompute)", field="recompute")
        try:
            recorded = recorded.rechosen(settings.min_retention, settings.min_speedup)
        except ConfigError as exc:
            raise ConfigError(f"{pair}: {exc}", field="recompute") from exc
        chosen = ServedRecompute(recorded_policy(recorded, pair), "tradeoff", recorded)
    else:
        found = recorded_policy(recorded, pair)  # the record's spec is read here, where the policy is resolved
        chosen = ServedRecompute(found, "recorded", recorded) if found is not None else None
    if chosen is None:
        return ServedRecompute(DEFAULT_RECOMPUTE, "default")
    if not capabilities.serves(chosen.policy):
        how = "recorded" if chosen.source == "recorded" else "chosen from the trade-off recorded"
        logger.warning("%s: the recompute policy %s for %s (%s) ranks positions with a transformers model's layers; "
                       "this pair is served under %s instead", capabilities.engine, how, pair, chosen.policy.spec,
                       DEFAULT_RECOMPUTE.spec)
        return ServedRecompute(DEFAULT_RECOMPUTE, "default", chosen.recorded)
    return chosen


# -- the guard ------------------------------------------------------------------------------------------------------
def guard_policy(settings: SwitchSettings, recorded: GuardCalibration | None, pair: str = "this pair",
                 recompute: RecomputePolicy | None = None,
                 capabilities: Capabilities = TRANSFORMERS_CAPABILITIES) -> GuardPolicy:
    """One pair's `GuardPolicy` under ``settings``, given the guard recorded for it (None: none). ``pair`` names it in
    the notes; ``recompute``: the policy its switches are served under (None: ``settings.served_recompute``);
    ``capabilities``: what its backend can do (an escalation a named guard action asks for and the backend cannot
    serve is refused; a recorded one falls back instead, said in the log)."""
    if isinstance(settings.guard_action, Escalate) and not capabilities.serves(settings.guard_action.recompute):
        raise ConfigError(capabilities.refusal(settings.guard_action.recompute), field="guard_action")
    guard = _guard_policy(settings, recorded, pair, recompute)
    if isinstance(guard.action, Escalate) and not capabilities.serves(guard.action.recompute):
        logger.warning("%s: the guard recorded for %s escalates to %s, which ranks positions with a transformers "
                       "model's layers; its flagged switches re-prefill instead", capabilities.engine, pair,
                       guard.action.recompute.spec)
        guard = dataclasses.replace(guard, action=Fallback())
    return guard


def _guard_policy(settings: SwitchSettings, recorded: GuardCalibration | None, pair: str,
                  recompute: RecomputePolicy | None) -> GuardPolicy:
    if not settings.guard:
        return GuardPolicy("none", note="the quality guard is off (--guard off): switches are served mapped")
    if settings.guard_threshold is not None:
        return GuardPolicy("configured", settings.guard_signal or DEFAULT_GUARD_SIGNAL,
                           float(settings.guard_threshold), settings.guard_window or DEFAULT_GUARD_WINDOW,
                           action=settings.guard_action or Fallback())
    if recorded is None:
        return GuardPolicy("none", note=f"no guard recorded for {pair}: switches are served mapped without a guard; "
                                        f"{NO_GUARD_HINT}")
    if recorded.signal not in GUARD_SIGNALS:
        return GuardPolicy("none", note=(
            f"the guard recorded for {pair} scores {recorded.signal!r}, a signal this kvhandoff does not know: "
            f"switches are served mapped without a guard; upgrade kvhandoff or record it again"), recorded=recorded)
    wanted = {"signal": settings.guard_signal, "window": settings.guard_window}
    differing = [f"{name} {getattr(recorded, name)} (configured: {value})" for name, value in wanted.items()
                 if value is not None and value != getattr(recorded, name)]
    if differing:
        return GuardPolicy("none", note=(
            f"the guard recorded for {pair} has {', '.join(differing)}: switches are served mapped without a "
            f"guard; serve without --guard-signal/--guard-window to use the record, give --guard-threshold, or "
            f"record one for the configured signal (`kvhandoff guard-calibrate --signal "
            f"{settings.guard_signal or recorded.signal}`)"), recorded=recorded)
    try:
        action = settings.guard_action or parse_guard_action(recorded.action)
    except ConfigError as exc:
        return GuardPolicy("none", note=(
            f"the guard recorded for {pair} acts by {recorded.action!r}, which this kvhandoff cannot read ({exc}): "
            f"switches are served mapped without a guard; give --guard-action, or record it again"),
            recorded=recorded)
    note = None
    served = (recompute or settings.served_recompute).spec
    if recorded.recompute != served:
        note = (f"measured under recompute {recorded.recompute}, served under {served}: record it again under the "
                f"served policy (`kvhandoff guard-calibrate --recompute {served}`)")
    return GuardPolicy("recorded", recorded.signal, recorded.threshold, recorded.window, note, recorded, action)


# -- the pair's policy ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PairPolicy:
    """What a switch from ``source`` to ``target`` does: its handoffs' ``plan`` (exact prefix, recompute policy,
    prefix store), where that recompute policy came from (``recompute``), and its quality ``guard``."""

    source: str
    target: str
    plan: HandoffPlan
    recompute: ServedRecompute
    guard: GuardPolicy

    def __post_init__(self) -> None:
        if self.plan.recompute != self.recompute.policy:
            raise ConfigError(f"the plan of {self.name} recomputes by {self.plan.recompute.spec}, its policy says "
                              f"{self.recompute.policy.spec}: build a PairPolicy with pair_policy")

    @property
    def name(self) -> str:
        return f"{self.source} → {self.target}"

    def escalated_plan(self, plan: HandoffPlan) -> HandoffPlan:
        """``plan`` (a session's plan of this pair) under the guard's escalation budget (its action an `Escalate`)."""
        if not isinstance(self.guard.action, Escalate):
            raise ConfigError(f"the guard of {self.name} does not escalate ({self.guard.action.spec})")
        return plan.with_recompute(self.guard.action.recompute)

    def describe(self) -> tuple[str, str]:
        """The start-up log's lines: the recompute policy's and the guard's."""
        return self.recompute.describe(self.source, self.target), self.guard.describe(self.source, self.target)


def pair_policy(settings: SwitchSettings, source: str, target: str, mapper, prefix_store: PrefixStore | None = None,
                capabilities: Capabilities = TRANSFORMERS_CAPABILITIES) -> PairPolicy:
    """The `PairPolicy` of switches from ``source`` to ``target`` under ``settings``: ``mapper`` is the pair's (its
    manifest's records are read), ``capabilities`` what the pair's backends can do together."""
    name = f"{source} → {target}"
    recompute = served_recompute(settings, recorded_recompute(mapper), name, capabilities)
    guard = guard_policy(settings, recorded_guard(mapper), name, recompute.policy, capabilities)
    plan = settings.plan(prefix_store).with_recompute(recompute.policy)
    return PairPolicy(source, target, plan, recompute, guard)


def pair_capabilities(source: Capabilities, target: Capabilities) -> Capabilities:
    """What a switch between backends ``source`` and ``target`` can do: the rules both serve."""
    if source.recompute_rules is None:
        return target
    if target.recompute_rules is None:
        return source
    rules = tuple(rule for rule in source.recompute_rules if rule in target.recompute_rules)
    return Capabilities(source.engine if source.engine == target.engine else f"{source.engine}/{target.engine}",
                        rules)


def pair_policies(settings: SwitchSettings, mappers: Mapping, prefix_store: PrefixStore | None = None,
                  capabilities: Callable[[str], Capabilities] | None = None
                  ) -> dict[tuple[str, str], PairPolicy]:
    """Each ordered pair's `PairPolicy`: ``mappers`` (from, to) → mapper, under ``settings``; ``capabilities``: a
    model's name → what its backend can do (None: every model a `transformers` one)."""
    def of(name: str) -> Capabilities:
        return TRANSFORMERS_CAPABILITIES if capabilities is None else capabilities(name)

    return {(source, target): pair_policy(settings, source, target, mapper, prefix_store,
                                          pair_capabilities(of(source), of(target)))
            for (source, target), mapper in mappers.items()}
