"""The quality guard: before a mapped cache serves, score it cheaply and fall back to a re-prefill when the score
says the mapping is degraded; and the measurement of the guard on dev conversations (AUROC, threshold).

At a switch the receiving model reads the new turn anyway (on top of the mapped history), so its next-token
distributions at the new turn's positions come for free; the previous model can read the same tokens over its own
cache (a forward pass of the new turn only, then rolled back) for a reference. Signals (`config.GUARD_SIGNALS`):

- "logloss": the receiving model's mean log-loss on the new turn's tokens minus the previous model's;
- "kl": the mean KL(previous model ‖ receiving model) of the next-token distributions at those positions;
- "kl_answer": that KL at the new turn's last position (the distribution of the answer's first token);
- "entropy": the receiving model's mean next-token entropy at those positions (no reference needed);
- "mapped_share": the share of the conversation's positions before the new turn that this switch maps (no model
  output needed).

The reference signals (`config.REFERENCE_GUARD_SIGNALS`) cost a forward pass of the new turn's tokens through the
previous model, next to a re-prefill of the whole conversation by the receiving model; the others cost nothing. A
score above the threshold means: re-prefill.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from kvhandoff.errors import ConfigError
from kvhandoff.model.cache import kl_divergence
from kvhandoff.runtime.plan import DEFAULT_PLAN, HandoffPlan
from kvhandoff.runtime.policy import RecomputePolicy
from kvhandoff.runtime.seam import as_kv_cache
from kvhandoff.runtime.session import SwitchingSession
from kvhandoff.serving.config import GUARD_SIGNALS, REFERENCE_GUARD_SIGNALS
from kvhandoff.serving.decoding import greedy_answer


@torch.inference_mode()
def reference_logprobs(model, cache, ids: Sequence[int], keep: int) -> torch.Tensor:
    """``model`` reads ``ids`` on top of its own ``cache`` and forgets them again (the cache is rolled back);
    float32 log-probs of the last ``keep`` positions [min(keep, len(ids)), vocab]."""
    kv = as_kv_cache(cache)
    length = kv.length
    logits = kv.read(model, torch.tensor([list(ids)], device=kv.device), min(keep, len(ids)))
    kv.truncate(length)
    return logits[0].float().log_softmax(-1)


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
        return float(-(served.exp() * served).sum(-1).mean())
    reference = reference.to(served.device)
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


def choose_threshold(scores: Sequence[float], labels: Sequence[bool],
                     max_false_fallback: float | None = None) -> tuple[float | None, float | None, float | None]:
    """(threshold, catch rate, false-fallback rate) of the guard "fall back when score > threshold" that maximises
    catch − false-fallback rate (ties: the higher threshold), among thresholds whose false-fallback rate is at
    most ``max_false_fallback`` when given. Rates are None for a class with no records."""
    if not scores:
        return None, None, None
    ordered = sorted(set(scores))
    candidates = [ordered[0] - 1.0, *ordered]
    positives = sum(labels)
    negatives = len(labels) - positives
    best = None
    for threshold in candidates:
        flagged = [s > threshold for s in scores]
        caught = sum(f and y for f, y in zip(flagged, labels, strict=True))
        false = sum(f and not y for f, y in zip(flagged, labels, strict=True))
        catch = caught / positives if positives else None
        false_rate = false / negatives if negatives else None
        if max_false_fallback is not None and false_rate is not None and false_rate > max_false_fallback:
            continue
        gain = (catch or 0.0) - (false_rate or 0.0)
        if best is None or gain >= best[0]:
            best = (gain, threshold, catch, false_rate)
    if best is None:
        return None, None, None
    return best[1], best[2], best[3]


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
    twin.plan = escalated
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
                            escalate: RecomputePolicy | None = None) -> dict[str, list[GuardRecord]]:
    """`guard_records` for several signals in one pass (the answers do not depend on the signal): signal → records.
    With ``time_limit_s`` no conversation starts after that many seconds (the records of those that ran). With
    ``escalate`` (a `RecomputePolicy`, e.g. `Recent(0.5)`) every switch is also handed over with that policy
    and its answer recorded (`GuardRecord.escalated`): what a guard raising the recompute budget would serve."""
    signals = tuple(check_signal(signal) for signal in signals)
    reference_needed = any(needs_reference(signal) for signal in signals)
    answering = _Answering(max_new_tokens, frozenset(stop_ids))
    escalated = None if escalate is None else (plan or DEFAULT_PLAN).with_recompute(escalate)
    records: dict[str, list[GuardRecord]] = {signal: [] for signal in signals}
    for c, turns in enumerate(WithinTime(conversations, time_limit_s)):
        session = SwitchingSession(models, mappers, handover, plan)
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
            reference = (reference_logprobs(models[previous], session.cache(previous), ids, window)
                         if reference_needed else None)
            served = session.read_logprobs(server, ids, window)
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
