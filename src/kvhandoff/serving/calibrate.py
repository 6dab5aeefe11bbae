"""Calibrating a hosted family's quality guard on its own dev conversations (`kvhandoff guard-calibrate`): the
conversations the guard is measured on, the measurement (`guard_records_by_signal`: every switch's score and whether
it changed the answer) and its statistics (AUROC, the threshold chosen).

Conversations are CoQA stories with their questions (`coqa.dev_conversations`: the dev split, never the stories
`kvhandoff-lab guard-eval` holds out and reports on, never the demo's story), in the server's chat format: the first
turn is the chat template's rendering of the story and the first question (with the generation prompt), every later
turn what the template adds after an assistant answer — the end of the answer's message, the next question as a
user message and the generation prompt (`chat_turns`). The serving model switches every turn; conversation i serves
the i-th ordered pair of the family (cycling), so every direction is measured alike (`pair_schedule`).

Each switch is measured as the server would hand it over (`guard_records_by_signal` under the server's
handover and recompute settings): the guard's score, the receiving model's greedy answer over the mapped cache and
after re-prefilling. Per direction, the threshold of the chosen signal is the one maximising catch rate −
false-fallback rate on that direction's switches (`choose_threshold`, bounded by ``target_rate`` when given),
recorded in the direction's mapper manifest (`mapper.manifest.GuardCalibration`, `record_guards`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kvhandoff.coqa import Conversation, dev_conversations
from kvhandoff.errors import ConfigError
from kvhandoff.mapper.manifest import GUARD_RULES, GuardCalibration
from kvhandoff.mapper.mapper import Mapper
from kvhandoff.model.cache import kl_divergence
from kvhandoff.progress import Progress, as_progress
from kvhandoff.runtime.plan import DEFAULT_PLAN, HandoffPlan
from kvhandoff.runtime.policy import RecomputePolicy
from kvhandoff.runtime.session import SwitchingSession
from kvhandoff.runtime.switch.guard import (
    DEFAULT_GUARD_SIGNAL,
    DEFAULT_GUARD_WINDOW,
    GUARD_SIGNALS,
    check_signal,
    guard_score,
    needs_reference,
)
from kvhandoff.runtime.switch.pair import pair_policies
from kvhandoff.serving.chat import DEFAULT_CHAT_TEMPLATE
from kvhandoff.serving.decoding import end_ids, greedy_answer
from kvhandoff.serving.settings import ServeConfig

logger = logging.getLogger(__name__)

#: `calibrate_guard`'s signal choice that measures every signal and takes, per direction, the one with the highest
#: dev AUROC (the free signals first among equals; `DEFAULT_GUARD_SIGNAL` when no AUROC is defined)
BEST_SIGNAL = "best"
SIGNAL_CHOICES = (*GUARD_SIGNALS, BEST_SIGNAL)
_MARK = "\u2063KVHANDOFF-ANSWER\u2063"  # stands for an answer while rendering the turn that follows it


def _render(tokenizer, messages: list[dict]) -> str:
    template = None if getattr(tokenizer, "chat_template", None) else DEFAULT_CHAT_TEMPLATE
    return tokenizer.apply_chat_template(messages, chat_template=template, add_generation_prompt=True,
                                         tokenize=False)


def chat_turns(tokenizer, conversation: Conversation, turns: int, story_chars: int | None = None) -> list[list[int]]:
    """Token ids of each user turn of ``conversation`` in the chat format (module docstring); the answers between
    them are the models' own."""
    questions = [t.question for t in conversation.turns[:turns]]
    if len(questions) < turns:
        raise ConfigError(f"conversation {conversation.id} has {len(questions)} questions, fewer than {turns} turns")
    story = conversation.story if story_chars is None else conversation.story[:story_chars]
    first = [{"role": "user", "content": f"{story}\n\nQ: {questions[0]}"}]

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    ids = [encode(_render(tokenizer, first))]
    for question in questions[1:]:
        text = _render(tokenizer, [*first, {"role": "assistant", "content": _MARK},
                                   {"role": "user", "content": f"Q: {question}"}])
        if text.count(_MARK) != 1:
            raise ConfigError("the chat template does not render an assistant's answer verbatim")
        ids.append(encode(text.split(_MARK)[1]))
    return ids


