"""The quality guard: before a mapped cache serves, score it cheaply and fall back to a re-prefill when the score
says the mapping is degraded; and the measurement of the guard on dev conversations (AUROC, threshold).

At a switch the receiving model reads the new turn anyway (on top of the mapped history), so its next-token
distributions at the new turn's positions come for free; the previous model can read the same tokens over its own
cache (a forward pass of the new turn only, then rolled back) for a reference. Signals (`config.GUARD_SIGNALS`):

- "logloss": the receiving model's mean log-loss on the new turn's tokens minus the previous model's;
- "kl": the mean KL(previous model ‖ receiving model) of the next-token distributions at those positions;
- "kl_answer": that KL at the new turn's last position (the distribution of the answer's first token);
- "entropy": the receiving model's mean next-token entropy at those positions (no reference needed);
- "entropy_gain": that minus the previous model's mean entropy at the same positions over its own cache (how much
  more the turn surprises the receiving model than the one that read the conversation: a turn that is uncertain
  for any model, such as an open question, does not count against the mapping);
- "mapped_share": the share of the conversation's positions before the new turn that this switch maps (no model
  output needed).

The reference signals (`config.REFERENCE_GUARD_SIGNALS`) cost a forward pass of the new turn's tokens through the
previous model (`SwitchingSession.preview_turn`), next to a re-prefill of the whole conversation by the receiving
model; under a recompute policy that ranks by that same read (`turn_attention`) it serves both. The others cost
nothing. A score above the threshold means: re-prefill.

The guard belongs to the mapper pair: each ordered pair's `GuardPolicy` (signal, threshold, window and where they
came from) is built once when the server starts (`guard_policies`): a threshold configured in `ServeConfig` for
every pair, else the one recorded in the pair's mapper manifest (`mapper.manifest.GuardCalibration`, written by
`kvhandoff guard-calibrate`), else none — that pair's switches serve mapped.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import torch

from kvhandoff.errors import ConfigError
from kvhandoff.mapper.manifest import GuardCalibration, MapperManifest
from kvhandoff.model.cache import kl_divergence
from kvhandoff.runtime.plan import DEFAULT_PLAN, HandoffPlan
from kvhandoff.runtime.policy import RecomputePolicy
from kvhandoff.runtime.session import SwitchingSession
from kvhandoff.serving.config import (
    DEFAULT_GUARD_SIGNAL,
    DEFAULT_GUARD_WINDOW,
    GUARD_SIGNALS,
    REFERENCE_GUARD_SIGNALS,
    Escalate,
    Fallback,
    GuardAction,
    ServeConfig,
    parse_guard_action,
)
from kvhandoff.serving.decoding import greedy_answer


def mean_entropy(logprobs: torch.Tensor) -> float:
    """Mean next-token entropy (nats) of log-probs [k, vocab]."""
    return float(-(logprobs.exp() * logprobs).sum(-1).mean())


def check_signal(signal: str) -> str:
    """``signal`` if it is one of `GUARD_SIGNALS`, else a ConfigError naming them."""
    if signal not in GUARD_SIGNALS:
        raise ConfigError(f"guard signal must be one of {', '.join(GUARD_SIGNALS)}, got {signal!r}")
    return signal


def needs_reference(signal: str) -> bool:
    """Whether ``signal`` scores against the previous model's reference pass over the new turn."""
    return check_signal(signal) in REFERENCE_GUARD_SIGNALS


