"""A cache that heals, measured (`kvhandoff-lab eval-heal`): multi-turn CoQA conversations whose serving model
switches every ``every`` turns, with and without healing between the turns.

Each conversation (a CoQA story and its questions, the gold answer of each turn read with the next question, as
lm-eval's CoQA prompt: `multiturn.first_segment` / `next_segment`) is served under three conditions, the same turns
by the same models:

- "own": each model reads the conversation on its own cache, catching up on the turns it missed (what a re-prefill
  that keeps its own positions does at every switch);
- "switch": one `SwitchingSession` under the pair's served plans (`pair_plans`: the recompute policy each direction
  serves), incremental handovers: the history is mapped at each switch;
- "healed": the same, and after each turn the model that answered heals its cache (`SwitchingSession.heal`: the
  idle time between an agent's calls), timed.

Answers are greedy, cut at the first newline, and read back out of the conversation (teacher forcing: every
condition's history is the same tokens, so a difference is the cache's). Per turn: the model, whether it is a switch
(another model answered the turn before), F1 against the gold answers, F1 against the "own" answer (agreement),
seconds to the first token, and for "healed" the seconds and positions healed after it. Conversations are taken one
at a time; the result is rewritten after each and a rerun with the same file continues where it stopped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from kvhandoff.errors import ConfigError
from kvhandoff.files import atomic_write_json
from kvhandoff.runtime.plan import HandoffPlan
from kvhandoff.runtime.session import SwitchingSession
from kvhandoff_lab.engine_quality import greedy_answer
from kvhandoff_lab.evaluation.metrics import max_f1, token_f1
from kvhandoff_lab.evaluation.multiturn import STOP, Conversation, first_segment, next_segment
from kvhandoff_lab.evaluation.scoring import encode
from kvhandoff_lab.evaluation.switch import paired_difference
from kvhandoff_lab.resume import stored_part

logger = logging.getLogger(__name__)

HEAL_FORMAT = "kvhandoff-heal-quality/1"
CONDITIONS = ("own", "switch", "healed")
#: the turns a summary compares: every turn, the switches, and the turns right after a switch (same model again)
TURN_KINDS = ("all", "at_switch", "after_switch")


def schedule(turns: int, names: Sequence[str], every: int, first: int = 0) -> list[str]:
    """The model answering each of ``turns`` turns: ``names`` in turn from ``names[first]``, each for ``every``
    turns."""
    if every < 1:
        raise ConfigError(f"every must be a positive number of turns, got {every!r}")
    return [names[(first + t // every) % len(names)] for t in range(turns)]


def segments(conversation: Conversation, tokenizer) -> list[list[int]]:
    """Each turn's tokens: the story and the first question, then the previous gold answer and the next question."""
    ids = [encode(tokenizer, first_segment(conversation))]
    for previous, turn in zip(conversation.turns, conversation.turns[1:], strict=False):
        ids.append(encode(tokenizer, next_segment(previous.answers[0], turn.question), add_special_tokens=False))
    return ids


def run_conversation(conversation: Conversation, servers: Sequence[str], models: Mapping, mappers: Mapping,
                     pair_plans: Mapping[tuple[str, str], HandoffPlan], tokenizer, end_ids, max_new_tokens: int,
                     condition: str) -> list[dict]:
    """Every turn of ``conversation`` under ``condition`` (one of `CONDITIONS`), ``servers[t]`` answering turn t;
    one record per turn (answer, seconds to its first token; healed: the heal's seconds and positions)."""
    if condition not in CONDITIONS:
        raise ConfigError(f"condition must be one of {', '.join(CONDITIONS)}, got {condition!r}")
    turns = segments(conversation, tokenizer)
    if condition == "own":  # a session per model, and the turns each has read
        own = {name: SwitchingSession({name: model}, {}) for name, model in models.items()}
        read_up_to = dict.fromkeys(models, 0)
    else:
        shared = SwitchingSession(models, mappers, "incremental", pair_plans=pair_plans)
    records = []
    for index, (server, ids) in enumerate(zip(servers, turns, strict=True)):
        if condition == "own":
            session = own[server]
            missed = [token for turn in turns[read_up_to[server]:index] for token in turn]
            begin = time.perf_counter()
            if missed:
                session.read(server, missed)
            caught_up = time.perf_counter() - begin
            read_up_to[server] = index + 1
        else:
            session, caught_up = shared, 0.0
        length = len(session.tokens) + len(ids)
        answer, first = greedy_answer(session, server, ids, tokenizer, max_new_tokens, STOP, end_ids)
        session.truncate(length)  # the answer is read back as the next turn's gold answer
        record = {"server": server, "answer": answer.strip(), "first_token_s": round(caught_up + first, 4)}
        if condition == "healed":
            begin = time.perf_counter()
            record["healed"] = session.heal(server)
            record["heal_s"] = round(time.perf_counter() - begin, 4)
        records.append(record)
    return records