def switching_schedule(index: int, turns: int, names: Sequence[str], switch_every: int = 1) -> list[str]:
    """The model of each turn of conversation ``index``: starting on ``names[index % 2]``, switching every
    ``switch_every`` turns."""
    if switch_every < 1:
        raise ConfigError(f"switch_every must be positive, got {switch_every}")
    first, second = (names[0], names[1]) if index % 2 == 0 else (names[1], names[0])
    return [first if (t // switch_every) % 2 == 0 else second for t in range(turns)]


def pair_schedule(index: int, turns: int, names: Sequence[str]) -> list[str]:
    """The model of each turn of conversation ``index`` of a family: the index-th ordered pair (cycling) taking
    turns, switching every turn (for two models: `switching_schedule`)."""
    pairs = [(a, b) for a in names for b in names if a != b]
    if not pairs:
        raise ConfigError("the guard is measured on a family of at least two models")
    return switching_schedule(0, turns, pairs[index % len(pairs)])


def calibration_conversations(tokenizer, names: Sequence[str], count: int, turns: int,
                              story_chars: int | None = None) -> list[list[tuple[str, list[int]]]]:
    """``count`` dev conversations of ``turns`` turns as (model name, new turn's token ids), scheduled over the
    family ``names`` (`pair_schedule`)."""
    if turns < 2:
        raise ConfigError(f"turns must be at least 2 (a switch needs a turn before it), got {turns}")
    return [list(zip(pair_schedule(i, turns, names), chat_turns(tokenizer, conversation, turns, story_chars),
                     strict=True))
            for i, conversation in enumerate(dev_conversations(count, min_turns=turns))]


def _preference(signal: str) -> tuple[bool, int]:
    """Among signals of equal AUROC: the free ones first, then `GUARD_SIGNALS`' order."""
    return needs_reference(signal), GUARD_SIGNALS.index(signal)


def _calibration(records: list[GuardRecord], signal: str, label: str, target_rate: float | None,
                 recompute: str, window: int) -> GuardCalibration | None:
    summary = summarize_guard(records, signal, target_rate)
    if summary.threshold is None:
        return None
    conversations = len({r.conversation for r in records if r.score is not None})
    return GuardCalibration(signal, float(summary.threshold), summary.auroc, label, GUARD_RULES[0], target_rate,
                            summary.handoffs, summary.changed, summary.catch_rate, summary.false_fallback_rate,
                            conversations, recompute, window)


def _best(candidates: dict[str, GuardCalibration | None]) -> GuardCalibration | None:
    measured = {signal: c for signal, c in candidates.items() if c is not None}
    if not measured:
        return None
    ranked = [signal for signal, c in measured.items() if c.auroc is not None]
    if not ranked:
        return measured.get(DEFAULT_GUARD_SIGNAL) or next(iter(measured.values()))
    return measured[min(ranked, key=lambda s: (-measured[s].auroc, _preference(s)))]


def calibrate_guard(models, mappers, conversations: int = 20, turns: int = 4, signal: str = DEFAULT_GUARD_SIGNAL,
                    label: str = "answer_changed", target_rate: float | None = None, max_new_tokens: int = 16,
                    time_limit_s: float | None = None, config: ServeConfig = ServeConfig(),  # noqa: B008 - frozen
                    story_chars: int | None = None,
                    progress: Progress | bool = False) -> dict[tuple[str, str], GuardCalibration | None]:
    """The guard of every direction of ``models`` (name → (model, tokenizer)) with ``mappers`` ((from, to) →
    mapper), measured on ``conversations`` dev conversations of ``turns`` turns (module docstring): (from, to) →
    its `GuardCalibration`, None for a direction with no scored switch (e.g. the time limit came first).

    signal: one of `GUARD_SIGNALS`, or `BEST_SIGNAL` (every signal measured in the same pass, each direction taking
    the one with the highest dev AUROC). label: what makes a switch bad (`GUARD_LABELS`). target_rate: the
    bound on the dev false-fallback rate the threshold is chosen under (None: none). config: the server's settings
    the switches are handed over under (handover, exact prefix, and each pair's recompute policy as the server
    would choose it, `pair_policies`) and the window scored (``switch.guard_window``, default
    `DEFAULT_GUARD_WINDOW`). time_limit_s: no conversation starts after it. progress: a bar over the conversations
    (`kvhandoff.progress`)."""
    if signal not in SIGNAL_CHOICES:
        raise ConfigError(f"guard signal must be one of {', '.join(SIGNAL_CHOICES)}, got {signal!r}")
    if label not in GUARD_LABELS:
        raise ConfigError(f"guard label must be one of {', '.join(GUARD_LABELS)}, got {label!r}")
    if target_rate is not None and not 0.0 <= target_rate <= 1.0:
        raise ConfigError(f"target_rate (the dev false-fallback rate bound) must be in 0..1, got {target_rate!r}")
    names = list(models)
    built = calibration_conversations(models[names[0]][1], names, conversations, turns, story_chars)
    signals = GUARD_SIGNALS if signal == BEST_SIGNAL else (signal,)
    policies = pair_policies(config.switch, mappers)
    plans = {pair: chosen.plan for pair, chosen in policies.items()}
    window = config.switch.guard_window or DEFAULT_GUARD_WINDOW
    stop_ids = frozenset().union(*(end_ids(model, tokenizer) for model, tokenizer in models.values()))
    started = time.monotonic()
    with as_progress(progress)(built, total=len(built), desc="guard: dev conversations", unit="conversation") as bar:
        records = guard_records_by_signal({name: model for name, (model, _) in models.items()}, mappers, bar,
                                          signals, max_new_tokens, window, stop_ids, config.handover,
                                          config.switch.plan(), time_limit_s=time_limit_s, pair_plans=plans)
    ran = len({r.conversation for r in records[signals[0]]})
    logger.info("guard measured on %d switches of %d dev conversations in %.0f s", len(records[signals[0]]), ran,
                time.monotonic() - started)
    results: dict[tuple[str, str], GuardCalibration | None] = {}
    for pair in mappers:
        candidates = {s: _calibration(relabel([r for r in records[s] if (r.source, r.target) == pair], label), s,
                                      label, target_rate, policies[pair].recompute.policy.spec, window)
                      for s in signals}
        results[pair] = _best(candidates) if signal == BEST_SIGNAL else candidates[signal]
    return results


def record_guards(mappers: Mapping, guards: Mapping) -> dict[tuple[str, str], Path]:
    """Record each direction's measured guard (``guards``: (from, to) → `GuardCalibration`; None: nothing to
    record) in its mapper's manifest, in the mapper's folder (`Mapper.record_guard`: manifest.json rewritten
    atomically, the tensors untouched); (from, to) → the folder written. Every mapper is checked to have a folder
    before any is written."""
    chosen = {pair: guard for pair, guard in guards.items() if guard is not None}
    unsaved = [f"{a} → {b}" for a, b in chosen if not isinstance(mappers[a, b], Mapper)
               or mappers[a, b].folder is None]
    if unsaved:
        raise ConfigError(f"mappers {', '.join(unsaved)} are not saved in a folder: nothing recorded (give them as "
                          "--mapper FROM:TO=DIR, or save them first)")
    written = {}
    for pair, guard in chosen.items():
        mappers[pair].record_guard(guard)
        written[pair] = mappers[pair].folder
        logger.info("recorded the guard of %s → %s in %s", *pair, written[pair])
    return written


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