def guard_score(signal: str, served: torch.Tensor, reference: torch.Tensor | None, ids: Sequence[int],
                mapped_share: float | None = None) -> float | None:
    """The guard's score of a mapped cache (higher: more degraded).

    served / reference: log-probs [k, vocab] of the last k positions of the new turn ``ids`` from the receiving
    model over the mapped history and from the previous model over its own cache (None for a signal that needs no
    reference); mapped_share: the share of the positions before the new turn that were mapped ("mapped_share"
    only). None when the signal has nothing to score ("logloss" needs two positions: k − 1 tokens are predicted
    inside the turn).
    """
    if needs_reference(signal) and reference is None:
        raise ConfigError(f"guard signal {signal!r} needs the previous model's reference log-probs")
    if signal == "mapped_share":
        if mapped_share is None:
            raise ConfigError("guard signal 'mapped_share' needs the share of positions mapped")
        return float(mapped_share)
    if signal == "entropy":
        return mean_entropy(served)
    reference = reference.to(served.device)
    if signal == "entropy_gain":
        return mean_entropy(served) - mean_entropy(reference)
    if signal == "kl":
        return float(kl_divergence(reference, served).mean())
    if signal == "kl_answer":
        return float(kl_divergence(reference[-1:], served[-1:]).mean())
    k = served.shape[0]
    if k < 2:
        return None
    following = torch.tensor(list(ids)[-(k - 1):], device=served.device)[:, None]
    served_loss = -served[:-1].gather(1, following).mean()
    reference_loss = -reference[:-1].gather(1, following).mean()
    return float(served_loss - reference_loss)


# -- each pair's guard ----------------------------------------------------------------------------------------------
#: where a pair's guard comes from: "configured" (`ServeConfig.guard_threshold`, the same for every pair),
#: "recorded" (the pair's mapper manifest, `kvhandoff guard-calibrate`), "none" (no guard: switches serve mapped)
GUARD_SOURCES = ("recorded", "configured", "none")


@dataclass(frozen=True)
class GuardPolicy:
    """The quality guard of one ordered pair (from → to), as the server applies it at that pair's switches: a
    mapped cache whose ``signal`` score exceeds ``threshold`` (over the new turn's last ``window`` positions) is
    re-prefilled (``action`` a `Fallback`) or handed over again with a larger recompute budget (an `Escalate`).
    source: one of `GUARD_SOURCES`; note: why a pair has no guard, or what to know about its record (None: nothing);
    recorded: the manifest's record the policy came from (source "recorded" only)."""

    source: str
    signal: str | None = None
    threshold: float | None = None
    window: int = DEFAULT_GUARD_WINDOW
    note: str | None = None
    recorded: GuardCalibration | None = None
    action: GuardAction = field(default_factory=Fallback)

    def __post_init__(self) -> None:
        if self.source not in GUARD_SOURCES:
            raise ConfigError(f"a guard's source must be one of {', '.join(GUARD_SOURCES)}, got {self.source!r}")
        if not isinstance(self.action, Fallback | Escalate):
            raise ConfigError(f"a guard's action is a Fallback or an Escalate (parse_guard_action reads a spec), got "
                              f"{self.action!r}")
        if self.active:
            check_signal(self.signal)
            if isinstance(self.threshold, bool) or not isinstance(self.threshold, int | float):
                raise ConfigError(f"a {self.source} guard needs a threshold, got {self.threshold!r}")

    @property
    def active(self) -> bool:
        """Whether this pair's switches are scored (a source other than "none")."""
        return self.source != "none"

    @property
    def needs_reference(self) -> bool:
        return self.active and needs_reference(self.signal)

    def rejects(self, score: float | None) -> bool:
        """Whether a mapped cache with this ``score`` falls back (a switch with nothing to score serves)."""
        return self.active and score is not None and score > self.threshold

    def report(self, score: float | None) -> dict | None:
        """The guard's part of a handoff report (`protocol.GuardInfo`): None when the pair has none."""
        if not self.active:
            return None
        return {"signal": self.signal, "score": score, "threshold": float(self.threshold), "source": self.source}

    def to_dict(self) -> dict:
        """The policy as /health shows it: signal, threshold, window and source (None for a pair without a guard),
        the note, and the record it came from."""
        data = {"source": self.source, "signal": self.signal,
                "threshold": None if self.threshold is None else float(self.threshold),
                "window": self.window if self.active else None, "action": self.action.spec if self.active else None,
                "note": self.note}
        if self.recorded is not None:
            data["recorded"] = self.recorded.to_dict()
        return data

    def describe(self, source: str, target: str) -> str:
        """One line for the server's start-up log."""
        pair = f"{source} → {target}"
        if not self.active:  # the note names the pair
            return self.note or f"no guard for {pair}: switches are served mapped"
        line = f"guard for {pair}: {self.signal} > {self.threshold:.4g} over the new turn's last {self.window} " \
               f"positions → {self.action.spec} ({self.source}"
        if self.recorded is not None:
            record = self.recorded
            auroc = "-" if record.auroc is None else f"{record.auroc:.2f}"
            line += (f": AUROC {auroc} for {record.label} on {record.dev_switches} dev switches, recompute "
                     f"{record.recompute}")
        line += ")"
        return line if self.note is None else f"{line}; {self.note}"


