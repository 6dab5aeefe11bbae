"""Calibrating a hosted family's quality guard on its own dev conversations (`kvhandoff guard-calibrate`), and the
conversations the guard is measured on.

Conversations are CoQA stories with their questions (`coqa.dev_conversations`: the dev split, never the stories
`kvhandoff-lab guard-eval` holds out and reports on, never the demo's story), in the server's chat format: the first
turn is the chat template's rendering of the story and the first question (with the generation prompt), every later
turn what the template adds after an assistant answer — the end of the answer's message, the next question as a
user message and the generation prompt (`chat_turns`). The serving model switches every turn; conversation i serves
the i-th ordered pair of the family (cycling), so every direction is measured alike (`pair_schedule`).

Each switch is measured as the server would hand it over (`guard.guard_records_by_signal` under the server's
handover and recompute settings): the guard's score, the receiving model's greedy answer over the mapped cache and
after re-prefilling. Per direction, the threshold of the chosen signal is the one maximising catch rate −
false-fallback rate on that direction's switches (`guard.choose_threshold`, bounded by ``target_rate`` when given),
recorded in the direction's mapper manifest (`mapper.manifest.GuardCalibration`, `record_guards`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from kvhandoff.coqa import Conversation, dev_conversations
from kvhandoff.errors import ConfigError
from kvhandoff.mapper.manifest import GUARD_RULES, GuardCalibration
from kvhandoff.mapper.mapper import Mapper
from kvhandoff.progress import Progress, as_progress
from kvhandoff.serving.chat import DEFAULT_CHAT_TEMPLATE
from kvhandoff.serving.config import DEFAULT_GUARD_SIGNAL, DEFAULT_GUARD_WINDOW, GUARD_SIGNALS, ServeConfig
from kvhandoff.serving.decoding import end_ids
from kvhandoff.serving.guard import (
    GUARD_LABELS,
    GuardRecord,
    guard_records_by_signal,
    needs_reference,
    relabel,
    summarize_guard,
)
from kvhandoff.serving.recompute import pair_plans, pair_recomputes

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
    the one with the highest dev AUROC). label: what makes a switch bad (`guard.GUARD_LABELS`). target_rate: the
    bound on the dev false-fallback rate the threshold is chosen under (None: none). config: the server's settings
    the switches are handed over under (handover, exact prefix, and each pair's recompute policy as the server
    would choose it, `recompute.pair_recomputes`) and the window scored
    (``guard_window``, default `DEFAULT_GUARD_WINDOW`). time_limit_s: no conversation starts after it. progress: a
    bar over the conversations (`kvhandoff.progress`)."""
    if signal not in SIGNAL_CHOICES:
        raise ConfigError(f"guard signal must be one of {', '.join(SIGNAL_CHOICES)}, got {signal!r}")
    if label not in GUARD_LABELS:
        raise ConfigError(f"guard label must be one of {', '.join(GUARD_LABELS)}, got {label!r}")
    if target_rate is not None and not 0.0 <= target_rate <= 1.0:
        raise ConfigError(f"target_rate (the dev false-fallback rate bound) must be in 0..1, got {target_rate!r}")
    names = list(models)
    built = calibration_conversations(models[names[0]][1], names, conversations, turns, story_chars)
    signals = GUARD_SIGNALS if signal == BEST_SIGNAL else (signal,)
    recomputes = pair_recomputes(config, mappers)
    plans = pair_plans(config.plan(), recomputes)
    window = config.guard_window or DEFAULT_GUARD_WINDOW
    stop_ids = frozenset().union(*(end_ids(model, tokenizer) for model, tokenizer in models.values()))
    started = time.monotonic()
    with as_progress(progress)(built, total=len(built), desc="guard: dev conversations", unit="conversation") as bar:
        records = guard_records_by_signal({name: model for name, (model, _) in models.items()}, mappers, bar,
                                          signals, max_new_tokens, window, stop_ids, config.handover, config.plan(),
                                          time_limit_s=time_limit_s, pair_plans=plans)
    ran = len({r.conversation for r in records[signals[0]]})
    logger.info("guard measured on %d switches of %d dev conversations in %.0f s", len(records[signals[0]]), ran,
                time.monotonic() - started)
    results: dict[tuple[str, str], GuardCalibration | None] = {}
    for pair in mappers:
        candidates = {s: _calibration(relabel([r for r in records[s] if (r.source, r.target) == pair], label), s,
                                      label, target_rate, recomputes[pair].policy.spec, window)
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