def run_heal_quality(models: Mapping, mappers: Mapping, pair_plans: Mapping[tuple[str, str], HandoffPlan],
                     tokenizer, end_ids, conversations: Sequence[Conversation], every: int = 2,
                     max_new_tokens: int = 24, out: Path | None = None, time_budget_s: float | None = None,
                     settings: Mapping | None = None) -> dict:
    """models: the two models by name (small first); mappers and pair_plans: each direction's; conversations: the
    CoQA conversations (each cut to its turns); the first model answers first in even-numbered conversations, the
    second in odd ones. ``settings``: what else identifies the run (e.g. the served policies), stored with it."""
    names = list(models)
    if len(names) != 2:
        raise ConfigError(f"the healing benchmark switches between two models, got {len(names)}")
    result = {"format": HEAL_FORMAT, "models": names, "every": every, "max_new_tokens": max_new_tokens,
              **dict(settings or {})}
    result["records"] = stored_part(out, dict(result))
    started = time.perf_counter()
    for index, conversation in enumerate(conversations):
        if conversation.id in result["records"]:
            continue
        if time_budget_s is not None and time.perf_counter() - started > time_budget_s:
            break
        servers = schedule(len(conversation.turns), names, every, index % 2)
        record = {"gold": [list(turn.answers) for turn in conversation.turns], "servers": servers}
        for condition in CONDITIONS:
            record[condition] = run_conversation(conversation, servers, models, mappers, pair_plans, tokenizer,
                                                 end_ids, max_new_tokens, condition)
        result["records"][conversation.id] = record
        logger.info("conversation %d/%d done", len(result["records"]), len(conversations))
        if out is not None:
            atomic_write_json(out, {**result, "summary": summarize_heal(result)})
    result["summary"] = summarize_heal(result)
    if out is not None:
        atomic_write_json(out, result)
    return result


def _turns(record: dict) -> list[dict]:
    """Each turn of a conversation's record: its index, kind flags, direction and each condition's scores."""
    servers = record["servers"]
    turns = []
    for t, server in enumerate(servers):
        switch = t > 0 and servers[t - 1] != server
        after = t > 1 and not switch and servers[t - 2] != server
        own = record["own"][t]["answer"]
        direction = f"{servers[t - 1]} → {server}" if switch else (
            f"{servers[t - 2]} → {server}" if after else None)
        entry = {"turn": t, "at_switch": switch, "after_switch": after, "direction": direction}
        for condition in CONDITIONS:
            answer = record[condition][t]["answer"]
            entry[condition] = {"f1": max_f1(answer, record["gold"][t]), "agreement": token_f1(answer, own)}
        turns.append(entry)
    return turns


def _compare(turns: list[dict]) -> dict:
    """Mean F1 and agreement per condition over ``turns``, each switched condition's F1 against "own" (paired)."""
    entry: dict = {"turns": len(turns)}
    if not turns:
        return entry
    own = np.array([turn["own"]["f1"] for turn in turns])
    for condition in CONDITIONS:
        f1 = np.array([turn[condition]["f1"] for turn in turns])
        entry[condition] = {"f1": float(f1.mean()),
                            "agreement": float(np.mean([turn[condition]["agreement"] for turn in turns]))}
        if condition != "own":
            entry[condition]["minus_own"] = paired_difference(f1, own)
    return entry


def summarize_heal(result: dict) -> dict:
    """F1 per condition over all turns, the switches and the turns right after a switch (also per direction), with
    paired intervals against "own"; the drift per turn (1 − agreement with "own", by turn index, and its slope); the
    healing's seconds and positions per heal."""
    turns = [turn for record in result["records"].values() for turn in _turns(record)]
    summary: dict = {"conversations": len(result["records"])}
    for kind in TURN_KINDS:
        chosen = [turn for turn in turns if kind == "all" or turn[kind]]
        summary[kind] = _compare(chosen)
        if kind != "all":
            for direction in sorted({turn["direction"] for turn in chosen}):
                summary[kind][direction] = _compare([turn for turn in chosen if turn["direction"] == direction])
    if turns:
        count = max(turn["turn"] for turn in turns) + 1
        drift = {}
        for condition in ("switch", "healed"):
            per_turn = [float(np.mean([1 - turn[condition]["agreement"] for turn in turns if turn["turn"] == t]))
                        for t in range(count)]
            drift[condition] = {"per_turn": [round(value, 4) for value in per_turn],
                                "slope": float(np.polyfit(np.arange(count), per_turn, 1)[0]) if count > 1 else 0.0}
        summary["drift"] = drift
    heals = [turn for record in result["records"].values() for turn in record["healed"] if turn["healed"]]
    if heals:
        summary["healing"] = {"heals": len(heals),
                              "positions": float(np.mean([turn["healed"] for turn in heals])),
                              "seconds": float(np.mean([turn["heal_s"] for turn in heals])),
                              "positions_per_s": float(sum(turn["healed"] for turn in heals)
                                                       / max(sum(turn["heal_s"] for turn in heals), 1e-9))}
    return summary