#: what a start-up line says of a pair without a recorded guard
NO_GUARD_HINT = ("run `kvhandoff guard-calibrate` with the server's --models/--mapper to record one, or give "
                 "--guard-threshold (and --guard-signal) for every pair")


def recorded_guard(mapper) -> GuardCalibration | None:
    """The guard recorded in ``mapper``'s manifest (None: none, or a stand-in mapper without a manifest)."""
    manifest = getattr(mapper, "manifest", None)
    return manifest.guard if isinstance(manifest, MapperManifest) else None


def guard_policy(config: ServeConfig, recorded: GuardCalibration | None, pair: str = "this pair",
                 recompute: RecomputePolicy | None = None) -> GuardPolicy:
    """One pair's `GuardPolicy` under ``config`` (`ServeConfig`'s rule), given the guard recorded for it (None:
    none). ``pair`` names it in the notes; ``recompute``: the policy its switches are served under (None:
    ``config.served_recompute``)."""
    if not config.guard:
        return GuardPolicy("none", note="the quality guard is off (--guard off): switches are served mapped")
    if config.guard_threshold is not None:
        return GuardPolicy("configured", config.guard_signal or DEFAULT_GUARD_SIGNAL, float(config.guard_threshold),
                           config.guard_window or DEFAULT_GUARD_WINDOW, action=config.guard_action or Fallback())
    if recorded is None:
        return GuardPolicy("none", note=f"no guard recorded for {pair}: switches are served mapped without a guard; "
                                        f"{NO_GUARD_HINT}")
    if recorded.signal not in GUARD_SIGNALS:
        return GuardPolicy("none", note=(
            f"the guard recorded for {pair} scores {recorded.signal!r}, a signal this kvhandoff does not know: "
            f"switches are served mapped without a guard; upgrade kvhandoff or record it again"), recorded=recorded)
    wanted = {"signal": config.guard_signal, "window": config.guard_window}
    differing = [f"{name} {getattr(recorded, name)} (configured: {value})" for name, value in wanted.items()
                 if value is not None and value != getattr(recorded, name)]
    if differing:
        return GuardPolicy("none", note=(
            f"the guard recorded for {pair} has {', '.join(differing)}: switches are served mapped without a "
            f"guard; serve without --guard-signal/--guard-window to use the record, give --guard-threshold, or "
            f"record one for the configured signal (`kvhandoff guard-calibrate --signal "
            f"{config.guard_signal or recorded.signal}`)"), recorded=recorded)
    try:
        action = config.guard_action or parse_guard_action(recorded.action)
    except ConfigError as exc:
        return GuardPolicy("none", note=(
            f"the guard recorded for {pair} acts by {recorded.action!r}, which this kvhandoff cannot read ({exc}): "
            f"switches are served mapped without a guard; give --guard-action, or record it again"),
            recorded=recorded)
    note = None
    served = (recompute or config.served_recompute).spec
    if recorded.recompute != served:
        note = (f"measured under recompute {recorded.recompute}, served under {served}: record it again under the "
                f"served policy (`kvhandoff guard-calibrate --recompute {served}`)")
    return GuardPolicy("recorded", recorded.signal, recorded.threshold, recorded.window, note, recorded, action)


