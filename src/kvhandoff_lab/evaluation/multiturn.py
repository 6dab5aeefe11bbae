"""Multi-turn model switching on CoQA: the serving model alternates every turn, handing the whole cache over.

Prompt (lm-eval's CoQA format): ``"{story}\\n\\nQ: {q1}\\n\\nA:"``; after each turn the answer and the next
question are appended as ``" {answer}\\n\\nQ: {q}\\n\\nA:"``. Answers are greedy, at most ``max_new_tokens``
(default 50, as OLMES) and cut at the first newline (lm-eval stops at ``"\\nQ:"``; a newline is stricter and
keeps answers short). The conversation is kept as token segments: the first segment is encoded with the
tokenizer's special tokens, later ones without, and the same segmentation is used for every run, so a run's
context differs from another's only through the answers.

Runs per conversation (``a`` and ``b`` are the two models, e.g. small and large):

- ``standalone_a`` / ``standalone_b``: one model serves every turn with its own cache.
- ``switch_a_first``: a, b, a, b, …; ``switch_b_first``: b, a, b, …. At each switch the whole accumulated
  cache (everything before the new question) goes through the mapper in that direction; the new server then
  reads the new tokens itself and answers. Positions make round trips: a's turns go to b and back to a.
- ``switch_a_first_incremental`` / ``switch_b_first_incremental``: the same schedules, but each model keeps its
  own cache and a switch maps only the turns the new server has not cached (``kvhandoff.runtime.handoff.catch_up``), so
  every position is mapped at most once per model.

Drift per turn: SQuAD token F1 between the switched run's answer and the answer of the serving model's
standalone run of the same conversation (1.0 = no drift), and F1 against the gold answers (max over the
references CoQA provides).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

# the CoQA reader is the product's (the demo reads its story); re-exported here for the lab's callers
from kvhandoff.coqa import Conversation, Turn, load_coqa_conversations  # noqa: F401
from kvhandoff.errors import ConfigError
from kvhandoff.runtime.plan import HandoffPlan
from kvhandoff.runtime.policy import DEFAULT_RECOMPUTE, RecomputePolicy
from kvhandoff.runtime.session import HANDOVERS, SwitchingSession
from kvhandoff_lab.evaluation.metrics import max_f1, mean, token_f1
from kvhandoff_lab.evaluation.scoring import (
    OpenContext,
    encode,
    greedy_from,
)

STOP = ("\n",)


def first_segment(conversation: Conversation) -> str:
    return f"{conversation.story}\n\nQ: {conversation.turns[0].question}\n\nA:"


def next_segment(answer: str, question: str) -> str:
    return (f" {answer}" if answer else "") + f"\n\nQ: {question}\n\nA:"


INCREMENTAL_SUFFIX = "_incremental"


def schedules(num_turns: int, names: tuple[str, str] = ("a", "b")) -> dict[str, list[str]]:
    """Serving model per turn for the four runs (each switching schedule runs with both `HANDOVERS`)."""
    a, b = names
    alternate = [a if t % 2 == 0 else b for t in range(num_turns)]
    return {
        f"standalone_{a}": [a] * num_turns,
        f"standalone_{b}": [b] * num_turns,
        f"switch_{a}_first": alternate,
        f"switch_{b}_first": [b if s == a else a for s in alternate],
    }


def run_variants(num_turns: int, names: tuple[str, str] = ("a", "b")) -> dict[str, tuple[list[str], str]]:
    """Every run of a conversation: name → (serving model per turn, handover). The standalone schedules run
    once; the switching ones with each of `HANDOVERS`, the incremental run named with `INCREMENTAL_SUFFIX`."""
    variants = {}
    for run, schedule in schedules(num_turns, names).items():
        for handover in HANDOVERS if run.startswith("switch_") else ("all",):
            variants[run + (INCREMENTAL_SUFFIX if handover == "incremental" else "")] = (schedule, handover)
    return variants


def run_conversation(
    conversation: Conversation,
    schedule: Sequence[str],
    models: Mapping[str, Any],
    mappers: Mapping[tuple[str, str], Any],
    tokenizer,
    max_new_tokens: int = 50,
    exact_prefix: int = 0,
    handover: str = "all",
    recompute: RecomputePolicy | None = None,
) -> dict:
    """Answer every turn with the scheduled model, handing the conversation over at each switch
    (`kvhandoff.runtime.session.SwitchingSession` with ``handover``; a first handoff to a model lets it recompute the
    first ``exact_prefix`` positions itself; ``recompute``: the selective-recompute policy of every handover,
    None = `DEFAULT_RECOMPUTE`)."""
    if len(schedule) != len(conversation.turns):
        raise ConfigError(f"schedule has {len(schedule)} turns, conversation {len(conversation.turns)}")
    plan = HandoffPlan(exact_prefix, DEFAULT_RECOMPUTE if recompute is None else recompute)
    session = SwitchingSession(models, mappers, handover, plan)
    answers: list[str] = []
    with torch.inference_mode():
        for server, turn in zip(schedule, conversation.turns, strict=True):
            if not session.tokens:
                ids = encode(tokenizer, first_segment(conversation))
                if len(ids) < 2:
                    raise ConfigError("conversation prompt encodes to fewer than 2 tokens")
                session.read(server, ids[:-1])
                logprobs = session.read(server, ids[-1:])
            else:
                ids = encode(tokenizer, next_segment(answers[-1], turn.question), add_special_tokens=False)
                logprobs = session.read(server, ids)
            state = OpenContext(models[server], session.cache(server), len(session.tokens), logprobs)
            text, _ = greedy_from(state, tokenizer, max_new_tokens, STOP)
            session.rollback(server)  # the answer's text is fed back with the next question, as in every run
            answers.append(text.strip())
    return {"id": conversation.id, "answers": answers, "servers": list(schedule)}


def summarise_multiturn(
    conversations: Sequence[Conversation], runs: Mapping[str, Mapping[str, dict]], names: tuple[str, str]
) -> dict:
    """Per-turn F1 of each switched run against the serving model's standalone run and against gold."""
    a, b = names
    num_turns = min(len(c.turns) for c in conversations) if conversations else 0
    out: dict[str, Any] = {"conversations": len(conversations), "turns": num_turns, "runs": {}}
    for run, records in runs.items():
        per_turn_gold = np.full((len(conversations), num_turns), np.nan)
        per_turn_ref = np.full((len(conversations), num_turns), np.nan)
        for i, conv in enumerate(conversations):
            record = records[conv.id]
            for t in range(num_turns):
                answer = record["answers"][t]
                per_turn_gold[i, t] = max_f1(answer, conv.turns[t].answers)
                server = record["servers"][t]
                reference = runs.get(f"standalone_{server}", {}).get(conv.id)
                if reference is not None:
                    per_turn_ref[i, t] = token_f1(answer, reference["answers"][t])
        entry: dict[str, Any] = {
            "f1_vs_gold_per_turn": [mean(col) for col in per_turn_gold.T],
            "f1_vs_gold": mean(per_turn_gold) if per_turn_gold.size else float("nan"),
        }
        if run.startswith("switch_"):
            entry["servers"] = run_variants(num_turns, (a, b))[run][0]
            entry["f1_vs_standalone_per_turn"] = [mean(col) for col in per_turn_ref.T]
            entry["drift_per_turn"] = [1.0 - v for v in entry["f1_vs_standalone_per_turn"]]
            entry["f1_vs_standalone"] = mean(per_turn_ref) if per_turn_ref.size else float("nan")
        out["runs"][run] = entry
    return out


def multiturn_switching(
    small_model,
    large_model,
    small_to_large,
    large_to_small,
    tokenizer,
    conversations: Sequence[Conversation],
    max_new_tokens: int = 50,
    names: tuple[str, str] = ("small", "large"),
    exact_prefix: int | None = None,
) -> dict:
    """Run the four schedules (the switching ones with both `HANDOVERS`) on every conversation and summarise
    drift per turn for both directions.

    Returns ``summarise_multiturn(...)`` plus ``"records"`` (run → conversation id → answers).
    """
    if not conversations:
        raise ConfigError("no conversations given")
    if exact_prefix is None:
        exact_prefix = getattr(small_to_large, "exact_prefix", 0)
    a, b = names
    models = {a: small_model, b: large_model}
    mappers = {(a, b): small_to_large, (b, a): large_to_small}
    runs: dict[str, dict[str, dict]] = {}
    for conv in conversations:
        for name, (schedule, handover) in run_variants(len(conv.turns), names).items():
            record = run_conversation(conv, schedule, models, mappers, tokenizer, max_new_tokens, exact_prefix,
                                      handover)
            runs.setdefault(name, {})[conv.id] = record
    return {**summarise_multiturn(conversations, runs, names), "records": runs}