def guard_policies(config: ServeConfig, mappers: Mapping, recomputes: Mapping | None = None
                   ) -> dict[tuple[str, str], GuardPolicy]:
    """Each ordered pair's `GuardPolicy`: ``mappers`` (from, to) → mapper, under ``config``; ``recomputes``: (from,
    to) → the `RecomputePolicy` its switches are served under (absent: ``config.served_recompute``)."""
    recomputes = recomputes or {}
    return {pair: guard_policy(config, recorded_guard(mapper), f"{pair[0]} → {pair[1]}", recomputes.get(pair))
            for pair, mapper in mappers.items()}


# -- measuring the guard on dev conversations ----------------------------------------------------------------------
@dataclass(frozen=True)
class GuardRecord:
    """One handoff of a dev conversation: the guard's score, and whether the receiving model's greedy answer
    after the handoff differs from its answer after re-prefilling the conversation itself.

    first_kl: KL(re-prefilled ‖ handed-over) of the distribution of the answer's first token; handed / own: the
    greedy answers (token ids) after the handoff and after the re-prefill; escalated: the answer after the same
    handoff with a larger recompute budget (None when not measured)."""

    conversation: int
    turn: int
    source: str
    target: str
    mapped_tokens: int
    score: float | None
    differs: bool
    first_kl: float | None = None
    handed: tuple[int, ...] = field(default=())
    own: tuple[int, ...] = field(default=())
    escalated: tuple[int, ...] | None = None


@dataclass(frozen=True)
class GuardSummary:
    """How well the scores predict a changed answer: AUROC, and the threshold chosen on these records (the one
    maximising catch rate − false-fallback rate, with `max_false_fallback` as a bound when given) with its catch
    rate (changed answers it sends to re-prefill) and false-fallback rate (unchanged answers it re-prefills)."""

    signal: str
    handoffs: int
    changed: int
    auroc: float | None
    threshold: float | None
    catch_rate: float | None
    false_fallback_rate: float | None

    def to_dict(self) -> dict:
        return asdict(self)


def auroc(scores: Sequence[float], labels: Sequence[bool]) -> float | None:
    """Probability that a positive's score exceeds a negative's (ties count half); None without both classes."""
    positives = [s for s, y in zip(scores, labels, strict=True) if y]
    negatives = [s for s, y in zip(scores, labels, strict=True) if not y]
    if not positives or not negatives:
        return None
    wins = sum((p > n) + 0.5 * (p == n) for p in positives for n in negatives)
    return wins / (len(positives) * len(negatives))


def flag_rates(scores: Sequence[float], labels: Sequence[bool], threshold: float) -> tuple[float | None, float | None]:
    """(catch rate, false-fallback rate) of the guard "act when score > threshold": the share of the positives it
    flags and of the negatives; None for a class with no records."""
    flagged = [s > threshold for s in scores]
    positives = sum(labels)
    negatives = len(labels) - positives
    caught = sum(f and y for f, y in zip(flagged, labels, strict=True))
    false = sum(f and not y for f, y in zip(flagged, labels, strict=True))
    return (caught / positives if positives else None), (false / negatives if negatives else None)


def choose_threshold(scores: Sequence[float], labels: Sequence[bool],
                     max_false_fallback: float | None = None) -> tuple[float | None, float | None, float | None]:
    """(threshold, catch rate, false-fallback rate) of the guard "fall back when score > threshold" that maximises
    catch − false-fallback rate (ties: the higher threshold), among thresholds whose false-fallback rate is at
    most ``max_false_fallback`` when given. Rates are None for a class with no records."""
    if not scores:
        return None, None, None
    ordered = sorted(set(scores))
    candidates = [ordered[0] - 1.0, *ordered]
    best = None
    for threshold in candidates:
        catch, false_rate = flag_rates(scores, labels, threshold)
        if max_false_fallback is not None and false_rate is not None and false_rate > max_false_fallback:
            continue
        gain = (catch or 0.0) - (false_rate or 0.0)
        if best is None or gain >= best[0]:
            best = (gain, threshold, catch, false_rate)
    if best is None:
        return None, None, None
    return best[1], best[2], best[3]


#: what makes a dev switch bad, for choosing a threshold (`relabel`): "answer_changed" — the receiving model's
#: greedy answer after the handoff differs from its answer after a re-prefill (`GuardRecord.differs`);
#: "first_token_kl_above_0.5" — the distribution of the answer's first token moved by more than 0.5 nats of KL from
#: the re-prefilled one
GUARD_LABELS: dict[str, Callable[[GuardRecord], bool]] = {
    "answer_changed": lambda record: record.differs,
    "first_token_kl_above_0.5": lambda record: record.first_kl is not None and record.first_kl > 0.5,
}


def relabel(records: Iterable[GuardRecord], label: str) -> list[GuardRecord]:
    """``records`` with `GuardRecord.differs` saying whether each switch is bad as ``label`` (`GUARD_LABELS`)
    says."""
    if label not in GUARD_LABELS:
        raise ConfigError(f"guard label must be one of {', '.join(GUARD_LABELS)}, got {label!r}")
    bad = GUARD_LABELS[label]
    return [dataclasses.replace(record, differs=bad(record)) for record in records]


def summarize_guard(records: Iterable[GuardRecord], signal: str,
                    max_false_fallback: float | None = None) -> GuardSummary:
    """AUROC and the chosen threshold of ``records`` (records without a score are left out)."""
    scored = [r for r in records if r.score is not None]
    scores, labels = [r.score for r in scored], [r.differs for r in scored]
    threshold, catch, false_rate = choose_threshold(scores, labels, max_false_fallback)
    return GuardSummary(signal, len(scored), sum(labels), auroc(scores, labels), threshold, catch, false_rate)


@torch.inference_mode()
def guard_records(models, mappers, conversations, signal: str = "logloss", max_new_tokens: int = 16,
                  window: int = 64, stop_ids=(), handover: str = "incremental",
                  plan: HandoffPlan | None = None) -> list[GuardRecord]:
    """Run dev conversations through a `SwitchingSession` and record every handoff.

    conversations: each a sequence of (model name, new turn's token ids). At each turn the named model reads the
    turn and answers greedily (``max_new_tokens``, stopping before ``stop_ids``). At a switch the guard scores the
    mapped cache, the receiving model answers over it, then re-prefills the conversation and answers again; the
    record says whether the two answers differ. The conversation goes on with the re-prefilled answer, so later
    turns do not inherit earlier mapping errors. handover / plan: as in `SwitchingSession`.
    """
    return guard_records_by_signal(models, mappers, conversations, (signal,), max_new_tokens, window, stop_ids,
                                   handover, plan)[signal]


@dataclass(frozen=True)
class _Answering:
    """How every model of a guard measurement answers (greedy, bounded, stopping before any of ``stop_ids``)."""

    max_new_tokens: int
    stop_ids: frozenset

    def answer(self, session, server: str, logprobs: torch.Tensor, feed_last: bool = False) -> tuple[int, ...]:
        return tuple(greedy_answer(session, server, logprobs, self.max_new_tokens, self.stop_ids, feed_last))


def _escalated_answer(session: SwitchingSession, server: str, ids: list[int], escalated: HandoffPlan,
                      answering: _Answering) -> tuple[int, ...]:
    """The answer after the same switch handed over under the ``escalated`` plan, on a fork of the session (the
    session itself is left as it was)."""
    twin = session.fork()
    twin.plan, twin.pair_plans = escalated, {}
    return answering.answer(twin, server, twin.read_logprobs(server, ids)[-1])


class WithinTime:
    """The items of a sequence in order while time is left (checked as each one starts, counted in `started`)."""

    def __init__(self, items, time_limit_s: float | None) -> None:
        self.items, self.time_limit_s, self.started = items, time_limit_s, 0

    def __iter__(self):
        begun = time.monotonic()
        for item in self.items:
            if self.time_limit_s is not None and time.monotonic() - begun > self.time_limit_s:
                return
            self.started += 1
            yield item


@torch.inference_mode()
def guard_records_by_signal(models, mappers, conversations, signals: Sequence[str] = GUARD_SIGNALS,
                            max_new_tokens: int = 16, window: int = 64, stop_ids=(), handover: str = "incremental",
                            plan: HandoffPlan | None = None, time_limit_s: float | None = None,
                            escalate: RecomputePolicy | None = None,
                            pair_plans: Mapping | None = None) -> dict[str, list[GuardRecord]]:
    """`guard_records` for several signals in one pass (the answers do not depend on the signal): signal → records.
    With ``time_limit_s`` no conversation starts after that many seconds (the records of those that ran). With
    ``escalate`` (a `RecomputePolicy`, e.g. `Recent(0.5)`) every switch is also handed over with that policy
    and its answer recorded (`GuardRecord.escalated`): what a guard raising the recompute budget would serve.
    pair_plans: as in `SwitchingSession`."""
    signals = tuple(check_signal(signal) for signal in signals)
    reference_needed = any(needs_reference(signal) for signal in signals)
    answering = _Answering(max_new_tokens, frozenset(stop_ids))
    escalated = None if escalate is None else (plan or DEFAULT_PLAN).with_recompute(escalate)
    records: dict[str, list[GuardRecord]] = {signal: [] for signal in signals}
    for c, turns in enumerate(WithinTime(conversations, time_limit_s)):
        session = SwitchingSession(models, mappers, handover, plan, pair_plans=pair_plans)
        for t, (server, ids) in enumerate(turns):
            ids = list(ids)
            previous = session.owner
            if previous is None or previous == server:
                answering.answer(session, server, session.read_logprobs(server, ids)[-1], feed_last=True)
                continue
            before = len(session.tokens)
            mapped_tokens = before - session.cached_length(server)
            escalated_answer = (None if escalated is None
                                else _escalated_answer(session, server, ids, escalated, answering))
            reference, turn_read = (session.preview_turn(server, ids, window) if reference_needed
                                    else (None, None))
            served = session.read_logprobs(server, ids, window, source_turn_read=turn_read)
            scores = {signal: guard_score(signal, served, reference, ids, mapped_tokens / before)
                      for signal in signals}
            length = len(session.tokens)
            handed = answering.answer(session, server, served[-1])
            session.truncate(length)
            own_logprobs = session.reprefill(server)
            first_kl = float(kl_divergence(own_logprobs[None], served[-1:]).mean())
            own = answering.answer(session, server, own_logprobs, feed_last=True)
            for signal in signals:
                records[signal].append(GuardRecord(c, t, previous, server, mapped_tokens, scores[signal],
                                                   handed != own, first_kl, handed, own, escalated_answer))
    return records


def measure_guard(models, mappers, conversations, signal: str = "logloss", max_new_tokens: int = 16,
                  window: int = 64, stop_ids=(), max_false_fallback: float | None = None,
                  **session_options) -> tuple[GuardSummary, list[GuardRecord]]:
    """`guard_records` on dev conversations, summarised (`summarize_guard`): (summary, records)."""
    records = guard_records(models, mappers, conversations, signal, max_new_tokens, window, stop_ids,
                            **session_options)
    return summarize_guard(records, signal, max_false_fallback), records
